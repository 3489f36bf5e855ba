"""Sweeps on this machine, each trial a real run under torchrun: a sweep killed outright continues where it
stopped, each trial from its own checkpoint and each grid point once, and a trial clearly worse than the others
at the same step is pruned, recorded with that step and score; the leaderboard, best config and plots follow."""

from __future__ import annotations

import re

import pytest
from optuna.trial import TrialState

from tests.helpers import run_cli
from tests.sweeps import ONE_THREAD, space_file, sweep_args, trials
from train.config import load_config

pytestmark = pytest.mark.integration


def test_a_sweep_killed_mid_trial_continues_its_trials_from_their_checkpoints_each_grid_point_once(local_sweep):
    root, rerun = local_sweep.root, local_sweep.rerun
    assert "trial-000 resumes from its checkpoint" in rerun.stderr
    assert re.search(r"resumed from .*trial-000/checkpoints/step_", (root / "logs" / "trial-000.log").read_text())
    assert len(local_sweep.results) == 4  # every grid point, once, finished
    assert sorted(p.name for p in root.glob("trial-*")) == [f"trial-00{i}" for i in range(4)]
    summary = (root / "summary.md").read_text()
    assert summary.count("| finished |") == 4 and "4 of 4 trials (4 complete)" in summary
    best = min(local_sweep.results, key=local_sweep.results.get)
    cfg = load_config(root / "best.yaml")
    assert (("model.fno.width", cfg.model.fno.width), ("train.lr", cfg.train.lr)) == best
    assert cfg.run.name == "grid-best" and cfg.run.runs_dir == str(root.parent)
    assert (root / "plots" / "by_parameter.png").exists() and (root / "plots" / "over_trials.png").exists()

    again = run_cli(*local_sweep.args, env=ONE_THREAD, timeout=300)  # a finished sweep: nothing runs or is added
    assert again.returncode == 0 and "4 finished before" in again.stderr and len(trials(root)) == 4
    assert "started" not in again.stderr


# The grid runs 3e-3 first, then 0.3 (Optuna's grid order for seed 1), which diverges: its first validation is
# orders of magnitude worse than the first trial's at that step.
PRUNING = """\
sampler: grid
seed: 1
pruner: median
prune_after_trials: 1
space:
  train.lr: [3.0e-3, 0.3]
"""


def test_a_trial_worse_than_the_others_at_the_same_step_is_pruned_with_its_step_and_score(tmp_path):
    """Epochs of 50 steps: the sweep reads a trial's scores once a second, and a 20-step trial on a busy machine
    could end before the stop sent at its first bad score reached it (recorded as complete, not pruned)."""
    steps = 4 * 50
    args = sweep_args(
        tmp_path, space_file(tmp_path, PRUNING, "pruning"), "pruning", "--set", "train.steps_per_epoch=50"
    )
    proc = run_cli(*args, env=ONE_THREAD, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    root = tmp_path / "runs" / "pruning"
    by_number = {t.number: t for t in trials(root)}
    assert [by_number[i].params["train.lr"] for i in range(2)] == [3e-3, 0.3]
    finished = by_number[0]
    assert finished.state == TrialState.COMPLETE and finished.user_attrs["steps"] == steps
    worst = by_number[1]
    assert worst.state == TrialState.PRUNED, (worst.state, worst.intermediate_values)
    step, score = worst.user_attrs["pruned_at_step"], worst.user_attrs["pruned_score"]
    assert worst.intermediate_values[step] == score > finished.intermediate_values[step]
    assert worst.user_attrs["steps"] < steps  # it stopped early
    assert f"trial-001 pruned at step {step}" in proc.stderr
    assert proc.stderr.count("started (") == 2 and "trial-000 finished in" in proc.stderr
    assert f"| pruned at step {step} |" in (root / "summary.md").read_text()


MACHINE = """\
sampler: grid
pruner: none
space:
  tasks.advection1d.initial_step: [4, 30]
"""


def test_a_trial_the_machine_failed_stops_the_sweep_with_its_code_and_resumes_and_failed_ones_run_again(tmp_path):
    """A trial that ended 4 (here: its run folder in use; a full disk, the doctor and 5 or 128+N alike) was counted
    as failed: a 20-second full disk failed every trial, and once it was freed the same command ran nothing and
    exited 1. initial_step=30 leaves nothing to predict in the tiny data: a failure of the parameters."""
    from train.launch.run_lock import RunLock
    from train.run_dir import RunDir

    args = sweep_args(tmp_path, space_file(tmp_path, MACHINE, "machine"), "machine", "--set", "train.epochs=1")
    root = tmp_path / "runs" / "machine"
    with RunLock(RunDir(root / "trial-000")):  # another launch holds the first trial's run folder
        held = run_cli(*args, env=ONE_THREAD, timeout=900)
    assert held.returncode == 4, held.stderr[-4000:]
    assert re.search(r"trial-000 ended with exit 4, a failure of this machine, not of its parameters \(error: "
                     r"\S+trial-000 is in use by another launch", held.stderr), held.stderr[-3000:]  # fmt: skip
    (first,) = trials(root)
    assert first.state == TrialState.RUNNING and first.user_attrs["exit_code"] == 4
    assert "stopped after exit 4 (this machine's failure)" in (root / "summary.md").read_text()

    again = run_cli(*args, env=ONE_THREAD, timeout=900)  # the folder is free: it resumes, the other trial runs
    assert again.returncode == 0, again.stderr[-4000:]
    assert "trial-000 resumes from its checkpoint" in again.stderr
    by_step = {t.params["tasks.advection1d.initial_step"]: t for t in trials(root)}  # the grid's order is drawn
    assert by_step[4].state == TrialState.COMPLETE
    failed = by_step[30]
    assert failed.state == TrialState.FAIL and failed.user_attrs["exit_code"] == 2
    assert re.match(r"error: the data does not fit the config: .*initial_step=30", failed.user_attrs["error"]), failed

    retried = run_cli(*args, "--retry-failed", env=ONE_THREAD, timeout=900)
    assert retried.returncode == 0, retried.stderr[-4000:]
    assert f"failed trial(s) {failed.number} run again with their parameters" in retried.stderr
    by_number = {t.number: t for t in trials(root)}
    assert sorted(by_number) == [0, 1, 2] and by_number[2].params == failed.params
    assert by_number[2].state == TrialState.FAIL and "failed (exit 2, run again)" in (root / "summary.md").read_text()
    # The counts were "trial-002 started (3 of 2)" and "3 of 2 trials".
    assert f"trial-002 started (a retry of trial-{failed.number:03d}, 2 of 2)" in retried.stderr, retried.stderr[-3000:]
    assert "2 of 2 trials" in (root / "summary.md").read_text() and " of 2)" in retried.stderr
    assert "3 of 2" not in retried.stderr + (root / "summary.md").read_text()
    nothing = run_cli(*args, env=ONE_THREAD, timeout=900)  # the budget counts a retried trial once
    assert nothing.returncode == 0 and "started (" not in nothing.stderr, nothing.stderr[-3000:]
