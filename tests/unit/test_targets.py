"""The launch-target table: each engine detects itself from the variables it sets and places the node from them
(explicit NNODES/NODE_RANK/RDZV_ENDPOINT win everywhere); the SkyPilot task and the Kubernetes manifests it
renders load with the engines' own code (SkyPilot's task parser and recovery strategies, the Kubernetes schemas of
two versions), and no module outside train/launch/targets names an engine's variables."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from train.config import load_config
from train.errors import ConfigError
from train.launch.targets import TARGETS, detect_target, target_named, topology_from_environ
from train.launch.targets.kubernetes import render_manifests, stop_window_s

REPO = Path(__file__).resolve().parents[2]
SKYPILOT = {
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n",
    "SKYPILOT_TASK_ID": "sky-managed-2026_x_1-0",
    "TRAIN_RDZV_PORT": "29411",
}
KUBERNETES = {
    "JOB_COMPLETION_INDEX": "1",
    "TRAIN_JOB_NAME": "tiny",
    "TRAIN_JOB_SERVICE": "tiny",
    "TRAIN_JOB_NODES": "2",
    "TRAIN_RDZV_PORT": "29400",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
}
SLURM = {"SLURM_JOB_ID": "123456", "SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "n[10-13]"}
REMOTE = ["run.remote=b2://bucket/runs"]


@pytest.mark.parametrize(
    "environ, target",
    [
        ({}, "local"),
        (SLURM, "slurm"),
        (SKYPILOT, "skypilot"),
        (KUBERNETES, "kubernetes"),
        ({**SLURM, **SKYPILOT}, "skypilot"),
        ({"JOB_COMPLETION_INDEX": "0"}, "local"),
    ],
)
def test_each_engine_detects_itself_from_its_own_variables(environ, target):
    assert detect_target(environ).name == target


def test_each_engine_places_the_node_and_explicit_variables_win():
    sky = topology_from_environ(SKYPILOT, "run")
    assert (sky.nnodes, sky.node_rank, sky.endpoint, sky.run_id, sky.source) == (
        2,
        1,
        "10.0.0.5:29411",
        "sky-managed-2026_x_1-0",
        "SkyPilot",
    )
    k8s = topology_from_environ(KUBERNETES, "run")
    assert (k8s.nnodes, k8s.node_rank, k8s.endpoint, k8s.run_id) == (2, 1, "tiny-0.tiny:29400", "tiny")
    slurm = topology_from_environ(SLURM, "run")
    assert (slurm.nnodes, slurm.node_rank, slurm.endpoint) == (4, 3, f"n10:{20000 + 123456 % 10000}")
    for environ in (SKYPILOT, KUBERNETES, SLURM):
        mine = topology_from_environ({**environ, "RDZV_ENDPOINT": "head:1234", "NODE_RANK": "0"}, "run")
        assert (mine.endpoint, mine.node_rank) == ("head:1234", 0)
    with pytest.raises(ConfigError, match="SKYPILOT_NODE_RANK='x' must be an integer"):
        topology_from_environ({**SKYPILOT, "SKYPILOT_NODE_RANK": "x"}, "run")


def test_every_stop_signal_an_engine_sends_ends_a_run_with_a_checkpoint():
    from train.stop_signals import FORWARDED_SIGNALS, LAUNCHER_STOP_SIGNALS, RANK_STOP_SIGNALS

    for target in TARGETS:
        assert target.stop_signal in {s.name for s in LAUNCHER_STOP_SIGNALS} & {s.name for s in RANK_STOP_SIGNALS}
        assert target.stop_signal in FORWARDED_SIGNALS, target.name


def test_no_module_outside_the_targets_names_an_engines_variables():
    engines = re.compile(r"[\"'](SLURM_|SKYPILOT_|JOB_COMPLETION_INDEX|TRAIN_JOB_)")
    found = []
    for path in sorted((REPO / "train").rglob("*.py")):
        if "targets" in path.relative_to(REPO / "train").parts:
            continue
        found += [
            f"{path.relative_to(REPO)}:{i}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if engines.search(line)
        ]
    assert not found, f"engine variables read outside train/launch/targets: {found}"


SKY_PARSE = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
(r,) = task.resources
strategy = r.job_recovery["strategy"]
sky.JOBS_RECOVERY_STRATEGY_REGISTRY.from_str(strategy)  # a ValueError for a strategy SkyPilot does not have
print(json.dumps({"num_nodes": task.num_nodes, "name": task.name, "accelerators": r.accelerators,
                  "use_spot": r.use_spot, "image_id": r.image_id[None], "strategy": strategy, "run": task.run,
                  "envs": task.envs, "disk_size": r.disk_size,
                  # a secret without a value: a reference the launch resolves (sky jobs launch --secret NAME)
                  "secrets": sorted(ref.name for ref in task._managed_secret_refs)}))
"""


