"""Stops on a real cluster: the time limit's signal, `scancel --signal=USR1 --batch` and `scontrol requeue` each
checkpoint, requeue the job and end with weights bitwise equal to an uninterrupted run; a signal while the caches
are built requeues too.

Bitwise equality holds for the same config on CPU, eager, one or two gloo ranks, with dropout: everything random
derives from (seed, rank, epoch, step) and the checkpoint holds the step position (see
tests/integration/test_faults.py).

The jobs of all scenarios run side by side (each scenario in a thread of the module's fixture), so the tier
waits for requeue delays and SLURM's time-limit checks once instead of once per scenario; each test then reports
on its own scenario.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import assert_bitwise_equal
from tests.slurm.jobs import Job, final_weights, logged_step, render, scontrol, submit

# Every wait below is bounded by these; they allow a busy 2-core machine running all scenarios at once.
START_TIMEOUT = 300  # until a job has trained its first steps
JOB_TIMEOUT = 540  # until a job has ended for good (its time limit is 10 minutes)

# 160 steps, checkpoints every 10 (so a resume is mid-epoch), dropout: the stopped runs of scancel and requeue.
SHORT = [
    "--set", "train.epochs=4", "--set", "train.steps_per_epoch=40", "--set", "train.checkpoint_every=10",
    "--set", "train.log_every=1", "--set", "model.transformer.d_model=64", "--set", "model.transformer.n_layers=2",
    "--set", "model.transformer.dropout=0.1",
]  # fmt: skip
SHORT_END = (4, 160)

# SLURM checks time limits every 30 s, so the time limit's signal comes up to 30 s after it falls due: the run it
# stops trains for about 45 s on an idle 2-core machine, so that the signal finds it training. One rank: what the
# signal tests is SLURM's timing, and two ranks doubled the CPU this run and its reference spend waiting for it.
LONG = [
    "--set", "dist.cpu_nproc=1",
    "--set", "train.epochs=2", "--set", "train.steps_per_epoch=1600", "--set", "train.checkpoint_every=50",
    "--set", "train.log_every=5", "--set", "model.transformer.d_model=64", "--set", "model.transformer.n_layers=2",
    "--set", "model.transformer.dropout=0.1",
]  # fmt: skip
LONG_END = (2, 3200)
# The signal lead of the time-limit run: the new limit is set so that the signal is due at once (at the next
# check) while the job is still 90 s or more from being killed.
LEAD_S = 120

# A cache build of a few seconds: 600 advection samples of 1024 points and all 201 frames (about 0.5 GB).
BIG_CACHE = [
    "--set", "tasks.advection1d.n_samples=600", "--set", "tasks.advection1d.resolution=1024",
    "--set", "tasks.advection1d.temporal_stride=1",
]  # fmt: skip

STOPPED = "stopped on request (exit 75, nothing lost): requeueing job"


class Scenario:
    """One run on the cluster: rendered into its own folder, submitted and driven by its function in SCENARIOS."""

    def __init__(self, root: Path, name: str, overrides: list[str]):
        self.name = name
        self.tmp = root / name
        self.tmp.mkdir()
        self.overrides = overrides
        self.job: Job | None = None
        self.notes: list[str] = []
        self.left_after_stop: list[Path] | None = None

    @property
    def run_dir(self) -> Path:
        return self.tmp / "runs" / self.name

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def start(self, *overrides: str) -> Job:
        self.job = submit(render(self.tmp, self.name, *self.overrides, *overrides), self.tmp / f"{self.name}.out")
        return self.job

    def finish(self) -> dict[str, str]:
        """Wait for the end; the job must have completed, with exit code 0."""
        shown = self.job.wait_done(JOB_TIMEOUT)
        assert (shown["JobState"], shown["ExitCode"]) == ("COMPLETED", "0:0"), self.job.context()
        return shown

    def wait_for_step(self, step: int) -> int:
        self.job.wait_for(f"training step {step}", lambda: logged_step(self.metrics) >= step, START_TIMEOUT, 0.01)
        return logged_step(self.metrics)


def uninterrupted(s: Scenario) -> dict[str, str]:
    s.start()
    return s.finish()


def time_limit(s: Scenario) -> dict[str, str]:
    """The job's time limit is cut short while it trains: SLURM's own --signal=B:USR1@LEAD_S then stops it."""
    job = s.start("--set", f"slurm.preempt_signal_s={LEAD_S}")
    at = s.wait_for_step(5)
    h, m, sec = (int(part) for part in job.show()["RunTime"].split(":")[-3:])
    elapsed = h * 3600 + m * 60 + sec
    # Whole minutes, so that the limit lies within LEAD_S + 30 s from now: the signal is due at the next check;
    # the kill, at least LEAD_S - 30 s from now.
    minutes = (elapsed + LEAD_S + 30) // 60
    cut = time.monotonic()
    scontrol("update", f"JobId={job.id}", f"TimeLimit={minutes}")
    s.notes.append(f"time limit cut to {minutes} min after {elapsed} s, at step {at}")
    # Training must outlast SLURM's 30 s between checks: on a much faster machine LONG needs more steps.
    job.wait_for("the time limit's SIGUSR1", lambda: "received SIGUSR1" in job.text(), 60, 0.1)
    s.notes.append(f"SIGUSR1 {time.monotonic() - cut:.1f} s later, at step {logged_step(s.metrics)}")
    # The requeued run gets its limit back, or it would be signalled as it starts.
    scontrol("update", f"JobId={job.id}", "TimeLimit=10")
    return s.finish()


def scancel_usr1(s: Scenario) -> dict[str, str]:
    job = s.start()
    at = s.wait_for_step(random.Random().randrange(15, 130))
    job.signal_batch("USR1")
    s.notes.append(f"scancel --signal=USR1 --batch at step {at}")
    return s.finish()


def scontrol_requeue(s: Scenario) -> dict[str, str]:
    job = s.start()
    at = s.wait_for_step(random.Random().randrange(15, 130))
    scontrol("requeue", job.id)
    s.notes.append(f"scontrol requeue at step {at}")
    return s.finish()


def cache_stage(s: Scenario) -> dict[str, str]:
    """SIGUSR1 while the launcher builds a cache (a temporary folder exists beside the cache it becomes)."""
    job = s.start()
    building = s.tmp / "cache" / "advection1d"
    job.wait_for("a cache build", lambda: any(building.glob(".*.tmp")), START_TIMEOUT, 0.02)
    job.signal_batch("USR1")
    # The stopped launcher has exited when the script says it requeues; the next run starts seconds later.
    job.wait_for("the requeue after the stop", lambda: STOPPED in job.text(), START_TIMEOUT, 0.05)
    s.left_after_stop = leftovers(s.tmp)
    return s.finish()


def leftovers(tmp: Path) -> list[Path]:
    return [p for folder in ("data", "cache") for p in (tmp / folder).rglob("*.tmp")]


SCENARIOS: dict[str, tuple[list[str], Callable[[Scenario], dict[str, str]]]] = {
    "reference_short": (SHORT, uninterrupted),
    "reference_long": (LONG, uninterrupted),
    "time_limit": (LONG, time_limit),
    "scancel_usr1": (SHORT, scancel_usr1),
    "scontrol_requeue": (SHORT, scontrol_requeue),
    "cache_stage": (BIG_CACHE, cache_stage),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Scenario, Future]]:
    root = tmp_path_factory.mktemp("requeue")
    scenarios = {name: Scenario(root, name, overrides) for name, (overrides, _) in SCENARIOS.items()}
    with ThreadPoolExecutor(len(scenarios)) as pool:
        futures = {name: pool.submit(SCENARIOS[name][1], s) for name, s in scenarios.items()}
        try:
            yield {name: (scenarios[name], futures[name]) for name in scenarios}
        finally:
            for s in scenarios.values():
                if s.job is not None:
                    s.job.cancel()  # a failed scenario's job must not run on beside the next tests
    shutil.rmtree(scenarios["cache_stage"].tmp / "data", ignore_errors=True)  # half a GB each
    shutil.rmtree(scenarios["cache_stage"].tmp / "cache", ignore_errors=True)


def result(runs, name: str) -> tuple[Scenario, dict[str, str]]:
    s, future = runs[name]
    return s, future.result()  # raises what failed in the scenario's thread


def assert_resumed_and_equal(runs, name: str, reference: str, end: tuple[int, int]) -> str:
    """The scenario's job was requeued, resumed from a checkpoint and ended bitwise equal; returns its output."""
    s, shown = result(runs, name)
    print(f"{name}: {'; '.join(s.notes)}")
    assert int(shown["Restarts"]) >= 1, f"{name} was never requeued{s.job.context()}"
    text = s.job.text()
    assert "resumed from" in text, f"the requeued run did not resume from a checkpoint{s.job.context()}"
    ref, _ = result(runs, reference)
    assert_bitwise_equal(final_weights(s.run_dir, *end), final_weights(ref.run_dir, *end))
    return text


