"""Kubernetes: multi-node training as an Indexed Job (one pod a node, completions = parallelism = nodes) and a
headless Service whose name is the pods' subdomain, the form JobSet and Kubeflow's TrainJob build on.

Detected by ``JOB_COMPLETION_INDEX`` (the pod's index, its node rank) beside ``TRAIN_JOB_NAME``, which the
rendered pod template sets with ``TRAIN_JOB_NODES`` and ``TRAIN_RDZV_PORT``; the first node is pod 0, whose DNS
name is ``<job>-0.<service>``. The config travels as a ConfigMap mounted into every pod; the store's keys come
from a named Secret, never from the manifest. A pod is stopped with SIGTERM and killed after the pod's
``terminationGracePeriodSeconds``, rendered from the config's stop window (torchrun's shutdown timeout and the
remote's wait): the ranks checkpoint, the mirror sends it, the launcher exits 75. The Job's pod-failure policy
replaces a pod that exited 75 or was disrupted (preempted, evicted, drained) without counting it, fails the
whole Job at once on 2 (config) or 3 (data), and retries other failures ``backoff_limit_per_index`` times.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import yaml

from train.config import Config
from train.errors import ConfigError
from train.launch.targets.base import LaunchTarget, Placement, Rendered, env_int, launch_words, require_remote

CONTAINER = "train"
VOLUME = "/volume"  # data, caches and the run folder (a claim, or the pod's own disk)
CONFIG_DIR = "/etc/train"  # the config, from the ConfigMap
GRACE_MARGIN_S = 30
PREEMPTED, CONFIG_ERROR, DATA_ERROR = 75, 2, 3
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def stop_window_s(cfg: Config) -> int:
    """Seconds from SIGTERM to the last byte: the ranks' checkpoint and exit (dist.shutdown_timeout_s), the
    mirror's last upload (run.remote_wait_s) and a margin."""
    return cfg.dist.shutdown_timeout_s + cfg.run.remote_wait_s + GRACE_MARGIN_S


def job_name(cfg: Config) -> str:
    """The Job's name, from the run's: a DNS label short enough for '<job>-<index>' pod hostnames."""
    name = re.sub(r"[^a-z0-9-]+", "-", str(cfg.run.name).lower()).strip("-")[:50].strip("-")
    if not _NAME.fullmatch(name or "-"):
        raise ConfigError(f"run.name={cfg.run.name!r} gives no Kubernetes name: use letters, digits and '-'")
    return name


class Kubernetes(LaunchTarget):
    name, engine, section, stop_signal = "kubernetes", "Kubernetes", "kubernetes", "SIGTERM"

    renders = (
        "render an Indexed Job, its headless Service and the config as a ConfigMap from the config's kubernetes section"
    )

    def detect(self, environ: Mapping[str, str]) -> bool:
        return "JOB_COMPLETION_INDEX" in environ and "TRAIN_JOB_NAME" in environ

    def placement(self, environ: Mapping[str, str]) -> Placement:
        job = environ["TRAIN_JOB_NAME"]
        service = environ.get("TRAIN_JOB_SERVICE", job)
        port = env_int(environ, "TRAIN_RDZV_PORT") or 29400
        nnodes = env_int(environ, "TRAIN_JOB_NODES")
        return Placement(nnodes, env_int(environ, "JOB_COMPLETION_INDEX"), f"{job}-0.{service}:{port}", job)

    def grace_s(self, cfg: Config) -> int:
        return stop_window_s(cfg)

    def render_job(self, cfg: Config, config_path: str, overrides: list[str], output: str | None) -> Rendered:
        require_remote(cfg, "a Kubernetes Job", "a replaced pod starts on an empty disk")
        docs = render_manifests(cfg, config_path, overrides)
        text = f"# An Indexed Job, its headless Service and its config, rendered from {config_path} by python -m train "
        text += "kubernetes.\n"
        return Rendered(text + yaml.safe_dump_all(docs, sort_keys=False), "kubectl apply -f")


def render_manifests(cfg: Config, config_path: str, overrides: list[str]) -> list[dict]:
    """The ConfigMap of the config file, the headless Service and the Indexed Job."""
    k, job = cfg.kubernetes, job_name(cfg)
    meta = {"name": job, **({"namespace": k.namespace} if k.namespace else {})}
    labels = {"app.kubernetes.io/name": "train", "app.kubernetes.io/instance": job}
    config_file = Path(config_path).name
    folders = [f"run.{d}_dir={VOLUME}/{d}" for d in ("data", "cache", "runs")]
    words = launch_words(cfg, f"{CONFIG_DIR}/{config_file}", overrides, ("kubernetes", "slurm", "skypilot"))
    for folder in folders:
        words += ["--set", folder]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "labels": labels},
        "data": {config_file: Path(config_path).read_text()},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**meta, "labels": labels},
        "spec": {
            "clusterIP": "None",  # headless: each pod gets <job>-<index>.<service> in DNS
            "publishNotReadyAddresses": True,  # pod 0 resolves as soon as it runs, before any readiness
            "selector": {"batch.kubernetes.io/job-name": job},
            "ports": [{"name": "rendezvous", "port": k.port, "targetPort": k.port}],
        },
    }
    gpus = {k.gpu_resource: k.gpus_per_node} if k.gpus_per_node else {}
    cpus = k.cpus_per_node or 8 * max(k.gpus_per_node, 1)
    requests = {"cpu": str(cpus), **({"memory": k.memory} if k.memory else {}), **gpus}
    container = {
        "name": CONTAINER,
        "image": k.image,
        "command": words,
        "env": [
            {"name": "TRAIN_JOB_NAME", "value": job},
            {"name": "TRAIN_JOB_SERVICE", "value": job},
            {"name": "TRAIN_JOB_NODES", "value": str(k.nodes)},
            {"name": "TRAIN_RDZV_PORT", "value": str(k.port)},
        ],
        "ports": [{"name": "rendezvous", "containerPort": k.port}],
        "resources": {"requests": requests, "limits": {**({"memory": k.memory} if k.memory else {}), **gpus}},
        "volumeMounts": [
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "volume", "mountPath": VOLUME},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        ],
    }
    if k.secret:
        container["envFrom"] = [{"secretRef": {"name": k.secret}}]
    volume = {"persistentVolumeClaim": {"claimName": k.data_claim}} if k.data_claim else {"emptyDir": {}}
    pod = {
        "subdomain": job,
        "restartPolicy": "Never",  # the pod-failure policy decides; the launcher never restarts in place
        "terminationGracePeriodSeconds": stop_window_s(cfg),
        "containers": [container],
        "volumes": [
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}},
            {"name": "volume", **volume},
            {"name": "config", "configMap": {"name": job}},
        ],
    }
    exit_codes = lambda action, codes: {  # noqa: E731
        "action": action,
        "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": codes},
    }
    job_spec = {
        "completionMode": "Indexed",
        "completions": k.nodes,
        "parallelism": k.nodes,
        "backoffLimitPerIndex": k.backoff_limit_per_index,
        "podFailurePolicy": {
            "rules": [
                exit_codes("FailJob", [CONFIG_ERROR, DATA_ERROR]),  # the same input fails again: stop at once
                exit_codes("Ignore", [PREEMPTED]),  # checkpointed: a new pod resumes, uncounted
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }
    return [
        config_map,
        service,
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {**meta, "labels": labels}, "spec": job_spec},
    ]
