"""Where this node sits in the job: how many nodes, which one this is, and where they meet (read by the launch
target the launcher runs under: train.launch.targets); the processes a node starts and their threads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    nnodes: int
    node_rank: int
    endpoint: str | None
    """host:port of the c10d rendezvous on the first node; None on a single node (torchrun --standalone)."""
    run_id: str
    source: str
    """Where the settings came from, for messages: 'single node', 'environment' (NNODES, ...) or the engine's name
    ('SLURM', 'SkyPilot', 'Kubernetes')."""

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def host_port(self) -> tuple[str, int]:
        assert self.endpoint is not None, "single-node launches have no endpoint"
        host, _, port = self.endpoint.rpartition(":")
        return host, int(port)


def nproc_for(setting: str | int | None, cpu_nproc: int, gpus: int) -> tuple[int | None, str]:
    """Processes for this node from NPROC / --nproc / dist.nproc: 'auto' is one per visible GPU, or
    ``cpu_nproc`` without GPUs. Returns (count, 'auto' or 'set'), or (None, why the setting is unusable)."""
    if setting == "auto":
        return (gpus or cpu_nproc), "auto"
    try:
        n = int(setting)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None, f"nproc {setting!r} (NPROC / --nproc / dist.nproc) must be 'auto' or a number"
    return (n, "set") if n >= 1 else (None, f"nproc must be at least 1, got {n}")


def threads_per_rank(environ: Mapping[str, str], cores: int, nproc: int) -> int:
    """The compute threads each rank runs: OMP_NUM_THREADS when set, else the launcher's share of the cores this
    process may use (cores // ranks, at least 1). The one rule the launcher applies (train.launch.torchrun)."""
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) >= 1:
        return int(given)
    return max(1, cores // max(1, nproc))
