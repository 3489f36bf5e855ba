"""The ``slurm`` section: what ``python -m train slurm`` writes into the sbatch file it renders."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from train.config.section import Section


class SlurmConfig(Section):
    nodes: int = Field(1, ge=1)
    """Nodes of the job; one task per node runs the launcher, which starts one rank per GPU."""
    gpus_per_node: int = Field(8, ge=0)
    """GPUs requested on each node (--gpus-per-node); the launcher starts one rank per visible GPU. 0: a CPU-only
    job without any GPU request (nodes without GPUs reject one), whose launcher starts CPU ranks (dist.nproc, or
    dist.cpu_nproc with nproc auto)."""
    cpus_per_gpu: int = Field(8, ge=1)
    """CPU cores per GPU (the task gets gpus_per_node times this): DataLoader workers run on them."""
    cpus_per_task: int | None = Field(None, ge=1)
    """CPU cores of each node's task (--cpus-per-task), which runs the launcher and all its ranks; default:
    gpus_per_node x cpus_per_gpu with GPUs; with gpus_per_node=0, the CPU ranks (dist.nproc, or dist.cpu_nproc
    with nproc auto) x (train.num_workers + 1)."""
    time: str = "24:00:00"
    """Wall-clock limit (--time), e.g. 24:00:00, 2-00:00:00 or UNLIMITED; at least preempt_signal_s + 120 s."""
    partition: str | None = None
    """Partition (--partition); default: the cluster's default."""
    account: str | None = None
    """Account charged (--account); default: your default account."""
    container: Literal["none", "pyxis", "apptainer"] = "none"
    """Run inside a container: pyxis/enroot (srun --container-image) or apptainer (apptainer exec --nv)."""
    image: str | None = None
    """Container image: a registry reference for pyxis, a .sif file or docker:// reference for apptainer."""
    preempt_signal_s: int = Field(300, ge=10)
    """Seconds before the time limit at which SLURM sends SIGUSR1, so the run checkpoints and requeues. SLURM may
    send it up to 60 s earlier, so `time` must be at least this plus 120 s."""
    requeue: bool = True
    """Requeue the job after a preemption or time-limit stop (exit code 75), so it resumes where it stopped."""
    extra_sbatch: list[str] = []
    """Further #SBATCH options, e.g. ['--qos=high', '--constraint=h100']."""

    @pydantic.model_validator(mode="after")
    def _check_image(self) -> SlurmConfig:
        if self.container != "none" and not self.image:
            raise ValueError(f"slurm.container={self.container} needs slurm.image (the image to run)")
        return self