def skypilot_parse(path: Path, home: Path) -> dict:
    """The task at ``path`` as SkyPilot's own parser reads it (in its venv: make skypilot-parser)."""
    python = Path(os.environ.get("TRAIN_SKYPILOT_PYTHON", REPO / ".venv-skypilot" / "bin" / "python"))
    if not python.is_file():
        if os.environ.get("TRAIN_REQUIRE_SKYPILOT") == "1":
            pytest.fail(f"SkyPilot's parser is required here but {python} is missing: make skypilot-parser")
        pytest.skip(f"SkyPilot's parser is not installed ({python}): make skypilot-parser")
    proc = subprocess.run(
        [str(python), "-c", SKY_PARSE, str(path)], capture_output=True, text=True, env={**os.environ, "HOME": str(home)}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_skypilot_task_loads_with_skypilots_parser_and_its_recovery_strategy(tmp_path):
    overrides = [
        *REMOTE,
        "skypilot.nodes=2",
        "skypilot.accelerators=H100:8",
        "skypilot.use_spot=true",
        "skypilot.recovery=FAILOVER",
        "skypilot.image=ghcr.io/lab/train:1.0",
    ]
    cfg = load_config("configs/tiny.yaml", overrides)
    rendered = target_named("skypilot").render_job(cfg, "configs/tiny.yaml", [*overrides, "train.epochs=3"], None)
    (tmp_path / "task.yaml").write_text(rendered.text)
    task = skypilot_parse(tmp_path / "task.yaml", tmp_path)
    assert (task["num_nodes"], task["name"], task["accelerators"], task["use_spot"]) == (2, "tiny", {"H100": 8}, True)
    assert (task["image_id"], task["strategy"], task["disk_size"]) == ("docker:ghcr.io/lab/train:1.0", "FAILOVER", 256)
    assert task["run"].strip().splitlines()[-1] == (
        "python -m train run --config configs/tiny.yaml --run tiny --set run.remote=b2://bucket/runs "
        "--set train.epochs=3"
    )
    assert task["secrets"] == ["B2_APPLICATION_KEY", "B2_APPLICATION_KEY_ID"]
    assert task["envs"]["TRAIN_RDZV_PORT"] == "29400" and rendered.submit == "sky jobs launch"


def test_a_job_an_engine_relaunches_elsewhere_needs_a_remote(tmp_path):
    for name in ("skypilot", "kubernetes"):
        for overrides in ([], [f"run.remote={tmp_path}"]):
            cfg = load_config("configs/tiny.yaml", overrides)
            with pytest.raises(ConfigError, match=r"must be in a bucket: set run.remote=b2://") as e:
                target_named(name).render_job(cfg, "configs/tiny.yaml", overrides, None)
            assert e.value.exit_code == 2


@pytest.mark.parametrize("version", ["1.29", "1.37"])
def test_the_kubernetes_manifests_validate_against_the_schema(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (make install)")
    overrides = [*REMOTE, "kubernetes.nodes=2", "kubernetes.secret=store-keys", "kubernetes.data_claim=scratch"]
    cfg = load_config("configs/tiny.yaml", overrides)
    for document in render_manifests(cfg, "configs/tiny.yaml", overrides):
        assert kubernetes_validate.validate(document, version, strict=True) == version


def test_the_indexed_job_retries_preemptions_fails_fast_on_config_and_data_and_finds_pod_zero():
    """What the schema cannot check: the failure policy's rules, the pods' DNS names against the Service, the
    grace period against the stop window, /dev/shm in memory, the keys only by the Secret's name."""
    overrides = [*REMOTE, "kubernetes.nodes=3", "kubernetes.secret=store-keys", "kubernetes.shm_size=32Gi"]
    cfg = load_config("configs/tiny.yaml", overrides)
    text = target_named("kubernetes").render_job(cfg, "configs/tiny.yaml", overrides, None).text
    config_map, service, job = yaml.safe_load_all(text)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    rules = {
        (r["action"], tuple(r["onExitCodes"]["values"]) if "onExitCodes" in r else r["onPodConditions"][0]["type"])
        for r in spec["podFailurePolicy"]["rules"]
    }
    assert rules == {("FailJob", (2, 3)), ("Ignore", (75,)), ("Ignore", "DisruptionTarget")}
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == stop_window_s(cfg)
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    placed = topology_from_environ({**env, "JOB_COMPLETION_INDEX": "2"}, "run")
    host = f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0's hostname.subdomain
    assert (placed.nnodes, placed.node_rank, placed.endpoint) == (3, 2, f"{host}:{service['spec']['ports'][0]['port']}")
    assert container["envFrom"] == [{"secretRef": {"name": "store-keys"}}] and "B2_APPLICATION_KEY" not in text
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert config_map["data"]["tiny.yaml"] == (REPO / "configs" / "tiny.yaml").read_text()
    assert container["command"][:6] == ["python", "-m", "train", "run", "--config", "/etc/train/tiny.yaml"]


def test_the_doctor_checks_the_gpus_skypilot_granted_against_the_ranks():
    from train.launch.doctor import run_checks
    from train.launch.facts import FAIL, PASS, Facts

    cfg = load_config("configs/tiny.yaml", ["dist.backend=nccl"])
    granted = {**SKYPILOT, "SKYPILOT_NUM_GPUS_PER_NODE": "4"}

    def check(gpus: int, nproc: int) -> tuple[str, str]:
        facts = Facts(environ=granted, gpus=gpus, versions={}, shm=None, memlock=-1, container=None)
        (found,) = [c for c in run_checks(cfg, nproc, facts, {}, data=False) if c.name == "SkyPilot"]
        return found.status, found.detail

    assert check(4, 4) == (PASS, "node 1 of 2, 4 GPU(s) granted")
    status, detail = check(8, 8)
    assert status == FAIL and "launch starts 8 rank(s)" in detail


def test_the_doctor_warns_when_an_engine_kills_before_a_stop_can_save_and_send_its_checkpoint():
    from train.launch.doctor import check_stop_window
    from train.launch.facts import PASS, WARN

    cfg = load_config("configs/tiny.yaml", [*REMOTE, "dist.shutdown_timeout_s=60", "run.remote_wait_s=60"])
    sky = check_stop_window(cfg, target_named("skypilot"))
    assert sky.status == WARN and "SkyPilot kills 30 s after its SIGTERM" in sky.detail
    assert check_stop_window(cfg, target_named("kubernetes")).status == PASS  # its grace is rendered from them
    assert check_stop_window(cfg, target_named("slurm")).status == PASS  # 300 s before the time limit
    assert check_stop_window(cfg, target_named("local")) is None
