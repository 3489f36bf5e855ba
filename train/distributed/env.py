"""The distributed environment of one rank, read once from torchrun's variables into a frozen object."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.errors import ConfigError, DistributedError
from train.obs.log import redacted_environ

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
    def from_environ(cls, backend: str = "auto", fallback: bool = False) -> DistEnv:
        """Read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (set by torchrun; absent means one process).

        ``backend`` is dist.backend, overridden by DDP_BACKEND; ``fallback`` (dist.backend_fallback) lets a
        rank without a usable NCCL run on gloo instead of failing.
        """
        try:
            rank = int(os.environ.get("RANK", 0))
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            world_size = int(os.environ.get("WORLD_SIZE", 1))
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        except ValueError as e:
            raise DistributedError(f"a torchrun variable (RANK, LOCAL_RANK, WORLD_SIZE) is no integer: {e}") from None
        rank = node_ordered_rank(rank, local_rank, world_size, local_world_size)
        backend = resolve_backend(os.environ.get("DDP_BACKEND", backend), fallback)
        if backend == "nccl":
            if local_rank >= torch.cuda.device_count():
                raise DistributedError(
                    f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) visible: launch at most "
                    f"one process per GPU (check --nproc / NPROC and CUDA_VISIBLE_DEVICES)"
                )
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        return cls(rank, local_rank, world_size, local_world_size, backend, device)


def rank_from_environ() -> int:
    """This process's global rank, for naming its log file before anything else can fail."""
    try:
        return node_ordered_rank(*(int(os.environ.get(name, default)) for name, default in _RANK_VARIABLES))
    except (ValueError, ConfigError):
        value = os.environ.get("RANK", "0")
        return int(value) if value.isdigit() else 0


_RANK_VARIABLES = (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_WORLD_SIZE", 1))


def node_ordered_rank(rank: int, local_rank: int, world_size: int, local_world_size: int) -> int:
    """The global rank numbered node by node (node 0's ranks first), from the launcher's TRAIN_NODE_RANK and
    TRAIN_NNODES; torchrun's own RANK when they are unset (one node, tests).

    torchrun's c10d rendezvous numbers the nodes by their addresses as text, so rank 0 may land on any node.
    Rank 0 writes the run's checkpoints, metrics and report, and node 0's launcher decides from its run folder
    what a launch does: with run folders of their own on each node, the two must be on the same node. Any
    permutation of ranks is a valid process group, so the ranks simply take these numbers."""
    node, nnodes = os.environ.get("TRAIN_NODE_RANK"), os.environ.get("TRAIN_NNODES")
    if node is None or nnodes is None:
        return rank
    if world_size != int(nnodes) * local_world_size:
        raise ConfigError(
            f"this node starts {local_world_size} rank(s), but the {nnodes} nodes start {world_size} in all: start "
            "the same number of ranks on every node (the same NPROC / --nproc, and as many visible GPUs)"
        )
    return int(node) * local_world_size + local_rank


def resolve_backend(requested: str, fallback: bool) -> str:
    """auto -> nccl with CUDA, gloo without; nccl without CUDA or NCCL -> an error, or gloo when allowed."""
    if requested not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"backend {requested!r} (dist.backend or DDP_BACKEND) must be auto, nccl or gloo")
    if requested == "gloo":
        return "gloo"
    cuda = torch.cuda.is_available()
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    problem = None if cuda else "no GPU is visible"
    if problem is None and not dist.is_nccl_available():
        problem = "this PyTorch build has no NCCL"
    if problem is None:
        return "nccl"
    if not fallback:
        raise ConfigError(
            f"backend nccl was asked for (dist.backend or DDP_BACKEND) but {problem}; use backend auto or gloo, "
            "or set dist.backend_fallback=true to fall back to gloo"
        )
    _warn_fallback(problem)
    return "gloo"


def _warn_fallback(reason: str) -> None:
    log.warning(
        "!!! FALLING BACK FROM NCCL TO GLOO: %s. Training continues on gloo, which is many times slower on GPUs; "
        "this is for debugging only (dist.backend_fallback=true). !!!",
        reason,
    )


def init_distributed(env: DistEnv, timeout_s: int, fallback: bool = False) -> DistEnv:
    """Join the process group (a group of one is fine: collectives then cost nothing).

    Returns ``env``, or a copy on gloo when NCCL failed to start and ``fallback`` allows it.
    """
    log.debug(
        "rank %d: local rank %d, world size %d, backend %s, device %s; environment: %s",
        env.rank,
        env.local_rank,
        env.world_size,
        env.backend,
        env.device,
        redacted_environ(os.environ),
    )
    if env.device.type == "cuda":
        torch.cuda.set_device(env.local_rank)  # an int, before init: NCCL binds the communicator to this device
    if dist.is_initialized():
        return env
    if "MASTER_ADDR" not in os.environ:  # a plain single process, not under torchrun
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            env.backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=env.device if env.device.type == "cuda" else None,
            **_attempt_store(env, timeout),
        )
    except Exception as e:  # every init failure gets the same actionable wrapper
        if env.backend == "nccl" and fallback:
            _warn_fallback(f"NCCL failed to start ({type(e).__name__}: {e})")
            return _init_gloo_after_nccl_failure(env, timeout)
        raise DistributedError(
            f"rank {env.rank}: joining the process group ({env.backend}, MASTER_ADDR="
            f"{os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}, "
            f"world size {env.world_size}) failed within {timeout_s}s: {e}"
        ) from e
    return env


def _attempt_store(env: DistEnv, timeout: datetime.timedelta) -> dict:
    """Under torchrun, the store with a key prefix of this restart attempt's own. The agent's store lives across
    restarts on one port; a restarted rank that read a peer address the previous attempt left there would
    connect to a dead port ("Connection refused", seen after a SIGKILL restart) and fail the attempt."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {}
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    return {"store": dist.PrefixStore(f"train/attempt_{attempt}", store)}


def _init_gloo_after_nccl_failure(env: DistEnv, timeout: datetime.timedelta) -> DistEnv:
    """A second group on a fresh key prefix of the same store: the failed NCCL attempt's keys never collide."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    store = dist.PrefixStore("gloo-fallback", store)
    dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return dataclasses.replace(env, backend="gloo")  # the GPU stays: gloo all-reduces CUDA tensors via the host


def destroy_distributed(wait_for_peers: bool = False) -> None:
    """Leave the process group; ``wait_for_peers`` (after success) first waits until every rank is done: a
    rank that tears down its gloo group while a peer still uses it can abort at exit ("terminate called
    without an active exception", SIGABRT) after all its work is written."""
    if dist.is_initialized():
        if wait_for_peers and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
