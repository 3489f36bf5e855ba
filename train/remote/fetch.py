"""The checkpoint a source names: a run folder (its best, newest or a named checkpoint), a checkpoint file or
folder, or a run's remote copy (``run.remote``: its best checkpoint, or else its newest verified one, fetched once
into a local cache folder and checked against the SHA1 the remote verified). The Surrogate API, predict, export
and the launcher's fine-tuning source all resolve through here."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from train.checkpoint import (
    BEST,
    BEST_SHARDED,
    checkpoint_digest,
    checkpoint_for_evaluation,
    latest_checkpoint,
    unreadable,
)
from train.checkpoint.shards import is_sharded_checkpoint
from train.config import Config
from train.errors import ConfigError, DataError
from train.remote.pointer import POINTER, read_pointer
from train.remote.restore import fetch_verified
from train.remote.store import open_remote, sha1_of

log = logging.getLogger(__name__)

CACHE_ENV = "TRAIN_MODEL_CACHE"
"""Where fetched checkpoints are kept (default ~/.cache/train/models)."""


def model_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "train" / "models")


def fetch_remote_checkpoint(url: str, b2_api=None) -> Path:
    """``url`` is b2://bucket/prefix/<run name>, the run's folder on its remote."""
    parent, _, run = url.rstrip("/").rpartition("/")
    if not run or parent in ("b2:/", "b2:"):
        raise DataError(f"{url}: give the run's folder on its remote, b2://bucket/prefix/<run name>")
    remote = open_remote(parent, run, b2_api)
    pointer = read_pointer(remote)
    if pointer is None:
        raise DataError(f"{url} holds no {POINTER}: no checkpoint of a run was mirrored there")
    entry = pointer.get("best") or (pointer.get("kept") or [None])[0]
    if not entry:
        raise DataError(f"{url}/{POINTER} lists no checkpoint yet")
    name = entry["name"]
    if entry is pointer.get("best") and name not in (BEST, BEST_SHARDED):
        name = BEST
    dest = model_cache() / url.removeprefix("b2://") / name
    sha1 = entry.get("sha1")
    if dest.is_file() and sha1 and sha1_of(dest) == sha1:
        return dest
    if dest.is_dir() and unreadable(dest) is None:  # a sharded checkpoint fetched before, checked against its manifest
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fetch_verified(remote, f"checkpoints/{name}", dest, sha1)
    log.info("fetched %s/checkpoints/%s into %s", url, name, dest)
    return dest


def resolve_checkpoint(source: str | Path, checkpoint: str | Path = "best", b2_api=None) -> Path:
    """The checkpoint file ``source`` (a run folder, a .pt file or a remote run) and ``checkpoint`` name."""
    text = str(source)
    if text.startswith("b2://"):
        return fetch_remote_checkpoint(text, b2_api)
    path = Path(source)
    if not path.exists() and (Path("runs") / path).is_dir():  # a run's name, as make's RUN= gives it
        path = Path("runs") / path
    if path.is_file() or is_sharded_checkpoint(path):
        return path
    if not path.is_dir():
        raise DataError(f"{path}: no such run folder or checkpoint file; give runs/<name>, a .pt file or b2://...")
    folder = path / "checkpoints"
    if checkpoint == "best":
        found = checkpoint_for_evaluation(folder)
    elif checkpoint == "latest":
        found = latest_checkpoint(folder)
    else:
        given = Path(checkpoint)
        found = given if given.is_file() or is_sharded_checkpoint(given) else folder / str(checkpoint)
        if not (found.is_file() or is_sharded_checkpoint(found)):
            raise DataError(f"checkpoint {checkpoint}: not a file, nor one in {folder}; use best, latest or a path")
    if found is None:
        raise DataError(f"{folder} holds no checkpoint ({BEST} or step_*.pt): train the run first")
    return found


def resolve_initial_weights(cfg: Config, b2_api=None) -> dict | None:
    """The launcher's part: the checkpoint ``train.init_from`` names, as a record for inputs.json (its source,
    the local file and its SHA-256); None without init_from."""
    source = cfg.train.init_from
    if source is None:
        return None
    try:
        path = resolve_checkpoint(source, "best", b2_api)
    except DataError as e:  # said as the setting that asked for it
        raise ConfigError(f"train.init_from={source}: {e}") from None
    return {
        "source": str(source),
        "checkpoint": str(Path(path).resolve()),
        "sha256": checkpoint_digest(Path(path), "sha256"),
    }
