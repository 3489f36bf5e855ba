"""The seal of a checkpoint, in either form (a file, or a folder of every rank's shards): a digest of its payload
written with it and checked at every load. Below both forms, so that each imports it and neither the other.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

INTEGRITY = "integrity"
"""The checksum of every other component, written at save time (:func:`payload_digest`): a checkpoint whose
bytes changed afterwards (bit rot, a partial copy, an edit) fails its load instead of resuming from garbage."""


def state_bytes(state: Any) -> int:
    """The bytes of every tensor in a (nested) state: about what torch.save writes, for a full disk's message."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def _digest(value: Any, h) -> None:
    """Feed ``value`` to ``h`` in a canonical order: dict items sorted by key, each tensor as its dtype, shape
    and bytes, every other leaf as its type and repr (what a load gives back equal, hashes equal)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _digest(key, h)
            _digest(value[key], h)
    elif isinstance(value, list | tuple):
        h.update(f"{type(value).__name__[0]}{len(value)}".encode())
        for item in value:
            _digest(item, h)
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


def payload_digest(state: dict[str, Any]) -> str:
    """xxh3-128 of every component of ``state`` but INTEGRITY (memory speed: about a second per 10 GB)."""
    h = xxhash.xxh3_128()
    _digest({k: v for k, v in state.items() if k != INTEGRITY}, h)
    return h.hexdigest()


def sealed(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its INTEGRITY record, as every checkpoint is written."""
    return {**state, INTEGRITY: {"xxh3_128": payload_digest(state)}}


def tampered(state: dict[str, Any]) -> str | None:
    """Why a loaded ``state`` is not what was saved (its payload no longer matches the checksum written with it),
    or None when it matches. A checkpoint written before checksums were (none recorded) is taken as it is."""
    recorded = state.get(INTEGRITY, {}).get("xxh3_128") if isinstance(state.get(INTEGRITY), dict) else None
    if recorded is None:
        return None
    now = payload_digest(state)
    return None if now == recorded else f"its payload hashes to {now}, but {recorded} was written with it"
