"""Tests of the rendered sbatch file: its directives, its launch line, its quoting, and its exit-code logic."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import run_cli
from train.config import Config, load_config
from train.errors import ConfigError
from train.launch.targets import target_named, write_job
from train.launch.targets.sbatch import render_command, render_sbatch, time_limit_seconds

REPO = Path(__file__).resolve().parents[2]
DEFAULT = "configs/default.yaml"

# The checked-in examples under scripts/slurm and the overrides they are rendered with.
EXAMPLES = {
    "one_node": ["slurm.nodes=1", "slurm.gpus_per_node=8"],
    "one_node_cpu": ["slurm.nodes=1", "slurm.gpus_per_node=0"],
    "multi_node": ["slurm.nodes=4"],
    "multi_node_pyxis": ["slurm.nodes=4", "slurm.container=pyxis", "slurm.image=registry.example.com/train:latest"],
    "multi_node_apptainer": ["slurm.nodes=4", "slurm.container=apptainer", "slurm.image=train.sif"],
}

CONTAINERS = {
    "none": [],
    "pyxis": ["slurm.container=pyxis", "slurm.image=registry.example.com/train:latest"],
    "apptainer": ["slurm.container=apptainer", "slurm.image=train.sif"],
}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def render(overrides: list[str] = (), output: str | None = None) -> str:
    overrides = list(overrides)
    return render_sbatch(load_config(DEFAULT, overrides), DEFAULT, overrides, output)


def with_slurm(**changes) -> Config:
    """The default config with slurm settings; its ranks stop within 10 s (short stop signals are allowed)."""
    cfg = load_config(DEFAULT, ["dist.shutdown_timeout_s=10"])
    return cfg.model_copy(update={"slurm": cfg.slurm.model_copy(update=changes)})


def directives(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def bash_syntax_ok(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)


FAKE_SRUN = r"""#!/bin/bash
printf '%s\n' "$@" > "$FAKE_DIR/srun.args"
pwd > "$FAKE_DIR/srun.cwd"
env > "$FAKE_DIR/srun.env"
if [[ -n ${FAKE_SLEEP:-} ]]; then
    trap 'echo USR1 >> "$FAKE_DIR/srun.signals"; kill "$sleeper" 2>/dev/null; exit "${FAKE_CODE_ON_USR1:-75}"' USR1
    sleep "$FAKE_SLEEP" & sleeper=$!
    touch "$FAKE_DIR/srun.ready"
    wait "$sleeper"
