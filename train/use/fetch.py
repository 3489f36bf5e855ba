"""A trained model straight from a run's remote copy (``run.remote``): its best checkpoint, or else its newest
verified one, fetched once into a local cache folder and checked against the SHA1 the remote verified."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from train.checkpoint import BEST, BEST_SHARDED, unreadable
from train.errors import DataError
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
