"""Checkpoints: atomic files of named components, found by name, the last k kept plus the best one.

A checkpoint is ``step_NNNNNNNN.pt`` (the optimizer steps done) or ``best.pt`` (the best validation so far); a
sharded model's may instead be a folder of every rank's shards, ``step_NNNNNNNN.dcp`` or ``best.dcp``
(:mod:`train.checkpoint.shards`), read through the same functions here. Files and folders are written to a
temporary name and renamed, so a name that matches is always complete; older ones are deleted only after a newer
one is safely on disk.

In layers: the seal both forms share (:mod:`train.checkpoint.integrity`) at the bottom, the folder form on it
(:mod:`train.checkpoint.shards`), and here the file form, names, listing, pruning, the load that dispatches on
the form and the set-aside of an unreadable one (`python -m train consolidate` is in train/use/export.py).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.atomic import atomic_path
from train.checkpoint import shards
from train.checkpoint.integrity import INTEGRITY, payload_digest, sealed, state_bytes, tampered  # noqa: F401 (theirs too)
from train.config import ModelConfig, flatten, migrate_model_keys, model_keys_in_use
from train.errors import ConfigError, DataError
from train.hashing import file_digest

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8,})\.(pt|dcp)$")
BEST = "best.pt"
BEST_SHARDED = "best" + shards.SUFFIX
CORRUPT = "corrupt"
"""The subfolder unreadable checkpoints are moved into."""

# The named components of a training checkpoint.
MODEL = "model"
"""The bare model's state_dict (never DDP's or the compiled wrapper's)."""
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
"""fp16's gradient scaler; present only when one is used."""
PROGRESS = "progress"
"""Where training stands: a :class:`RunState` as a dict."""
CONFIG = "config"
"""The run's resolved config, as JSON-compatible data."""
SPECS = "specs"
"""Each task's shapes (``TaskSpec.as_dict()``) by task name."""
SPEC_DEFAULTS = {"frame_stride": 1, "boundary": ()}
"""Keys a task's spec gained later, and the value a checkpoint written before them had (it resumes as it was)."""
TASK_CARDS = "task_cards"
"""Each task's use beyond its shapes (``TaskData.card()``): the PDE family, the channel names and the statistics
that normalise its inputs and targets. With CONFIG and SPECS it makes a checkpoint usable without its data,
cache or config file (train.use)."""
MODEL_SOURCE = "model_source"
"""A user factory's source: ``{"file": path, "sha256": hex}`` of the file that defines it (absent for built-ins)."""
DATA = "data"
"""The checksums of the source files the run was trained on when this checkpoint was written (``{task: {file:
checksum}}``): a launch refuses to continue it on other data (train.run_data)."""
WEIGHTS_FROM = "weights_from"
"""With train.init_from: the checkpoint the initial weights came from, as the first launch resolved it."""


@dataclass
class RunState:
    """Where training stands; saved in every checkpoint under PROGRESS."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    best_val: float = math.inf
    bad_validations: int = 0
    early_stopped: bool = False
    world_size: int = 0
    """Ranks that trained to here (0: not recorded): a resume on another number of ranks continues the epoch's
    sequence of samples at the same sample, not at the same step number."""

    def done(self, epochs: int) -> bool:
        """Early stopping is final; reaching train.epochs is not: a run resumed with more epochs continues."""
        return self.early_stopped or self.epoch >= epochs


def checkpoint_name(step: int, sharded: bool = False) -> str:
    return f"step_{step:08d}{shards.SUFFIX if sharded else '.pt'}"


def checkpoint_step(name: str) -> int | None:
    """The step of a step checkpoint's name (file or folder); None for any other name (best.pt, temporary
    files)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete step checkpoints, oldest first. Temporary files of an interrupted save never match the pattern."""
    if not folder.is_dir():
        return []
    found = [(step, p) for p in folder.iterdir() if (step := checkpoint_step(p.name)) is not None and _whole(p)]
    return [p for _, p in sorted(found)]


def _whole(path: Path) -> bool:
    """A .pt checkpoint is a file, a .dcp one a folder (anything else under such a name is no checkpoint)."""
    return path.is_dir() if path.suffix == shards.SUFFIX else path.is_file()


def best_checkpoint(folder: Path) -> Path | None:
    """best.pt or best.dcp, whichever exists (the newer if a run changed form and both do)."""
    found = [p for p in (folder / BEST, folder / BEST_SHARDED) if _whole(p)]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def latest_checkpoint(folder: Path) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def save_checkpoint(folder: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` atomically as step_NNNNNNNN.pt, then delete all but the newest ``keep``."""
    final = folder / checkpoint_name(step)
    with atomic_path(final, needed=state_bytes(state)) as tmp:
        torch.save(sealed(state), tmp)
    prune(folder, keep)
    log.info("checkpoint saved: %s", final)
    return final