fi
exit "${FAKE_CODE:-0}"
"""

FAKE_SCONTROL = r"""#!/bin/bash
echo "$*" >> "$FAKE_DIR/scontrol.calls"
if [[ $1 == show && $2 == hostnames ]]; then printf 'nodeA\nnodeB\n'; exit 0; fi
exit "${FAKE_SCONTROL_CODE:-0}"
"""


class FakeCluster:
    """Stand-ins for ``srun`` and ``scontrol``, since no SLURM cluster can run in a test.

    The batch script runs under bash exactly as rendered, with the fakes first on PATH: ``srun`` records its
    arguments, working folder and environment, may sleep (then SIGUSR1 makes it exit like a checkpointing
    launcher), and exits with FAKE_CODE; ``scontrol`` records every call and lists two hosts.
    """

    def __init__(self, root: Path):
        self.dir = root / "fake"
        self.bin = root / "bin"
        self.submit = root / "submit"
        for folder in (self.dir, self.bin, self.submit):
            folder.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.script = root / "job.sbatch"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            "FAKE_DIR": str(self.dir),
            "SLURM_SUBMIT_DIR": str(self.submit),
            "SLURM_JOB_ID": "12345",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "node[A-B]",
            "NODE_RANK": "7",  # left over in the submitting shell: the script must not pass it on
            **extra,
        }

    def start(self, text: str, **extra: str) -> subprocess.Popen:
        self.script.write_text(text)
        return subprocess.Popen(
            ["bash", str(self.script)], env=self.env(**extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def run(self, text: str, **extra: str) -> subprocess.CompletedProcess:
        proc = self.start(text, **extra)
        out, err = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def srun_args(self) -> list[str]:
        return (self.dir / "srun.args").read_text().splitlines()

    def srun_env(self) -> dict[str, str]:
        lines = (self.dir / "srun.env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    def scontrol_calls(self) -> list[str]:
        calls = self.dir / "scontrol.calls"
        return calls.read_text().splitlines() if calls.exists() else []


@pytest.fixture
def cluster(tmp_path) -> FakeCluster:
    return FakeCluster(tmp_path)


# --- directives -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("nodes", [1, 4])
def test_directives_request_one_task_per_node_with_all_its_gpus(tmp_path, container, nodes):
    text = render([f"slurm.nodes={nodes}", "slurm.gpus_per_node=4", "slurm.cpus_per_gpu=6", *CONTAINERS[container]])
    d = directives(text)
    assert text.startswith("#!/bin/bash\n")
    assert "--ntasks-per-node=1" in d
    assert not any(o.startswith(("--ntasks=", "--ntasks-per-gpu", "--gpus-per-task")) for o in d), d
    assert f"--nodes={nodes}" in d
    assert "--gpus-per-node=4" in d
    assert "--cpus-per-task=24" in d
    assert "--job-name=default" in d
    assert "--signal=B:USR1@300" in d and "--requeue" in d and "--open-mode=append" in d
    assert not any(o.startswith(("--partition", "--account")) for o in d), "only when set"
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert bash_syntax_ok(path).returncode == 0, bash_syntax_ok(path).stderr


def test_optional_directives_appear_only_when_set():
    d = directives(
        render(["slurm.partition=gpu", "slurm.account=proj42", "slurm.requeue=false", "slurm.time=2-00:00:00",
                "slurm.preempt_signal_s=600", "slurm.extra_sbatch=[--qos=high, --constraint=h100|a100]"])
    )  # fmt: skip
    assert "--partition=gpu" in d and "--account=proj42" in d
    assert "--requeue" not in d
    assert "--time=2-00:00:00" in d and "--signal=B:USR1@600" in d
    assert d[-2:] == ["--qos=high", "--constraint=h100|a100"]


def test_header_reproduces_the_file_and_says_how_to_submit():
    overrides = ["slurm.nodes=4", "train.epochs=3"]
    text = render(overrides, output="scripts/slurm/x.sbatch")
    command = render_command(DEFAULT, overrides, None, "scripts/slurm/x.sbatch")
    assert command == (
        "python -m train slurm --config configs/default.yaml --set slurm.nodes=4 --set train.epochs=3 "
        "--output scripts/slurm/x.sbatch"
    )
    assert f"#   {command}\n" in text
    assert "#   sbatch scripts/slurm/x.sbatch\n" in text
    named = render_sbatch(load_config(DEFAULT, overrides, run_name="big"), DEFAULT, overrides)
    assert "--config configs/default.yaml --run big --set" in named
    assert "--job-name=big" in directives(named)


# --- quoting and validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"partition": "gpu\n#SBATCH --nodes=100"}, "slurm.partition"),
        ({"partition": "gpu long"}, "slurm.partition"),
        ({"account": "a#b"}, "slurm.account"),
        ({"account": 'x"y'}, "slurm.account"),
        ({"time": "24h"}, "slurm.time"),
        ({"extra_sbatch": ["--qos=high", "qos=low"]}, "slurm.extra_sbatch[1]"),
        ({"extra_sbatch": ["--comment=two words"]}, "slurm.extra_sbatch[0]"),
        ({"container": "pyxis", "image": "registry.example.com/train:latest\nrm -rf /"}, "slurm.image"),
    ],
)
def test_values_that_would_break_the_script_are_rejected_naming_the_key(changes, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        render_sbatch(with_slurm(**changes), DEFAULT, [])


def test_a_run_name_with_a_space_is_rejected():
    with pytest.raises(ConfigError, match=r"run\.name"):
        render_sbatch(load_config(DEFAULT, run_name="my run"), DEFAULT, [])


def test_an_override_with_a_newline_is_rejected():
    with pytest.raises(ConfigError, match="control character"):
        render_sbatch(load_config(DEFAULT), DEFAULT, ["tasks.darcy2d.source=a\nb"])


@pytest.mark.parametrize("container", ["pyxis", "apptainer"])
def test_an_image_with_shell_characters_reaches_srun_unchanged(cluster, container):
    image = "registry.example.com/it's:1 $(touch pwned) `touch pwned2`"
    text = render_sbatch(with_slurm(container=container, image=image), DEFAULT, [])
    assert cluster.run(text).returncode == 0
    args = cluster.srun_args()
    assert (f"--container-image={image}" if container == "pyxis" else image) in args
    assert not list(cluster.submit.iterdir()) and not (REPO / "pwned").exists()


# --- the time limit and the signal lead ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90 * 60),  # minutes
        ("0:30", 60),  # MM:SS; SLURM rounds a limit up to whole minutes
        ("10:30", 11 * 60),
        ("01:02:03", 63 * 60),  # HH:MM:SS, 3723 s rounded up
        ("2-0", 2 * 86400),  # D-HH
        ("1-02", 26 * 3600),
        ("1-02:30", 26 * 3600 + 30 * 60),  # D-HH:MM
        ("1-02:30:01", 26 * 3600 + 31 * 60),  # D-HH:MM:SS
        ("UNLIMITED", None),
        ("unlimited", None),
        ("infinite", None),
        ("0", None),  # SLURM: a limit of zero imposes none
    ],
)
def test_time_limits_are_read_in_every_slurm_format(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("text", ["24h", "1-", "1:2:3:4", "1-2-3", "-5", "", "1:", "1.5"])
def test_what_is_not_a_slurm_time_limit_is_rejected(text):
    with pytest.raises(ConfigError, match=r"slurm\.time=.*D-HH:MM:SS"):
        time_limit_seconds(text)


@pytest.mark.parametrize(
    ("time", "signal_s"), [("00:05:00", 300), ("5", 300), ("00:06:00", 300), ("0-00:07", 301), ("2", 10), ("0:59", 10)]
)
def test_a_time_limit_without_room_after_the_signal_is_refused(time, signal_s):
    """SLURM would signal the job as it starts (or before): it would checkpoint and requeue forever."""
    with pytest.raises(ConfigError) as caught:
        render_sbatch(with_slurm(time=time, preempt_signal_s=signal_s), DEFAULT, [])
    message = str(caught.value)
    assert f"slurm.time={time}" in message and f"slurm.preempt_signal_s={signal_s}" in message
    assert "up to 60 s earlier" in message and "at least 60 s of training" in message
    assert f"at least {-(-(signal_s + 120) // 60)} minutes" in message


@pytest.mark.parametrize(
    ("time", "signal_s"),
    [("00:07:00", 300), ("7", 300), ("00:06:01", 300), ("3", 60), ("2-00:00:00", 3600), ("UNLIMITED", 300), ("0", 300)],
)
def test_a_time_limit_with_the_margin_is_rendered(time, signal_s):
    d = directives(render_sbatch(with_slurm(time=time, preempt_signal_s=signal_s), DEFAULT, []))
    assert f"--time={time}" in d and f"--signal=B:USR1@{signal_s}" in d


def test_the_command_line_refuses_a_short_time_limit_with_exit_2(tmp_path):
    out = tmp_path / "job.sbatch"
    proc = run_cli(
        "slurm", "--config", "configs/tiny.yaml", "--set", "slurm.time=00:05:00", "--set", "slurm.preempt_signal_s=300",
        "--output", str(out), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "slurm.time=00:05:00" in proc.stderr and "slurm.preempt_signal_s=300" in proc.stderr
    assert not out.exists()


# --- CPU-only jobs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_gpus_per_node_0_renders_a_job_without_any_gpu_request(cluster, container):
    text = render(["slurm.gpus_per_node=0", "dist.cpu_nproc=3", "train.num_workers=2", *CONTAINERS[container]])
    d = directives(text)
    assert "--cpus-per-task=9" in d, "3 CPU ranks x (2 DataLoader workers + the rank itself)"
    assert not [o for o in d if o.startswith(("--gpu", "--gres"))], d
    proc = cluster.run(text, CUDA_VISIBLE_DEVICES="0,1")
    assert proc.returncode == 0, proc.stderr
    args = cluster.srun_args()
    assert "--cpus-per-task=9" in args
    assert not [a for a in args if a.startswith(("--gpu", "--gres")) or a == "--nv"], args
    # A GPU node without a device cgroup would show its GPUs to the job: the launcher must start CPU ranks.
    assert cluster.srun_env()["CUDA_VISIBLE_DEVICES"] == ""


def test_a_gpu_job_keeps_the_gpus_slurm_gives_it(cluster):
    proc = cluster.run(render(["slurm.gpus_per_node=2"]), CUDA_VISIBLE_DEVICES="0,1")
    assert proc.returncode == 0, proc.stderr
    assert "--gpus-per-node=2" in cluster.srun_args()
    assert cluster.srun_env()["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize(
    ("overrides", "cpus"),
    [
        (["slurm.gpus_per_node=4", "slurm.cpus_per_gpu=6"], 24),
        (["slurm.gpus_per_node=4", "slurm.cpus_per_task=10"], 10),
        (["slurm.gpus_per_node=0"], 2),  # dist.cpu_nproc=2 ranks, no DataLoader workers
        (["slurm.gpus_per_node=0", "dist.nproc=4", "train.num_workers=1"], 8),
        (["slurm.gpus_per_node=0", "slurm.cpus_per_task=5"], 5),
    ],
)
def test_cpus_per_task_reaches_the_job_and_the_step(cluster, overrides, cpus):
    text = render(overrides)
    assert f"--cpus-per-task={cpus}" in directives(text)
    assert cluster.run(text).returncode == 0
    assert f"--cpus-per-task={cpus}" in cluster.srun_args()


@pytest.mark.parametrize(("key", "value"), [("slurm.gpus_per_node", -1), ("slurm.cpus_per_task", 0)])
def test_negative_gpus_and_zero_cpus_are_rejected_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(DEFAULT, [f"{key}={value}"])


# --- the launch line, run through a fake srun ---------------------------------------------------------------------


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_launch_line_per_container(cluster, container):
    overrides = ["slurm.nodes=4", "train.epochs=3", "tasks.darcy2d.batch_size=8", *CONTAINERS[container]]
    proc = cluster.run(render(overrides))
    assert proc.returncode == 0, proc.stderr
    args = cluster.srun_args()
    assert args[:5] == [
        "--kill-on-bad-exit=1", "--ntasks=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=64",
    ]  # fmt: skip
    train = args[args.index("-m") - 1 :]
    assert train == [
        train[0], "-m", "train", "run", "--config", DEFAULT, "--run", "default",
        "--set", "train.epochs=3", "--set", "tasks.darcy2d.batch_size=8",
    ]  # fmt: skip
    assert not any(a.startswith("slurm.") for a in args), "slurm.* settings only shape the sbatch file"
    middle = args[5 : args.index("-m") - 1]
    if container == "none":
        assert train[0] == "python3" and middle == []
    elif container == "pyxis":
        assert train[0] == "python3"
        assert middle == [
            "--container-image=registry.example.com/train:latest",
            f"--container-mounts={cluster.submit}:/workspace",
            "--container-workdir=/workspace",
        ]
    else:
        assert train[0] == "python3"
        assert middle == [
            "apptainer", "exec", "--nv", "--bind", f"{cluster.submit}:/workspace", "--pwd", "/workspace", "train.sif",
        ]  # fmt: skip


def test_srun_starts_one_launcher_per_node_whatever_the_header_says(cluster):
    """An edited `#SBATCH --ntasks-per-node=2` makes the job's SLURM_NTASKS 4 on 2 nodes; srun would take that
    count and ignore its own --ntasks-per-node=1. The real cluster's check is in tests/slurm."""
    text = render(["slurm.nodes=2"]).replace("#SBATCH --ntasks-per-node=1\n", "#SBATCH --ntasks-per-node=2\n")
    assert "#SBATCH --ntasks-per-node=2" in text
    proc = cluster.run(text, SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_TASKS_PER_NODE="2(x2)")
    assert proc.returncode == 0, proc.stderr
    args = cluster.srun_args()
    assert "--ntasks=2" in args and "--ntasks-per-node=1" in args


