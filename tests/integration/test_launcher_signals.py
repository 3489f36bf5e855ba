"""SIGUSR1 (SLURM's --signal), SIGTERM and SIGHUP reaching the launcher outside training: a clean stop, exit 75.

Before, the default action killed the launcher on the spot: exit 138 or 143, a job SLURM never requeues, and a
``.tmp`` file left in the data folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from filelock import FileLock

from tests.helpers import folders, free_port, launch_in_background, run_cli, startup_s, wait_for
from train.data.cache.build import LOCK
from train.obs.sinks import read_metrics

pytestmark = pytest.mark.integration

# Darcy samples at 64x64 take a few milliseconds each to solve: generation takes seconds.
SLOW_DATA = ["--set", "tasks.darcy2d.n_samples=1000", "--set", "tasks.darcy2d.resolution=64"]


def temporary_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob(".*.tmp")) if folder.exists() else []


def stopped_cleanly(proc, sig: signal.Signals, log: Path | None = None) -> None:
    _, err = proc.communicate(timeout=30 * startup_s())
    err = err if log is None else log.read_text()
    assert proc.returncode == 75, err[-3000:]
    assert f"stopped by {sig.name}" in err and "re-run the same command to continue" in err
    assert "Traceback" not in err


def test_a_signal_while_data_is_generated_removes_the_partial_file_and_exits_75(tmp_path):
    args = ["run", "--config", "configs/tiny.yaml", *SLOW_DATA, *folders(tmp_path)]
    proc = launch_in_background(*args)
    data = tmp_path / "data" / "darcy2d"
    wait_for(lambda: bool(temporary_files(data)), "the darcy2d file being written", 60 * startup_s(), proc)
    os.kill(proc.pid, signal.SIGUSR1)  # the launcher alone, as srun forwards SLURM's signal
    stopped_cleanly(proc, signal.SIGUSR1)
    assert temporary_files(tmp_path / "data") == []
    assert not list(data.glob("*.hdf5")), "no file under its final name"

    again = run_cli("data", "--config", "configs/tiny.yaml", *SLOW_DATA, *folders(tmp_path), timeout=120 * startup_s())
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(list(data.glob("*.hdf5"))) == 1 and temporary_files(tmp_path / "data") == []


def test_a_signal_while_the_cache_stage_waits_for_another_build_exits_75(tmp_path):
    """The cache stage waits while another launch on this node builds caches (it holds their lock)."""
    cache, log = tmp_path / "cache", tmp_path / "launcher.log"
    cache.mkdir()
    with FileLock(str(cache / LOCK)):
        proc = launch_in_background("run", "--config", "configs/tiny.yaml", *folders(tmp_path), log=log)
        waiting = "waiting for another process to finish building caches"
        wait_for(lambda: waiting in log.read_text(), "the cache stage waiting", 60 * startup_s(), proc)
        os.kill(proc.pid, signal.SIGTERM)
        stopped_cleanly(proc, signal.SIGTERM, log)
    assert temporary_files(cache) == []


def test_a_signal_while_waiting_for_node_0_exits_75(tmp_path):
    env = {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    log = tmp_path / "launcher.log"
    args = ["smoke", "--config", "configs/tiny.yaml", "--nproc", "1", *folders(tmp_path)]
    proc = launch_in_background(*args, env=env, log=log)
    wait_for(lambda: "waiting for node 0's launcher" in log.read_text(), "node 1 waiting", 60 * startup_s(), proc)
    os.kill(proc.pid, signal.SIGUSR1)
    stopped_cleanly(proc, signal.SIGUSR1, log)


def test_sighup_a_closed_terminal_is_a_stop_request_with_a_checkpoint(tmp_path):
    """A closed terminal sends SIGHUP to the whole foreground job: before, it killed the ranks at once (129)."""
    args = ["run", "--config", "configs/tiny.yaml", "--nproc", "2", "--set", "train.steps_per_epoch=100000"]
    log, metrics = tmp_path / "launcher.log", tmp_path / "runs" / "tiny" / "metrics.jsonl"
    proc = launch_in_background(*args, "--set", "train.num_workers=1", *folders(tmp_path), log=log)
    # Steps logged: every rank handles stop signals and its DataLoader worker is up (and ignores them)
    training = lambda: any(r.get("step", 0) >= 4 for r in read_metrics(metrics))  # noqa: E731
    wait_for(training, "training steps", 60 * startup_s(), proc)
    os.killpg(proc.pid, signal.SIGHUP)
    proc.wait(timeout=60 * startup_s())
    assert proc.returncode == 75, log.read_text()[-3000:]
    step = json.loads((tmp_path / "runs" / "tiny" / "preempted.json").read_text())["global_step"]
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / f"step_{step:08d}.pt").is_file()
    assert "stopped by SIGHUP" in log.read_text()


def test_a_stop_during_the_evaluation_exits_75_and_the_rerun_evaluates(tmp_path, farm):
    farm.tiny(into=tmp_path)  # a trained tiny run, whose report goes: the next `run` evaluates
    shutil.rmtree(tmp_path / "runs" / "tiny" / "report")
    log, report = tmp_path / "launcher.log", tmp_path / "runs" / "tiny" / "report" / "summary.json"
    outputs = lambda: list((tmp_path / "runs" / "tiny" / "logs" / "torchrun").rglob("stdout.log"))  # noqa: E731
    fitted = len(outputs())
    proc = launch_in_background("run", "--config", "configs/tiny.yaml", *folders(tmp_path), log=log)
    # torchrun's agent has started the ranks (and handles signals) once their output files exist
    wait_for(lambda: len(outputs()) > fitted, "the evaluation's ranks", 60 * startup_s(), proc)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher alone; torchrun forwards it to the evaluating ranks
    proc.wait(timeout=60 * startup_s())
    assert proc.returncode == 75, log.read_text()[-3000:]
    assert "during the evaluation, after training was complete" in log.read_text() and not report.exists()

    again = run_cli("run", "--config", "configs/tiny.yaml", *folders(tmp_path), timeout=120 * startup_s())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already holds 2 trained epochs" in again.stderr and report.is_file()


def test_a_stale_partial_data_file_of_a_killed_writer_is_swept(tmp_path):
    data = tmp_path / "data" / "darcy2d"
    data.mkdir(parents=True)
    stale, fresh = data / ".x.hdf5.abc.tmp", data / ".y.hdf5.def.tmp"
    stale.write_bytes(b"half"), fresh.write_bytes(b"being written")
    os.utime(stale, (0, 0))  # untouched for decades: its writer was SIGKILLed
    proc = run_cli("data", "--config", "configs/tiny.yaml", *folders(tmp_path), timeout=120 * startup_s())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not stale.exists() and fresh.exists(), "a writer that is alive keeps its file"
    assert f"removed {stale}" in proc.stderr
