"""The launcher turns every way a rank can end into one summary and the right exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, folders, free_port, run_cli

pytestmark = pytest.mark.integration


def test_an_error_raised_in_the_ranks_keeps_its_code_and_first_message(tmp_path):
    # Evaluating before training: every rank raises a DataError (exit 3) naming the missing checkpoint.
    proc = run_cli("evaluate", "--config", "configs/tiny.yaml", "--nproc", "2", *folders(tmp_path), timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    summary = proc.stderr.split("training failed:", 1)[1]
    assert "exited with code 3: " in summary and "no checkpoint in" in summary
    assert f"per-rank logs: {tmp_path / 'runs' / 'tiny' / 'logs'}" in summary
    torchrun_logs = list((tmp_path / "runs" / "tiny" / "logs" / "torchrun").rglob("stderr.log"))
    assert len(torchrun_logs) == 2, "each rank's own stdout/stderr file"


def test_a_node_that_never_arrives_ends_the_rendezvous_in_bounded_time(tmp_path):
    env = {"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    start = time.monotonic()
    proc = run_cli(
        "smoke", "--config", "configs/tiny.yaml", "--nproc", "1", "--set", "dist.timeout_s=10", "--skip-compile",
        *folders(tmp_path), env=env, timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "A node never arrived within dist.timeout_s=10s" in proc.stderr
    assert env["RDZV_ENDPOINT"] in proc.stderr
    assert elapsed < 90


def test_two_nodes_on_one_machine_meet_through_the_c10d_rendezvous(tmp_path):
    """The multi-node path for real: two launchers, one rank each, meeting at NODE_RANK 0's endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in (0, 1):
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(node), "RDZV_ENDPOINT": endpoint, "RDZV_ID": "t2"}
        args = ["smoke", "--config", "configs/tiny.yaml", "--nproc", "1", "--skip-compile", *folders(tmp_path)]
        procs.append(subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "smoke test: 2 rank(s)" in outputs[0][0] + outputs[1][0]


def test_a_signal_to_the_launcher_reaches_the_ranks_and_sets_the_exit_code(tmp_path):
    """SLURM's SIGUSR1 before the time limit, to the launcher alone: it forwards the signal to every rank, the
    ranks agree on a step, rank 0 checkpoints there, and the job exits 75 ("resume me")."""
    import signal

    args = ["run", "--config", "configs/tiny.yaml", "--nproc", "2", "--set", "train.steps_per_epoch=100000"]
    proc = subprocess.Popen([sys.executable, "-m", "train", *args, *folders(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    log = tmp_path / "runs" / "tiny" / "logs" / "rank1.log"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (log.is_file() and "training" in log.read_text()):
            time.sleep(0.2)
        assert log.is_file(), "rank 1 never started"
        proc.send_signal(signal.SIGUSR1)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, stderr[-3000:]
    assert "stopped by SIGUSR1" in stderr and "re-run the same command to resume" in stderr
    step = json.loads((tmp_path / "runs" / "tiny" / "preempted.json").read_text())["global_step"]
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / f"step_{step:08d}.pt").is_file()