def test_python_can_point_at_a_virtual_environment(cluster):
    assert cluster.run(render(), PYTHON="/shared/project/.venv/bin/python").returncode == 0
    assert "/shared/project/.venv/bin/python" in cluster.srun_args()


def test_rendezvous_settings_reach_the_launchers(cluster):
    proc = cluster.run(render(["slurm.nodes=2"]))
    assert proc.returncode == 0, proc.stderr
    env = cluster.srun_env()
    assert env["NNODES"] == "2"
    assert env["RDZV_ENDPOINT"] == f"nodeA:{20000 + 12345 % 10000}"
    assert env["RDZV_ID"] == "12345"
    assert "NODE_RANK" not in env, "each task's launcher takes its node rank from its own SLURM_NODEID"
    assert (cluster.dir / "srun.cwd").read_text().strip() == str(cluster.submit)


# --- exit codes, requeue and the preemption signal ----------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 1, 2, 3, 5, 137])
def test_the_job_exits_with_the_trainings_status_and_requeues_nothing(cluster, code):
    proc = cluster.run(render(), FAKE_CODE=str(code))
    assert proc.returncode == code, proc.stderr
    assert not [c for c in cluster.scontrol_calls() if c.startswith("requeue")]


def test_exit_75_requeues_the_job_and_keeps_the_status(cluster):
    proc = cluster.run(render(), FAKE_CODE="75")
    assert proc.returncode == 75, proc.stderr
    assert "requeue 12345" in cluster.scontrol_calls()
    assert "requeueing job 12345" in proc.stdout


