"""SkyPilot: one task YAML launched on 20+ clouds, RunPod, Lambda, Kubernetes or SLURM (``sky launch``), or as
a managed job that SkyPilot relaunches elsewhere after a preemption (``sky jobs launch``).

Detected by SkyPilot's own variables in the task's ``run`` section: ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NUM_NODES``
and ``SKYPILOT_NODE_IPS`` (one address a line, the first node's first), so the run section is the plain launch
command. A managed job keeps its ``SKYPILOT_TASK_ID`` across recoveries (the rendezvous id); the run's folder is
named by the config (``run.name``), so a relaunch on new machines finds its checkpoints in ``run.remote``, which
such a job needs: nothing of the old machines' disks survives. SkyPilot stops a task with SIGTERM to its process
group and kills it 30 s later: the ranks checkpoint and the launcher exits 75 within that window when the mirror
has little left to send (the checkpoint cadence decides how much a preemption without notice loses).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

import yaml

from train.config import Config
from train.launch.facts import FAIL, PASS, WARN, Check, Facts, backend_of, requested_nproc
from train.launch.targets.base import (
    LaunchTarget,
    Placement,
    Rendered,
    env_int,
    launch_words,
    require_remote,
    store_keys,
)

GRACE_S = 30  # SkyPilot's skylet: SIGTERM to the task's process group, SIGKILL 30 s later


class SkyPilot(LaunchTarget):
    name, engine, section, stop_signal = "skypilot", "SkyPilot", "skypilot", "SIGTERM"

    renders = "render a SkyPilot task (a managed job, recovered after a preemption) from the config's skypilot section"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return "SKYPILOT_NODE_RANK" in environ and "SKYPILOT_NODE_IPS" in environ

    def placement(self, environ: Mapping[str, str]) -> Placement:
        ips = [ip.strip() for ip in environ["SKYPILOT_NODE_IPS"].splitlines() if ip.strip()]
        nnodes = env_int(environ, "SKYPILOT_NUM_NODES") or len(ips)
        port = env_int(environ, "TRAIN_RDZV_PORT") or 29400
        endpoint = f"{ips[0]}:{port}" if ips else None
        return Placement(nnodes, env_int(environ, "SKYPILOT_NODE_RANK"), endpoint, environ.get("SKYPILOT_TASK_ID"))

    def grace_s(self, cfg: Config) -> int:
        return GRACE_S

    def checks(self, cfg: Config, nproc: str | int | None, facts: Facts) -> list[Check]:
        """The GPUs SkyPilot granted this node against the ranks the launch starts and the GPUs PyTorch sees."""
        granted = env_int(facts.environ, "SKYPILOT_NUM_GPUS_PER_NODE")
        n, _ = requested_nproc(cfg, nproc, facts)
        rank, nodes = facts.environ.get("SKYPILOT_NODE_RANK", "?"), facts.environ.get("SKYPILOT_NUM_NODES", "?")
        summary = f"node {rank} of {nodes}, " + (f"{granted} GPU(s) granted" if granted else "no GPUs granted")
        if granted and n and backend_of(cfg, facts) != "gloo" and n > granted:
            fix = f"NPROC={granted}, or skypilot.accelerators with {n} GPUs a node"
            return [Check("SkyPilot", FAIL, f"{summary}, but the launch starts {n} rank(s)", fix)]
        if granted is not None and granted != facts.gpus:
            fix = "do not override CUDA_VISIBLE_DEVICES in the task"
            return [Check("SkyPilot", WARN, f"{summary}, but PyTorch sees {facts.gpus}", fix)]
        return [Check("SkyPilot", PASS, summary)]

    def render_job(self, cfg: Config, config_path: str, overrides: list[str], output: str | None) -> Rendered:
        require_remote(cfg, "a SkyPilot task", "a managed job recovers on new machines")
        return Rendered(render_task(cfg, config_path, overrides), "sky jobs launch")


def render_task(cfg: Config, config_path: str, overrides: list[str]) -> str:
    """The task YAML of ``cfg``: resources, nodes, managed-job recovery, the store's secrets by name, and the
    launch command as its run section."""
    s = cfg.skypilot
    resources: dict = {"disk_size": s.disk_size_gb, "use_spot": s.use_spot}
    for key, value in (("accelerators", s.accelerators), ("cpus", s.cpus), ("infra", s.infra)):
        if value is not None:
            resources[key] = value
    if s.image:
        resources["image_id"] = s.image if s.image.startswith("docker:") else f"docker:{s.image}"
    resources["job_recovery"] = {"strategy": s.recovery, "max_restarts_on_errors": s.max_restarts_on_errors}
    command = " ".join(shlex.quote(w) for w in launch_words(cfg, config_path, overrides, ("skypilot", "slurm")))
    task = {
        "name": str(cfg.run.name),
        "num_nodes": s.nodes,
        "resources": resources,
        "workdir": ".",
        "envs": {"TRAIN_RDZV_PORT": str(s.port)},
        "secrets": {key: None for key in store_keys(cfg.run.remote)},
        "setup": "set -e\n" + ("python -c 'import train'\n" if s.image else "python -m pip install --quiet '.[s3]'\n"),
        # The launcher reads SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES and SKYPILOT_NODE_IPS itself.
        "run": f"set -e\n{command}\n",
    }
    if not task["secrets"]:
        del task["secrets"]
    header = (
        f"# A SkyPilot task rendered from {config_path} by python -m train skypilot. Launch it as a managed job,\n"
        "# relaunched after a preemption and resumed from run.remote:\n"
        "#   sky jobs launch FILE" + "".join(f" --secret {k}" for k in store_keys(cfg.run.remote)) + "\n"
    )
    return header + yaml.dump(task, Dumper=_TaskDumper, sort_keys=False)


class _TaskDumper(yaml.SafeDumper):
    """YAML as a person writes a task: the shell sections as literal blocks."""


_TaskDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)
