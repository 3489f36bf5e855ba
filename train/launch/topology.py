"""Where this node sits in the job: how many nodes, which one this is, and where they meet.

Read from NNODES / NODE_RANK / RDZV_ENDPOINT / RDZV_ID, or else from SLURM's variables, so the same command
runs on a laptop, on a rented box and inside an sbatch script.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from train.errors import ConfigError

# SLURM jobs derive the rendezvous port from the job id: below Linux's ephemeral range (32768+), so a client
# socket never holds it, and two jobs sharing a first node rarely collide.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000


@dataclass(frozen=True)
class Topology:
    nnodes: int
    node_rank: int
    endpoint: str | None
    """host:port of the c10d rendezvous on the first node; None on a single node (torchrun --standalone)."""
    run_id: str
    source: str
    """Where the settings came from, for messages: 'single node', 'environment' or 'SLURM'."""

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


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,9],cpu1' -> 'gpu03' (what `scontrol show hostnames`
    prints first)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is not a SLURM node list; set RDZV_ENDPOINT=host:port")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer") from None


def topology_from_environ(environ: Mapping[str, str], run_name: str) -> Topology:
    """Explicit variables win over SLURM's; without either, one node."""
    slurm = "SLURM_JOB_ID" in environ
    nnodes = _int(environ, "NNODES")
    source = "environment"
    if nnodes is None and slurm:
        nnodes, source = _int(environ, "SLURM_NNODES"), "SLURM"
    if nnodes is None or nnodes == 1:
        return Topology(1, 0, None, run_name, "single node")
    if nnodes < 1:
        raise ConfigError(f"NNODES={nnodes} must be at least 1")
    node_rank = _int(environ, "NODE_RANK")
    if node_rank is None:
        node_rank = _int(environ, "SLURM_NODEID") if slurm else None
    if node_rank is None:
        raise ConfigError(f"NNODES={nnodes} but NODE_RANK is not set: set NODE_RANK=0..{nnodes - 1} on each node")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"NODE_RANK={node_rank} is outside 0..{nnodes - 1} (NNODES={nnodes})")
    endpoint = environ.get("RDZV_ENDPOINT", "").strip()
    if not endpoint and slurm and environ.get("SLURM_JOB_NODELIST"):
        port = SLURM_PORT_BASE + int(environ["SLURM_JOB_ID"]) % SLURM_PORT_SPAN
        endpoint = f"{first_slurm_host(environ['SLURM_JOB_NODELIST'])}:{port}"
    if not endpoint:
        raise ConfigError(
            f"NNODES={nnodes} needs RDZV_ENDPOINT=host:port, the address of the first node (NODE_RANK=0), "
            "reachable from every node"
        )
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"RDZV_ENDPOINT={endpoint!r} must be host:port, e.g. node01:29400")
    run_id = environ.get("RDZV_ID") or (environ["SLURM_JOB_ID"] if slurm else run_name)
    return Topology(nnodes, node_rank, endpoint, run_id, source)


def threads_per_rank(environ: Mapping[str, str], cores: int, nproc: int) -> int:
    """The compute threads each rank runs: OMP_NUM_THREADS when set, else the launcher's share of the cores this
    process may use (cores // ranks, at least 1). The one rule the launcher applies (train.launch.torchrun)."""
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) >= 1:
        return int(given)
    return max(1, cores // max(1, nproc))