def test_exit_75_without_requeue_only_says_how_to_resume(cluster):
    text = render(["slurm.requeue=false"])
    proc = cluster.run(text, FAKE_CODE="75")
    assert proc.returncode == 75
    assert not [c for c in cluster.scontrol_calls() if c.startswith("requeue")]
    assert "submit this script again" in proc.stdout


def test_a_failed_requeue_does_not_mask_the_status(cluster):
    proc = cluster.run(render(), FAKE_CODE="75", FAKE_SCONTROL_CODE="1")
    assert proc.returncode == 75
    assert "requeue 12345" in cluster.scontrol_calls()
    assert "requeue failed" in proc.stderr


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


# 138: the launcher killed by the forwarded SIGUSR1 before it could handle it (as it started): a stop, requeued.
@pytest.mark.parametrize(("on_usr1", "requeued"), [(75, True), (0, False), (3, False), (138, True)])
def test_sigusr1_is_forwarded_to_srun_and_its_status_decides(cluster, on_usr1, requeued):
    proc = cluster.start(render(), FAKE_SLEEP="30", FAKE_CODE_ON_USR1=str(on_usr1))
    _wait_for(cluster.dir / "srun.ready", proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=20)
    assert time.monotonic() - t0 < 10, "srun got the signal, not the end of its sleep"
    assert (cluster.dir / "srun.signals").read_text().split() == ["USR1"]
    assert "received SIGUSR1" in out
    # a naive `wait` would report the interruption (138), not srun's status
    assert proc.returncode == (75 if on_usr1 == 138 else on_usr1), (out, err)
    assert ("requeue 12345" in cluster.scontrol_calls()) is requeued


