"""The distributed environment of one rank, read once from torchrun's variables into a frozen object."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.errors import ConfigError, DistributedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, backend: str = "auto") -> DistEnv:
        """Read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (set by torchrun; absent means one process)."""
        try:
            rank = int(os.environ.get("RANK", 0))
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            world_size = int(os.environ.get("WORLD_SIZE", 1))
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        except ValueError as e:
            raise DistributedError(f"a torchrun variable (RANK, LOCAL_RANK, WORLD_SIZE) is not an integer: {e}") from None
        backend = os.environ.get("DDP_BACKEND", backend)
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ConfigError(f"backend {backend!r} (dist.backend or DDP_BACKEND) must be auto, nccl or gloo")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("backend nccl needs CUDA, and no GPU is visible; use dist.backend=gloo or auto")
        if torch.cuda.is_available() and backend == "nccl":
            if local_rank >= torch.cuda.device_count():
                raise DistributedError(
                    f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) visible: launch at most "
                    f"one process per GPU (check --nproc / NPROC and CUDA_VISIBLE_DEVICES)"
                )
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        return cls(rank, local_rank, world_size, local_world_size, backend, device)


def init_distributed(env: DistEnv, timeout_s: int) -> None:
    """Join the process group (a group of one is fine: collectives then cost nothing)."""
    if env.device.type == "cuda":
        torch.cuda.set_device(env.local_rank)  # before init: NCCL binds the communicator to this device
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:  # a plain single process, not under torchrun
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    try:
        dist.init_process_group(
            env.backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=env.device if env.device.type == "cuda" else None,
        )
    except Exception as e:  # every init failure gets the same actionable wrapper
        raise DistributedError(
            f"rank {env.rank}: joining the process group ({env.backend}, MASTER_ADDR="
            f"{os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}, "
            f"world size {env.world_size}) failed within {timeout_s}s: {e}"
        ) from e


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a float64 tensor over ranks (on the backend's device), returned on the CPU."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values.clone()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    buf = values.to(device)
    dist.all_reduce(buf)
    return buf.cpu()
