"""The checkpoint every rank starts from (or scores): chosen and read by rank 0, its bytes sent to the others.

Rank 0 runs on node 0, whose run folder is the run's; another node's own run folder may hold an older
checkpoint or none (boxes without a shared file system). So when the group spans nodes, rank 0 alone chooses
and reads the file and broadcasts its bytes, and every rank loads those same bytes (with ``weights_only``, as
from disk). On one node every rank reads the one run folder itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.checkpoint import checkpoint_digest, load_checkpoint, shards
from train.distributed.env import DistEnv
from train.errors import DataError, DistributedError

_FAILED = -1
_FOLDER = b"\x00folder:"
"""Starts rank 0's payload when it chose a sharded checkpoint: its name follows, not its bytes."""


def spans_nodes(env: DistEnv) -> bool:
    return env.world_size > env.local_world_size


def shared_checkpoint(
    env: DistEnv, folder: Path, choose: Callable[[], Path | None], sha1: str | None = None, whole: bool = True
) -> tuple[Path | None, dict[str, Any] | None]:
    """(path, components) of the checkpoint ``choose`` picks on rank 0, on every rank; (None, None) when it
    picks none. ``sha1``: what the file must hash to (node 0's launcher decided on exactly those bytes).
    ``whole=False``: of a sharded checkpoint (a folder, in a run folder every rank reads), only the components
    beside the shards; the caller's ranks read their own shards."""
    if not spans_nodes(env):
        path = choose()
        if path is None:
            return None, None
        if shards.is_sharded_checkpoint(path):
            return path, _open_folder(path, sha1, whole)
        if sha1 is None:
            return path, load_checkpoint(path)
        data = _read(path)  # read once: hashed, then loaded from the same bytes
        _check_sha1(path, data, sha1)
        return path, load_checkpoint(path, data)
    payload, error = b"", None
    if env.is_main:
        try:
            path = choose()
            if path is not None and shards.is_sharded_checkpoint(path):
                payload = _FOLDER + path.name.encode()  # every rank reads it from the shared folder
            elif path is not None:
                data = _read(path)
                if sha1 is not None:
                    _check_sha1(path, data, sha1)
                payload = path.name.encode() + b"\n" + data
        except Exception as e:  # told to the other ranks first, so that none waits in the broadcast
            error = e
    received = _broadcast_bytes(payload, env, failed=error is not None)
    if error is not None:
        raise error
    if received is None:
        raise DistributedError("rank 0 could not read the checkpoint to start from; its log says why")
    if not received:
        return None, None
    if received.startswith(_FOLDER):
        path = folder / received[len(_FOLDER) :].decode()
        if not shards.is_sharded_checkpoint(path):
            raise DataError(
                f"sharded checkpoint {path.name} is in rank 0's run folder but not in {folder} on this node: a "
                "sharded checkpoint needs one folder every node reads (a shared file system); use "
                "dist.checkpoint=full or auto"
            )
        return path, _open_folder(path, sha1, whole)
    name, _, data = received.partition(b"\n")
    path = folder / name.decode()
    return path, load_checkpoint(path, data)


def _open_folder(path: Path, sha1: str | None, whole: bool) -> dict[str, Any]:
    if sha1 is not None and (got := checkpoint_digest(path)) != sha1:
        _changed(path, got, sha1)
    return load_checkpoint(path) if whole else shards.components(path)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"checkpoint {path} cannot be read ({e.strerror or e}); re-run the same command") from None


def _check_sha1(path: Path, data: bytes, sha1: str) -> None:
    got = hashlib.sha1(data).hexdigest()
    if got != sha1:
        _changed(path, got, sha1)


def _changed(path: Path, got: str, sha1: str) -> None:
    raise DataError(
        f"checkpoint {path} changed after the launcher chose it (SHA1 {got}, chosen {sha1}): something else "
        "writes into this run folder; stop it and re-run the same command"
    )


def _broadcast_bytes(payload: bytes, env: DistEnv, *, failed: bool) -> bytes | None:
    """Rank 0's ``payload`` on every rank; None everywhere when rank 0 ``failed``."""
    device = env.device if env.backend == "nccl" else torch.device("cpu")
    size = torch.tensor([_FAILED if failed else len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if n == _FAILED:
        return None
    buffer = torch.empty(n, dtype=torch.uint8, device=device)
    if env.is_main and n:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if n:
        dist.broadcast(buffer, src=0)
    return buffer.cpu().numpy().tobytes()