# --- the checked-in examples --------------------------------------------------------------------------------------


def test_example_scripts_are_current():
    folder = REPO / "scripts" / "slurm"
    assert sorted(p.stem for p in folder.glob("*.sbatch")) == sorted(EXAMPLES)
    for name, overrides in EXAMPLES.items():
        output = f"scripts/slurm/{name}.sbatch"
        expected = render(overrides, output=output)
        assert (REPO / output).read_text() == expected, (
            f"{output} differs from what the config renders now; re-render it with:\n"
            f"  {render_command(DEFAULT, overrides, None, output)}"
        )
        assert os.access(REPO / output, os.X_OK), f"{output} should be executable"


@pytest.mark.parametrize("path", sorted((REPO / "scripts" / "slurm").glob("*.sbatch")), ids=lambda p: p.name)
def test_example_scripts_are_valid_bash(path):
    proc = bash_syntax_ok(path)
    assert proc.returncode == 0, proc.stderr


def test_examples_differ_where_they_should():
    one = directives((REPO / "scripts/slurm/one_node.sbatch").read_text())
    multi = (REPO / "scripts/slurm/multi_node.sbatch").read_text()
    assert "--nodes=1" in one and "--nodes=4" in directives(multi)
    assert "--container-image=" in (REPO / "scripts/slurm/multi_node_pyxis.sbatch").read_text()
    assert "apptainer exec --nv" in (REPO / "scripts/slurm/multi_node_apptainer.sbatch").read_text()
    cpu = (REPO / "scripts/slurm/one_node_cpu.sbatch").read_text()
    assert "--cpus-per-task=2" in directives(cpu) and "--gpus-per-node" not in cpu


