"""What the doctor's checks look at, gathered once from the machine (or made up by a test), and the form of a
check's answer. Below the doctor and the launch targets' rows, whose engine checks (SLURM's allocation) are
functions of the same facts."""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from train.config import Config
from train.launch.topology import nproc_for

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Facts:
    """What the checks look at, gathered once from the machine (or made up by a test)."""

    environ: Mapping[str, str]
    gpus: int
    versions: dict[str, str | None]
    shm: tuple[int, int] | None
    """(size, free) of /dev/shm in bytes; None when there is none."""
    memlock: int
    """Soft RLIMIT_MEMLOCK in bytes; -1 when unlimited."""
    container: str | None
    nccl_available: bool = False
    gpu_memory: int = 0
    """Bytes of memory of the first GPU; 0 without one."""
    cores: int = 0
    """The cores this process may run on (its CPU affinity: a SLURM cpuset, a container's share); 0 unknown."""
    load: float | None = None
    """The machine's 1-minute load average (runnable processes); None unknown."""


def detect_container(environ: Mapping[str, str]) -> str | None:
    if Path("/.dockerenv").exists():
        return "docker"
    if environ.get("APPTAINER_CONTAINER") or environ.get("SINGULARITY_CONTAINER"):
        return "apptainer"
    if environ.get("ENROOT_ROOTFS") or environ.get("PYXIS_RUNTIME_PATH") or Path("/etc/enroot").is_dir():
        return "enroot (pyxis)"
    if Path("/run/.containerenv").exists():
        return "podman"
    try:
        if re.search(r"docker|containerd|kubepods", Path("/proc/1/cgroup").read_text()):
            return "docker/containerd"
    except OSError:
        pass
    return None


def gather_facts() -> Facts:
    import torch
    import torch.distributed as dist

    try:
        stat = os.statvfs("/dev/shm")
        shm = (stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize)
    except OSError:
        shm = None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    nccl = dist.is_nccl_available()
    nccl_version = None
    if nccl and torch.cuda.is_available():
        nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
    return Facts(
        environ=dict(os.environ),
        gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        versions={"torch": torch.__version__, "CUDA": torch.version.cuda, "NCCL": nccl_version},
        shm=shm,
        memlock=-1 if soft == resource.RLIM_INFINITY else soft,
        container=detect_container(os.environ),
        nccl_available=nccl,
        gpu_memory=torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0,
        cores=len(os.sched_getaffinity(0)),
        load=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    )


def requested_nproc(cfg: Config, nproc: str | int | None, facts: Facts) -> tuple[int | None, str]:
    """The processes this node will start, or None with the reason when the setting is unusable."""
    return nproc_for(cfg.dist.nproc if nproc in (None, "") else nproc, cfg.dist.cpu_nproc, facts.gpus)


def backend_of(cfg: Config, facts: Facts) -> str:
    requested = facts.environ.get("DDP_BACKEND", cfg.dist.backend)
    if requested == "auto":
        return "nccl" if facts.gpus else "gloo"
    return requested
