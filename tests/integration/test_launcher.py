"""The launcher turns every way a rank can end into one summary and the right exit code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, folders, free_port, launch_in_background, run_cli, startup_s

pytestmark = pytest.mark.integration


def test_an_error_raised_in_the_ranks_keeps_its_code_and_first_message(tmp_path):
    # Evaluating before training: every rank raises a DataError (exit 3) naming the missing checkpoint.
    proc = run_cli("evaluate", "--config", "configs/tiny.yaml", "--nproc", "2", *folders(tmp_path), timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "training failed" not in proc.stderr  # evaluation alone failed, and says so
    summary = proc.stderr.split("error: evaluation failed:", 1)[1]
    assert "exited with code 3: " in summary and "no checkpoint in" in summary
    assert f"per-rank logs: {tmp_path / 'runs' / 'tiny' / 'logs'}" in summary
    torchrun_logs = list((tmp_path / "runs" / "tiny" / "logs" / "torchrun").rglob("stderr.log"))
    assert len(torchrun_logs) == 2, "each rank's own stdout/stderr file"


@pytest.mark.waits
def test_a_node_that_never_arrives_ends_the_rendezvous_in_bounded_time(tmp_path):
    env = {"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    start = time.monotonic()
    proc = run_cli(
        "smoke", "--config", "configs/tiny.yaml", "--nproc", "1", "--set", "dist.timeout_s=10", "--skip-compile",
        *folders(tmp_path), env=env, timeout=10 + 60 * startup_s(),
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "node(s) 1 never reached the launch" in proc.stderr and "dist.timeout_s=10s" in proc.stderr
    assert env["RDZV_ENDPOINT"] in proc.stderr
    assert elapsed < 10 + 20 * startup_s(), f"{elapsed:.0f} s; a launcher starts in {startup_s():.1f} s here"


def test_two_nodes_on_one_machine_meet_through_the_c10d_rendezvous(tmp_path):
    """The multi-node path for real: two launchers, one rank each, meeting at NODE_RANK 0's endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in (0, 1):
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(node), "RDZV_ENDPOINT": endpoint, "RDZV_ID": "t2"}
        args = ["smoke", "--config", "configs/tiny.yaml", "--nproc", "1", "--skip-compile", *folders(tmp_path)]
        procs.append(subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=100 * startup_s()) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "smoke test: 2 rank(s)" in outputs[0][0] + outputs[1][0]