# --- writing it -------------------------------------------------------------------------------------------------


def write_sbatch(cfg: Config, config: str, overrides: list[str], output: str | None) -> None:
    write_job(target_named("slurm"), cfg, config, overrides, output)


def test_write_sbatch_prints_without_output(capsys):
    write_sbatch(load_config(DEFAULT), DEFAULT, [], None)
    assert capsys.readouterr().out == render()


def test_write_sbatch_writes_an_executable_file(tmp_path):
    out = tmp_path / "sub" / "job.sbatch"
    write_sbatch(load_config(DEFAULT, ["slurm.nodes=2"]), DEFAULT, ["slurm.nodes=2"], str(out))
    assert out.read_text() == render(["slurm.nodes=2"], output=str(out))
    assert out.stat().st_mode & 0o777 == 0o755
    assert [p.name for p in out.parent.iterdir()] == ["job.sbatch"], "no temporary file left behind"


def test_a_stop_signal_that_leaves_no_time_to_checkpoint_and_upload_is_refused():
    """SIGUSR1 preempt_signal_s before the time limit: the ranks may take dist.shutdown_timeout_s to checkpoint
    and the launcher run.remote_wait_s to send it; SLURM kills the job at its limit whatever is left to do."""
    cfg = load_config(DEFAULT, ["slurm.preempt_signal_s=200", "dist.shutdown_timeout_s=120",
                                "run.remote=/shared/runs", "run.remote_wait_s=120"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"slurm\.preempt_signal_s=200 leaves too little time after the stop signal: "
                       r"dist\.shutdown_timeout_s=120 for the ranks to checkpoint and run\.remote_wait_s=120 to send "
                       r"it to run\.remote, plus 30 s, need 270 s .* at least 270"):  # fmt: skip
        render_sbatch(cfg, DEFAULT, [])
    render_sbatch(cfg.model_copy(update={"slurm": cfg.slurm.model_copy(update={"preempt_signal_s": 270})}), DEFAULT, [])
    local = cfg.model_copy(update={"run": cfg.run.model_copy(update={"remote": None})})
    render_sbatch(local, DEFAULT, [])  # without a remote 150 s suffice
