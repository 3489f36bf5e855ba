"""Checkpoints: atomic files of named components, found by name, the last k kept plus the best one.

A checkpoint is ``step_NNNNNNNN.pt`` (the optimizer steps done) or ``best.pt`` (the best validation so far).
Files are written to a temporary name and renamed, so a name that matches is always complete; older files
are deleted only after a newer one is safely on disk.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.atomic import atomic_path
from train.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8,})\.pt$")
BEST = "best.pt"

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


@dataclass
class RunState:
    """Where training stands; saved in every checkpoint under PROGRESS."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    best_val: float = math.inf
    bad_validations: int = 0
    early_stopped: bool = False

    def done(self, epochs: int) -> bool:
        """Early stopping is final; reaching train.epochs is not: a run resumed with more epochs continues."""
        return self.early_stopped or self.epoch >= epochs


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def checkpoint_step(name: str) -> int | None:
    """The step of a step checkpoint's file name; None for any other name (best.pt, temporary files)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete step checkpoints, oldest first. Temporary files of an interrupted save never match the pattern."""
    if not folder.is_dir():
        return []
    found = [(step, p) for p in folder.iterdir() if (step := checkpoint_step(p.name)) is not None]
    return [p for _, p in sorted(found)]


def latest_checkpoint(folder: Path) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def save_checkpoint(folder: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` atomically as step_NNNNNNNN.pt, then delete all but the newest ``keep``."""
    final = folder / checkpoint_name(step)
    with atomic_path(final) as tmp:
        torch.save(state, tmp)
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    log.info("checkpoint saved: %s", final)
    return final


def save_best(folder: Path, state: dict[str, Any]) -> Path:
    final = folder / BEST
    with atomic_path(final) as tmp:
        torch.save(state, tmp)
    return final


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load with ``weights_only=True``: a checkpoint is data, never code to run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file gets the same advice
        raise DataError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); delete it to fall back to the previous one"
        ) from None


def checkpoint_for_evaluation(folder: Path) -> Path | None:
    """The best checkpoint when validation chose one, else the newest."""
    best = folder / BEST
    return best if best.is_file() else latest_checkpoint(folder)


def archive_checkpoints(folder: Path) -> Path | None:
    """Move every checkpoint into checkpoints/archive-<UTC time>/ (resume=never): a fresh start loses nothing."""
    files = [*list_checkpoints(folder), *([folder / BEST] if (folder / BEST).is_file() else [])]
    if not files:
        return None
    archive = folder / time.strftime("archive-%Y%m%dT%H%M%SZ", time.gmtime())
    archive.mkdir()
    for path in files:
        shutil.move(path, archive / path.name)
    log.warning("train.resume=never: %d earlier checkpoint(s) moved to %s", len(files), archive)
    return archive


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
    if not path.is_file():
        raise ConfigError(
            f"train.resume={policy}: no such checkpoint file; use auto, never or the path of a .pt checkpoint"
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
    saved_model = {**(defaults or {}), **saved.get(CONFIG, {}).get("model", {})}
    for key in sorted(set(saved_model) | set(model_cfg)):
        if keys is not None and key not in keys:
            continue
        if saved_model.get(key) != model_cfg.get(key):
            differences.append(f"model.{key} ({saved_model.get(key)!r} there, {model_cfg.get(key)!r} here)")
    saved_specs = saved.get(SPECS, {})
    for task in sorted(set(saved_specs) | set(specs)):
        if task not in saved_specs or task not in specs:
            where = "only in the checkpoint" if task in saved_specs else "not in the checkpoint"
            differences.append(f"tasks.{task} ({where})")
            continue
        for key in sorted(set(saved_specs[task]) | set(specs[task])):
            a, b = saved_specs[task].get(key), specs[task].get(key)
            if a != b and not (isinstance(a, list | tuple) and isinstance(b, list | tuple) and list(a) == list(b)):
                differences.append(f"tasks.{task}.{key} ({a!r} there, {b!r} here)")
    return differences


def training_done(folder: Path, epochs: int) -> bool:
    """Whether the newest checkpoint in ``folder`` ends training (the one rule: :meth:`RunState.done`)."""
    path = latest_checkpoint(folder)
    return path is not None and RunState(**load_checkpoint(path)[PROGRESS]).done(epochs)
