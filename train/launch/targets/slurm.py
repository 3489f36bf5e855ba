"""SLURM: the launcher runs as one task per node of an sbatch job (train.launch.targets.sbatch renders it).

Detected by ``SLURM_JOB_ID``. The nodes, this node's rank and the rendezvous come from SLURM's variables: the
first host of ``SLURM_JOB_NODELIST`` at a port derived from the job id. SLURM signals the batch script
``slurm.preempt_signal_s`` before the time limit (``--signal=B:USR1@...``), which forwards SIGUSR1 to the
launchers; a preemption or ``scontrol requeue`` sends SIGTERM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from train.config import Config
from train.errors import ConfigError
from train.launch.facts import FAIL, PASS, WARN, Check, Facts, backend_of, requested_nproc
from train.launch.targets import sbatch
from train.launch.targets.base import LaunchTarget, Placement, Rendered, env_int


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


class Slurm(LaunchTarget):
    name, engine, section, stop_signal = "slurm", "SLURM", "slurm", "SIGUSR1"

    renders = "render an sbatch file from the config's slurm section"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return "SLURM_JOB_ID" in environ

    def placement(self, environ: Mapping[str, str]) -> Placement:
        endpoint = None
        if environ.get("SLURM_JOB_NODELIST"):
            port = sbatch.PORT_BASE + int(environ["SLURM_JOB_ID"]) % sbatch.PORT_SPAN
            endpoint = f"{first_slurm_host(environ['SLURM_JOB_NODELIST'])}:{port}"
        nnodes, node_rank = env_int(environ, "SLURM_NNODES"), env_int(environ, "SLURM_NODEID")
        return Placement(nnodes, node_rank, endpoint, environ["SLURM_JOB_ID"])

    def grace_s(self, cfg: Config) -> int:
        return cfg.slurm.preempt_signal_s

    def checks(self, cfg: Config, nproc: str | int | None, facts: Facts) -> list[Check]:
        return [c for c in [check_slurm(cfg, nproc, facts)] if c is not None]

    def render_job(self, cfg: Config, config_path: str, overrides: list[str], output: str | None) -> Rendered:
        return Rendered(sbatch.render_sbatch(cfg, config_path, overrides, output), "sbatch", executable=True)

    def render_array(self, cfg: Config, config_path: str, overrides: list[str], output: str, array) -> Rendered:
        if cfg.slurm.nodes != 1:
            raise ConfigError(
                f"slurm.nodes={cfg.slurm.nodes}: a sweep's array tasks run single-node trials; set slurm.nodes=1 "
                "(a trial may still use every GPU of its node)"
            )
        return Rendered(sbatch.render_sbatch(cfg, config_path, overrides, output, array), "sbatch", executable=True)


def _first_int(value: str | None) -> int | None:
    match = re.search(r"(\d+)", value or "")
    return int(match.group(1)) if match else None


def slurm_gpus_on_node(environ: Mapping[str, str]) -> int | None:
    """GPUs SLURM granted this node: SLURM_GPUS_ON_NODE, else --gpus-per-node ('h200:8'), else the job's list."""
    if environ.get("SLURM_GPUS_ON_NODE"):
        return _first_int(environ["SLURM_GPUS_ON_NODE"])
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        value = environ.get(name)
        if value:
            return _first_int(value.rsplit(":", 1)[-1]) if name == "SLURM_GPUS_PER_NODE" else len(value.split(","))
    return None


def check_slurm(cfg: Config, nproc: str | int | None, facts: Facts) -> Check | None:
    env = facts.environ
    if "SLURM_JOB_ID" not in env:
        return None
    problems, fixes = [], []
    n, _ = requested_nproc(cfg, nproc, facts)
    tasks = _first_int(env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"))
    ntasks, nnodes = _first_int(env.get("SLURM_NTASKS")), _first_int(env.get("SLURM_NNODES"))
    if tasks is None and ntasks and nnodes:
        tasks = ntasks // nnodes
    if tasks and tasks > 1:
        problems.append(f"{tasks} tasks per node, and each starts the launcher with {n} rank(s)")
        fixes.append("--ntasks-per-node=1 (the launcher starts one rank per GPU)")
    granted = slurm_gpus_on_node(env)
    if granted is not None and n is not None and backend_of(cfg, facts) != "gloo" and n * (tasks or 1) > granted:
        problems.append(f"{n * (tasks or 1)} rank(s) on this node but SLURM granted {granted} GPU(s)")
        fixes.append(f"--gpus-per-node={n * (tasks or 1)} or NPROC={granted}")
    if env.get("NNODES") and env.get("SLURM_NNODES") and env["NNODES"] != env["SLURM_NNODES"]:
        problems.append(f"NNODES={env['NNODES']} but the job has SLURM_NNODES={env['SLURM_NNODES']}")
        fixes.append("unset NNODES (it is read from SLURM)")
    summary = f"job {env['SLURM_JOB_ID']}: {env.get('SLURM_NNODES', '?')} node(s), {tasks or 1} task(s)/node, " + (
        f"{granted} GPU(s) granted" if granted is not None else "no GPUs granted"
    )
    if problems:
        return Check("SLURM", FAIL, f"{summary}; " + "; ".join(problems), "use " + " and ".join(fixes))
    if granted is not None and granted != facts.gpus:
        return Check(
            "SLURM",
            WARN,
            f"{summary}, but PyTorch sees {facts.gpus}",
            "do not override CUDA_VISIBLE_DEVICES inside the job",
        )
    cpus = _first_int(env.get("SLURM_CPUS_PER_TASK"))
    if cpus and n and cpus < n * (cfg.train.num_workers + 1):
        return Check(
            "SLURM",
            WARN,
            f"{summary}; {cpus} CPUs for {n} rank(s) x {cfg.train.num_workers + 1} processes",
            "raise --cpus-per-task or lower train.num_workers",
        )
    return Check("SLURM", PASS, summary)
