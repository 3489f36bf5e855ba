"""One launch per run folder: a second launch is refused at once, and a killed launcher leaves no rank behind.

Before, two launches into one folder both trained (metrics twice, a broken TensorBoard file, one resuming from
the other's checkpoints mid-run), and the ranks of a launcher killed with SIGKILL trained on unseen.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import folders, launch_in_background, run_cli, startup_s, wait_for
from train.launch.run_lock import RANK_EXIT_GRACE_S
from train.obs.procmem import child_pids
from train.obs.sinks import read_metrics
from train.run_dir import RunDir

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find the ranks"),
]

ENDLESS = ["--set", "train.steps_per_epoch=100000", "--set", "train.log_every=1"]
# 160 short steps, a checkpoint every 10: a window to kill the launcher mid-run, and a run a re-launch finishes.
SHORT = ["--set", "train.epochs=4", "--set", "train.steps_per_epoch=40", "--set", "train.checkpoint_every=10",
         "--set", "train.log_every=1"]  # fmt: skip


def fit_args(tmp: Path, *extra: str) -> list[str]:
    return ["fit", "--config", "configs/tiny.yaml", "--nproc", "2", "--run", "shared", *extra, *folders(tmp)]


def logged_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_second_launch_into_a_busy_run_folder_fails_at_once_naming_the_holder(tmp_path):
    run_dir = tmp_path / "runs" / "shared"
    first = launch_in_background(*fit_args(tmp_path, *ENDLESS))
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 2, "the first launch training", 60 * startup_s(), first)
        for doctor in ([], ["--skip-doctor"]):
            start = time.monotonic()
            second = run_cli(*fit_args(tmp_path, *ENDLESS, *doctor), timeout=60 * startup_s())
            elapsed = time.monotonic() - start
            assert second.returncode == 4, second.stderr[-3000:]
            assert f"{run_dir} is in use by another launch: pid {first.pid} on {socket.gethostname()}" in second.stderr
            assert "started 20" in second.stderr and "RUN=... or --run" in second.stderr
            ran = [stage for stage in ("preflight checks", "INFO data ") if stage in second.stderr]
            assert not ran, f"refused only after {ran}"
            assert elapsed < 10 * startup_s(), f"refused after {elapsed:.1f} s (start-up {startup_s():.1f} s)"
        assert first.poll() is None, "the first launch must be left alone"
        os.killpg(first.pid, signal.SIGTERM)
        _, err = first.communicate(timeout=60 * startup_s())
        assert first.returncode == 75, err[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    steps = logged_steps(run_dir)
    assert steps == sorted(set(steps)), "only one launch trained into the folder"


def test_ranks_die_with_a_killed_launcher_and_the_next_launch_resumes(tmp_path):
    run_dir = tmp_path / "runs" / "shared"
    first = launch_in_background(*fit_args(tmp_path, *SHORT))
    wait_for(lambda: max(logged_steps(run_dir), default=0) >= 15, "step 15", 60 * startup_s(), first)
    ranks = [pid for pid in child_pids(first.pid) if b"train.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(ranks) == 2, ranks
    first.kill()  # SIGKILL to the launcher alone, as the OOM killer or `timeout -s KILL` would
    first.communicate()
    try:
        wait_for(lambda: not any(alive(pid) for pid in ranks), "the ranks' exit", 10 * startup_s())
    finally:
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    seen = max(logged_steps(run_dir))
    time.sleep(1)
    assert max(logged_steps(run_dir)) == seen, "nothing trains on after the launcher is gone"
    again = run_cli(*fit_args(tmp_path, *SHORT), timeout=120 * startup_s())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    assert max(logged_steps(run_dir)) == 160


HOLD_RANKS_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.waits
def test_a_launch_waits_for_processes_of_the_previous_one_and_refuses_when_they_linger(tmp_path):
    """A process still holding the ranks' lock (a rank or DataLoader worker of an earlier launch) keeps the
    folder busy: the launch waits for it a while, then stops with exit 4 saying what holds it."""
    run_dir = tmp_path / "runs" / "shared"
    run_dir.mkdir(parents=True)
    _, ranks_lock = RunDir(run_dir).lock_paths(0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_RANKS_LOCK, str(ranks_lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        proc = run_cli(*fit_args(tmp_path), timeout=RANK_EXIT_GRACE_S + 60 * startup_s())
        elapsed = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "processes of an earlier launch" in proc.stderr and str(ranks_lock) in proc.stderr
    assert elapsed >= RANK_EXIT_GRACE_S
    with open(ranks_lock) as f:  # released with the holder: nothing of the launch holds it any more
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
