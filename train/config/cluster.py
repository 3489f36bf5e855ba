"""The engines' sections: what ``python -m train slurm``, ``skypilot`` and ``kubernetes`` write into the job
files they render (train.launch.targets)."""

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


class SkyPilotConfig(Section):
    nodes: int = Field(1, ge=1)
    """Nodes of the task (num_nodes); each runs the launcher, which starts one rank per GPU."""
    accelerators: str | None = "H100:8"
    """GPUs of each node, as SkyPilot names them (resources.accelerators: 'H100:8', 'A100-80GB:4'); None: CPUs."""
    cpus: str | None = None
    """CPUs of each node (resources.cpus: '32', '32+'); default: what the accelerators come with."""
    disk_size_gb: int = Field(256, ge=1)
    """Boot disk of each node in GB (resources.disk_size): data, caches and checkpoints live there."""
    image: str | None = None
    """This package's container image in a registry the cloud can pull (resources.image_id: 'docker:<image>'); None:
    the task's setup installs the package from the working folder SkyPilot uploads (pip install '.[s3]')."""
    infra: str | None = None
    """Where to run (resources.infra: 'aws', 'gcp/us-central1', 'runpod', 'k8s', 'slurm'); default: the cheapest
    of the enabled ones."""
    use_spot: bool = False
    """Spot/preemptible instances (resources.use_spot): cheaper, taken back at short notice; a managed job is
    relaunched elsewhere and resumes from run.remote."""
    recovery: Literal["FAILOVER", "EAGER_NEXT_REGION"] = "EAGER_NEXT_REGION"
    """How a managed job finds new machines after a preemption (resources.job_recovery.strategy)."""
    max_restarts_on_errors: int = Field(0, ge=0)
    """Relaunches of a managed job after a failure that was no preemption (job_recovery.max_restarts_on_errors)."""
    port: int = Field(29400, ge=1024, le=65535)
    """The rendezvous port on the first node."""


class KubernetesConfig(Section):
    nodes: int = Field(1, ge=1)
    """Pods of the Indexed Job (completions = parallelism), one per node; each runs the launcher."""
    image: str = "train:latest"
    """This package's container image in a registry the cluster can pull (make build, then push it)."""
    namespace: str | None = None
    """The namespace of the Job and its Service; default: kubectl's current one."""
    gpus_per_node: int = Field(8, ge=0)
    """GPUs each pod requests (the gpu_resource limit); 0: CPU ranks."""
    gpu_resource: str = "nvidia.com/gpu"
    """The extended resource name of the cluster's GPUs."""
    cpus_per_node: int | None = Field(None, ge=1)
    """CPU cores each pod requests; default: 8 per GPU (8 without GPUs)."""
    memory: str | None = None
    """Memory each pod requests, e.g. '512Gi'; default: none asked (the node's)."""
    shm_size: str = "16Gi"
    """Size of the pod's /dev/shm (an emptyDir in memory): the container default of 64 MB stalls DataLoader
    workers; counts against the pod's memory."""
    data_claim: str | None = None
    """A PersistentVolumeClaim mounted at /workspace/data-volume for run.data_dir and run.cache_dir; None: an
    emptyDir (the pod's own disk, gone with the pod)."""
    secret: str | None = None
    """A Secret whose keys become the pods' environment (the store's keys: B2_APPLICATION_KEY_ID, AWS_ACCESS_KEY_ID,
    ...); never written into the manifest."""
    backoff_limit_per_index: int = Field(3, ge=0)
    """Pod failures of one index the Job retries (preemptions and node disruptions do not count)."""
    port: int = Field(29400, ge=1024, le=65535)
    """The rendezvous port of pod 0, published by the headless Service."""
