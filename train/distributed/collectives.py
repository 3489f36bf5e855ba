"""The collectives the rank side uses, in one place: sums and maxima over ranks, returned on the CPU.

Each works unchanged in one process (no group, or a group of one), so single-process callers and tests need
no special case. On NCCL the tensor goes to this rank's GPU first: NCCL reduces device memory only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(values: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values.clone()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    buf = values.to(device)
    dist.all_reduce(buf, op=op)
    return buf.cpu()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Elementwise sum over ranks (of a float64 tensor, for exact counts), on the CPU."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Elementwise max over ranks, on the CPU."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def broadcast_from_main(values: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``values`` on every rank (in place; a no-op without a group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(values, src=0)
    return values


# How gloo and NCCL say that a peer process went away mid-collective (it was killed, or its machine or network).
_PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited or there was a network error",
)


def peer_lost(error: BaseException) -> str | None:
    """The first line of a collective's error that says a peer went away, or None for any other error."""
    text = str(error)
    if isinstance(error, RuntimeError) and any(p in text for p in _PEER_LOST):
        return text.strip().splitlines()[0][:500]
    return None