def test_a_signal_to_the_launcher_reaches_the_ranks_and_sets_the_exit_code(tmp_path):
    """SLURM's SIGUSR1 before the time limit, to the launcher alone: it forwards the signal to every rank, the
    ranks agree on a step, rank 0 checkpoints there, and the job exits 75 ("resume me")."""
    import signal

    args = ["run", "--config", "configs/tiny.yaml", "--nproc", "2", "--set", "train.steps_per_epoch=100000"]
    startup_s()  # measured before the launch, not while it runs
    proc = subprocess.Popen([sys.executable, "-m", "train", *args, *folders(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    log = tmp_path / "runs" / "tiny" / "logs" / "rank1.log"
    try:
        deadline = time.monotonic() + 60 * startup_s()
        # "training from epoch": the loop that turns a stop request into a checkpoint has begun (rank 1's earlier
        # line "training data read ..." comes before it, and a signal then ends the ranks without one)
        while time.monotonic() < deadline and not (log.is_file() and "training from epoch" in log.read_text()):
            time.sleep(0.2)
        assert log.is_file(), "rank 1 never started"
        proc.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=60 * startup_s())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, stderr[-3000:]
    assert "stopped by SIGUSR1" in stderr and "re-run the same command to resume" in stderr
    step = json.loads((tmp_path / "runs" / "tiny" / "preempted.json").read_text())["global_step"]
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / f"step_{step:08d}.pt").is_file()


def two_nodes(tmp_path, node_env: dict[int, dict], *extra: str) -> tuple[str, list[subprocess.Popen]]:
    """Two launchers of one smoke test on this machine, as two nodes meeting at NODE_RANK 0's endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["smoke", "--config", "configs/tiny.yaml", "--nproc", "1", "--skip-compile", *extra, *folders(tmp_path)]
    procs = []
    for node in (0, 1):
        env = {"NNODES": "2", "NODE_RANK": str(node), "RDZV_ENDPOINT": endpoint, "RDZV_ID": "t2", **node_env[node]}
        procs.append(launch_in_background(*args, env=env))
    return endpoint, procs


@pytest.mark.parametrize("failing", [0, 1])
def test_a_node_whose_peer_fails_preflight_stops_at_once_naming_the_peer_and_endpoint(tmp_path, failing):
    """No GPU here, so DDP_BACKEND=nccl fails the doctor's library check on one node (exit 4). The other node
    must not wait dist.timeout_s (300 s) for it: it ends within a few launcher start-up times."""
    start = time.monotonic()
    endpoint, procs = two_nodes(tmp_path, {failing: {"DDP_BACKEND": "nccl"}, 1 - failing: {}})
    budget = 300 / 2
    outputs = [p.communicate(timeout=budget) for p in procs]
    elapsed = time.monotonic() - start
    failed, other = procs[failing], procs[1 - failing]
    assert failed.returncode == 4, outputs[failing][1][-3000:]
    assert other.returncode == 5, outputs[1 - failing][1][-3000:]
    message = outputs[1 - failing][1]
    assert endpoint in message
    assert f"node {failing} failed before the launch" in message or "lost node 0's launcher" in message
    assert "preflight failed (libraries)" in message or failing == 0
    assert elapsed < 20 * startup_s(), f"{elapsed:.0f} s; a launcher starts in {startup_s():.1f} s here"


def test_a_busy_rendezvous_port_stops_node_0_at_once_naming_it(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        endpoint = f"127.0.0.1:{holder.getsockname()[1]}"
        env = {"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": endpoint}
        proc = run_cli("smoke", "--config", "configs/tiny.yaml", "--nproc", "1", *folders(tmp_path), env=env)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert f"node 0 cannot host the rendezvous at {endpoint}: port" in proc.stderr and "already in use" in proc.stderr


DRIVER = """
import sys
from train.config import load_config
from train.launch.torchrun import launch
from train.errors import TrainError
from train.run_dir import RunDir
try:
    launch(RunDir(sys.argv[1]), 2, load_config("configs/tiny.yaml"), [sys.argv[2]], module="tests.ranks")
except TrainError as e:
    print(e, file=sys.stderr)
    sys.exit(e.exit_code)
"""


def test_a_rank_that_aborts_after_its_peers_config_error_is_not_blamed(tmp_path):
    """Rank 0 exits with a config error; rank 1 dies by SIGABRT as a consequence. The launch exits 2 and names
    rank 0's error first (it used to put any signal first: exit 134)."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "run"), "abort-after-peer-error"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    summary = proc.stderr.split("training failed:", 1)[1]
    assert summary.strip().startswith("rank 0 ") and "with code 2: ConfigError" in summary.splitlines()[1]
    assert "rank 0 found a bad setting (tasks.x.y)" in summary


@pytest.mark.waits
def test_a_port_held_by_a_program_that_never_answers_ends_node_1_in_bounded_time(tmp_path):
    """It accepts the connection and says nothing: before, node 1 hung for as long as that program lived."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        env = {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": f"127.0.0.1:{holder.getsockname()[1]}"}
        start = time.monotonic()
        proc = run_cli("smoke", "--config", "configs/tiny.yaml", "--nproc", "1", "--set", "dist.timeout_s=10",
                       *folders(tmp_path), env=env, timeout=60 + 60 * startup_s())  # fmt: skip
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "accepts connections but never answered as a rendezvous store" in proc.stderr
    assert time.monotonic() - start < 15 + 30 * startup_s()