def test_the_time_limit_signal_checkpoints_requeues_and_ends_bitwise_equal(runs):
    text = assert_resumed_and_equal(runs, "time_limit", "reference_long", LONG_END)
    assert "received SIGUSR1" in text and "SIGUSR1: stopping at global step" in text and STOPPED in text


def test_scancel_usr1_to_the_batch_script_checkpoints_requeues_and_ends_bitwise_equal(runs):
    text = assert_resumed_and_equal(runs, "scancel_usr1", "reference_short", SHORT_END)
    assert "received SIGUSR1" in text and "SIGUSR1: stopping at global step" in text and STOPPED in text


def test_scontrol_requeue_checkpoints_and_the_requeued_job_ends_bitwise_equal(runs):
    """SLURM requeues the job itself: slurmd sends SIGTERM to every process, the ranks checkpoint on it."""
    text = assert_resumed_and_equal(runs, "scontrol_requeue", "reference_short", SHORT_END)
    assert "DUE TO JOB REQUEUE" in text and "SIGTERM: stopping at global step" in text


def test_a_signal_while_the_cache_is_built_requeues_and_the_job_completes(runs):
    s, shown = result(runs, "cache_stage")
    text = s.job.text()
    assert int(shown["Restarts"]) >= 1, f"the job was never requeued{s.job.context()}"
    stop = text.index("received SIGUSR1")
    assert "launching" not in text[:stop], f"the signal came after the cache stage{s.job.context()}"
    assert "cache advection1d: built" not in text[:stop], f"the cache was complete before the signal{s.job.context()}"
    assert s.left_after_stop == [], f"temporary files left by the stopped launcher{s.job.context()}"
    assert (s.run_dir / "report" / "summary.json").is_file(), s.job.context()
    assert not leftovers(s.tmp), s.job.context()
