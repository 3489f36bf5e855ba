"""Checkpoints: atomic files of named components, newest complete one found by name, the last k kept."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from train.atomic import atomic_path
from train.errors import DataError

log = logging.getLogger(__name__)

_NAME = re.compile(r"^epoch_(\d{4,})\.pt$")


def checkpoint_name(epoch: int) -> str:
    return f"epoch_{epoch:04d}.pt"


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first. Temporary files of an interrupted save never match the pattern."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(folder: Path, epoch: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` atomically as epoch_NNNN.pt, then delete all but the newest ``keep``."""
    final = folder / checkpoint_name(epoch)
    with atomic_path(final) as tmp:
        torch.save(state, tmp)
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    log.info("checkpoint saved: %s", final)
    return final


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file gets the same advice
        raise DataError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); delete it to fall back to the previous one"
        ) from None


def latest_checkpoint(folder: Path) -> Path | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None
