"""A sweep as a SLURM job array on a real cluster: four array tasks, two at once, each taking trials from the
study until none is left. The task running the first trial is stopped as a preemption stops it (SIGUSR1 to its
batch script): the trial checkpoints, the task is requeued, and the trial resumes from its checkpoint. The sweep
ends with the results of the same grid run on this machine (tests/sweeps.py)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.helpers import run_cli
from tests.slurm.jobs import CPU_JOB, FINAL_STATES, Job, logged_step, submit
from tests.sweeps import ONE_THREAD, results, space_file, sweep_args

TIMEOUT = 900  # the whole array on a busy 2-core machine, the requeued task's second start included


def test_an_array_sweep_with_a_preempted_task_ends_with_the_local_sweeps_results(tmp_path, monkeypatch, local_sweep):
    script = tmp_path / "grid.sbatch"
    args = sweep_args(tmp_path, space_file(tmp_path), "grid", *CPU_JOB, "--slurm", "--output", str(script))
    rendered = run_cli(*args)
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    assert "#SBATCH --array=0-3%2" in script.read_text()
    for name, value in ONE_THREAD.items():  # sbatch hands the submitting environment to the tasks
        monkeypatch.setenv(name, value)
    array = submit(script, tmp_path / "grid-%A_%a.out")
    tasks = [Job(f"{array.id}_{i}", tmp_path / f"grid-{array.id}_{i}.out") for i in range(4)]
    root = tmp_path / "runs" / "grid"
    try:
        first = _task_running(tasks, "trial-000 started", root / "trial-000" / "metrics.jsonl")
        _preempt(first)
        for task in tasks:
            task.wait_done(timeout=TIMEOUT)
    finally:
        for task in tasks:
            task.cancel()

    assert results(root) == pytest.approx(local_sweep.results, rel=1e-6)
    outputs = "\n".join(task.text() for task in tasks)
    assert "requeueing job" in first.text() and int(first.show()["Restarts"]) >= 1, first.context()
    assert "trial-000 stopped at step" in first.text()
    assert "trial-000 resumes from its checkpoint" in outputs
    assert all(task.show()["JobState"] == "COMPLETED" for task in tasks), [t.context() for t in tasks]
    assert (root / "summary.md").read_text().count("| finished |") == 4
    assert re.search(r"resumed from .*trial-000/checkpoints/step_", (root / "logs" / "trial-000.log").read_text())


def _preempt(task: Job) -> None:
    """What the time limit or a preemption sends (--signal=B:USR1@...): SIGUSR1 to the task's batch script.

    SLURM 22.05's scancel delivers it to an array task while others are pending, but then exits non-zero and
    sends it again (rc 229): the script's own line says whether it arrived."""
    proc = subprocess.run(["scancel", "--signal=USR1", "--batch", task.id], capture_output=True, text=True)
    task.wait_for("the batch script's 'received SIGUSR1' line", lambda: "received SIGUSR1" in task.text(), 60)
    if proc.returncode not in (0, 229):
        raise AssertionError(f"scancel --signal=USR1 --batch {task.id} exited {proc.returncode}: {proc.stderr}")


def _task_running(tasks: list[Job], line: str, metrics) -> Job:
    """The array task whose output has ``line``, once its trial has logged a training step (``metrics``)."""
    deadline = time.monotonic() + TIMEOUT
    asked = 0.0
    while time.monotonic() < deadline:
        found = [task for task in tasks if line in task.text()]
        if found and logged_step(metrics) >= 0:
            return found[0]
        if time.monotonic() - asked > 2:  # the controller is asked every 2 s, not at the file poll's pace
            asked = time.monotonic()
            ended = [task for task in tasks if task.show().get("JobState") in FINAL_STATES]
            assert len(ended) < len(tasks), [t.context() for t in tasks]
        time.sleep(0.05)
    raise AssertionError(f"no array task logged {line!r} and checkpointed: {[t.context() for t in tasks]}")