def prune(folder: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` step checkpoints (files and folders)."""
    for old in list_checkpoints(folder)[:-keep]:
        shards.remove(old)


def save_best(folder: Path, state: dict[str, Any]) -> Path:
    final = folder / BEST
    with atomic_path(final, needed=state_bytes(state)) as tmp:
        torch.save(sealed(state), tmp)
    shards.remove(folder / BEST_SHARDED)  # one best: the one just written
    return final


LAUNCH_ADVICE = (
    "Re-run the same command: before the ranks start, the launcher moves an unusable checkpoint into "
    "{corrupt}/ (it deletes none) and continues from the newest intact one"
)
"""What a launch's ranks say of an unusable checkpoint (``{corrupt}``: the folder it is moved into)."""
USE_ADVICE = (
    "Give another checkpoint of the run (--checkpoint latest, best or a step's name), or fetch an intact copy from "
    "the run's remote (run.remote keeps the verified ones)"
)
"""What commands that use a trained run (Surrogate.load, predict, export, consolidate) say of one."""


def load_checkpoint(path: Path, data: bytes | None = None, advice: str = LAUNCH_ADVICE) -> dict[str, Any]:
    """Load with ``weights_only=True`` (a checkpoint is data, never code to run) and check its payload against
    the checksum written with it. ``data``: the file's bytes, received from another rank (``path`` then only
    names it). A sharded checkpoint (a folder) is consolidated: the whole state, as a file holds it.
    ``advice``: what the error tells the user to do (the launcher's by default)."""
    if shards.is_sharded_checkpoint(path):
        why = shards.damaged(path)
        if why is None:
            try:
                return shards.consolidated(path)
            except Exception as e:  # any unreadable shard gets the same advice
                why = f"{type(e).__name__}: {e}"
        _refuse(path, why, advice)
    try:
        state = torch.load(io.BytesIO(data) if data is not None else path, map_location="cpu", weights_only=True)
        why = tampered(state) if isinstance(state, dict) else "not a dict of components"
    except Exception as e:  # any unreadable file gets the same advice
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        _refuse(path, why, advice)
    return state


def _refuse(path: Path, why: str, advice: str = LAUNCH_ADVICE) -> None:
    if path.is_file() and path.suffix not in (".pt", ".pth", ".ckpt") and checkpoint_step(path.name) is None:
        why = f"{why}; it is not a checkpoint (a .pt file training wrote, or a {shards.SUFFIX} folder)"
    advice = advice.replace("{corrupt}", str(path.parent / CORRUPT))
    raise DataError(f"checkpoint {path} cannot be used ({why}). {advice}") from None


def small_components(path: Path) -> dict[str, Any]:
    """A checkpoint's components without reading its tensors (memory-mapped, or a sharded checkpoint's
    components file): progress, config, specs, data checksums."""
    if shards.is_sharded_checkpoint(path):
        return shards.components(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def checkpoint_digest(path: Path, algorithm: str = "sha1") -> str:
    """What a checkpoint's bytes hash to: a file's digest, or a sharded checkpoint's manifest's (which names every
    file's checksum). SHA1 for the copies the launchers compare, SHA-256 for a fine-tuned run's source."""
    return file_digest(shards.content_file(path), algorithm)[algorithm]


def misnamed(path: Path, state: dict[str, Any]) -> str | None:
    """Why a step checkpoint's name disagrees with the progress it records (renamed, or another checkpoint saved
    under a step's name: it would be taken for the newest and resumed as the step it holds), or None."""
    step = checkpoint_step(path.name)
    recorded = state.get(PROGRESS, {}).get("global_step") if isinstance(state.get(PROGRESS), dict) else None
    if step is None or not isinstance(recorded, int) or recorded == step:
        return None
    return (
        f"it records global step {recorded}, but its name says step {step}: it was renamed, or another checkpoint "
        f"(a consolidated best.pt?) was saved under this name"
    )


def unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be used as a checkpoint, or None when it can: it must load, its payload must match
    the checksum written with it (memory-mapped: the tensors are read once, to hash them), and a step
    checkpoint's name must be the step it records. A sharded checkpoint's files must match its manifest."""
    if shards.is_sharded_checkpoint(path):
        return shards.damaged(path) or misnamed(path, shards.components(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(state, dict):
            return "not a dict of components"
        return tampered(state) or misnamed(path, state)
    except Exception as e:  # every way a file can be unusable
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def set_aside(path: Path) -> Path:
    """Move ``path`` into ``<its folder>/corrupt/`` under its name and the UTC time: kept for inspection,
    never deleted, and no longer found by the checkpoint patterns."""
    dest = path.parent / CORRUPT / f"{path.name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    dest.parent.mkdir(exist_ok=True)
    os.replace(path, dest)  # a rename within one folder tree
    return dest


def set_aside_unreadable(folder: Path) -> list[Path]:
    """Before a launch resumes or evaluates: move each unreadable newest step checkpoint aside (down to the
    newest readable one) and an unreadable best.pt, warning for each; returns where they went. A run whose
    newest checkpoint was cut short or overwritten continues from the one before it instead of stopping."""
    moved = []
    for restored in shards.recover_replaced(folder):
        log.warning("%s: put back (its replacement was cut short)", restored)
    step_files = list_checkpoints(folder)
    for i in range(len(step_files) - 1, -1, -1):
        reason = unreadable(step_files[i])
        if reason is None:
            break
        with contextlib.suppress(FileNotFoundError):  # another node's launcher on a shared folder was first
            moved.append(dest := set_aside(step_files[i]))
            before = step_files[i - 1].name if i else "none: training starts over"
            log.warning(
                "checkpoint %s cannot be read (%s); moved to %s. Continuing from the one before it (%s)",
                step_files[i].name,
                reason,
                dest,
                before,
            )
    best = best_checkpoint(folder)
    if best is not None and (reason := unreadable(best)) is not None:
        with contextlib.suppress(FileNotFoundError):
            moved.append(dest := set_aside(best))
            newest = latest_checkpoint(folder)
            log.warning(
                "%s cannot be read (%s); moved to %s. best.pt is the checkpoint with the best validation score, "
                "the one evaluation scores: until a later validation improves on that score and writes a new "
                "best.pt, evaluation scores the newest step checkpoint (%s) instead, and the report names it. To "
                "score the best one, put an intact copy back as %s (with run.remote, the remote keeps one)",
                best.name,
                reason,
                dest,
                newest.name if newest else "none yet",
                best,
            )
    return moved


def checkpoint_for_evaluation(folder: Path) -> Path | None:
    """The best checkpoint when validation chose one, else the newest."""
    return best_checkpoint(folder) or latest_checkpoint(folder)


def why_chosen(path: Path) -> str:
    """Why :func:`checkpoint_for_evaluation` chose ``path``, in words for a log line."""
    if path.name in (BEST, BEST_SHARDED):
        return "best.pt, the checkpoint of the best validation score"
    return (
        "the newest step checkpoint: the run wrote no best.pt (it had no validation data, val_fraction 0, or "
        "validation never ran), so the last step's weights are its model"
    )


def archive_checkpoints(folder: Path) -> Path | None:
    """Move every checkpoint into checkpoints/archive-<UTC time>/ (resume=never): a fresh start loses nothing."""
    files = [*list_checkpoints(folder), *[p for p in (folder / BEST, folder / BEST_SHARDED) if _whole(p)]]
    if not files:
        return None
    archive = folder / time.strftime("archive-%Y%m%dT%H%M%SZ", time.gmtime())
    archive.mkdir()
    for path in files:
        shutil.move(path, archive / path.name)
    log.warning("train.resume=never: %d earlier checkpoint(s) moved to %s", len(files), archive)
    return archive


def load_model_state(model: torch.nn.Module, state: dict[str, Any], path: Path, load=None) -> None:
    """Load a checkpoint's weights into ``model`` (``load(model, state)``: how, for a sharded model; default
    ``model.load_state_dict``); weights of another model are a config error (exit 2)."""
    try:
        if load is None:
            model.load_state_dict(state)
        else:
            load(model, state)
    except RuntimeError as e:
        detail = " ".join(line.strip() for line in str(e).strip().splitlines()[:4])
        raise ConfigError(
            f"checkpoint {path} holds the weights of another model ({detail[:800]}). Use the model (model.name, "
            "model.* and its source) it was trained with, or train.resume=never to start over"
        ) from None


def resume_source(policy: str, folder: Path) -> Path | None:
    """The checkpoint to continue from under ``train.resume`` (auto, never, or a path); None: start fresh.

    A path is used only while this run has no checkpoint of its own: after a restart or a preemption the run
    continues from its own newest checkpoint, not from the starting point again.
    """
    own = latest_checkpoint(folder)
    if policy == "auto":
        return own
    if policy == "never":
        return None
    path = Path(policy)
    if own is not None:
        log.info("train.resume=%s ignored: this run continues from its own checkpoint %s", policy, own.name)
        return own
    if not _whole(path):
        raise ConfigError(
            f"train.resume={policy}: no such checkpoint; use auto, never or the path of a .pt checkpoint (or of a "
            f"sharded checkpoint's {shards.SUFFIX} folder)"
        )
    return path


def model_differences(
    saved: dict[str, Any],
    model_cfg: dict[str, Any],
    specs: dict[str, dict],
    defaults: dict[str, Any] | None = None,
    keys: tuple[str, ...] | None = None,
) -> list[str]:
    """Keys under which a checkpoint's model (its model config and task shapes) differs from this run's.
    ``defaults``: the values of model keys that a checkpoint written before they existed does not record;
    ``keys``: the model keys compared (default: all), e.g. only those the run's model.name is built from."""
    differences = []
    saved_model = {**flatten(defaults or {}), **flatten(migrate_model_keys(saved.get(CONFIG, {}).get("model", {})))}
    here = flatten(model_cfg)
    for key in sorted(set(saved_model) | set(here)):
        if keys is not None and key.split(".")[0] not in keys:
            continue
        if saved_model.get(key) != here.get(key):
            differences.append(f"model.{key} ({saved_model.get(key)!r} there, {here.get(key)!r} here)")
    saved_specs = saved.get(SPECS, {})
    for task in sorted(set(saved_specs) | set(specs)):
        if task not in saved_specs or task not in specs:
            where = "only in the checkpoint" if task in saved_specs else "not in the checkpoint"
            differences.append(f"tasks.{task} ({where})")
            continue
        for key in sorted(set(saved_specs[task]) | set(specs[task])):
            if key not in saved_specs[task] and key not in SPEC_DEFAULTS:
                continue  # a key the checkpoint predates, with nothing to compare (a task's field names)
            a, b = saved_specs[task].get(key, SPEC_DEFAULTS.get(key)), specs[task].get(key)
            if a != b and not (isinstance(a, list | tuple) and isinstance(b, list | tuple) and list(a) == list(b)):
                differences.append(f"tasks.{task}.{key} ({a!r} there, {b!r} here)")
    return differences


def check_same_model(saved: dict[str, Any], model_cfg: Any, specs: dict[str, dict], path: Path, doing: str) -> None:
    """A ConfigError naming what differs ("model.name ('fno' there, 'transformer' here)") when ``saved`` is not a
    checkpoint of the model ``model_cfg`` builds for ``specs``; ``doing``: what was about to happen, for the
    message ("resume from", "evaluate")."""
    differences = model_differences(
        saved,
        model_cfg.model_dump(mode="json"),
        specs,
        ModelConfig().model_dump(mode="json"),
        model_keys_in_use(model_cfg.name),
    )
    if differences:
        raise ConfigError(
            f"cannot {doing} {path}: its model differs from this config in "
            + "; ".join(differences)
            + ". Use the checkpoint's settings, or train.resume=never to start over."
        )


def training_done(folder: Path, epochs: int) -> bool:
    """Whether the newest checkpoint in ``folder`` ends training (the one rule: :meth:`RunState.done`)."""
    path = latest_checkpoint(folder)
    if path is None:
        return False
    saved = small_components(path) if shards.is_sharded_checkpoint(path) else load_checkpoint(path)
    return RunState(**saved[PROGRESS]).done(epochs)
