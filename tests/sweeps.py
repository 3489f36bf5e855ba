"""The sweep the sweep tests share: a 4-point grid over the tiny FNO, and its results read from the study's
journal with Optuna's own storage.

Its local run (the ``local_sweep`` fixture, once per session) is SIGKILLed while its first trials train, then
run again: the integration tier checks that it continued where it stopped, and the SLURM tier that the same
sweep as a job array with a preempted task ends with the same results.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

from tests.helpers import folders, launch_in_background, run_cli, startup_s, wait_for

GRID = """\
sampler: grid
parallel: 2
pruner: none
space:
  model.fno.width: [8, 12]
  train.lr: [1.0e-3, 3.0e-3]
"""
# One rank per trial, one thread per rank (the local slots and the SLURM tasks alike): equal arithmetic, equal
# results. Four epochs of 5 steps, a checkpoint and a validation after each.
BASE = [
    "--config", "configs/tiny.yaml", "--set", "model.name=fno", "--set", "dist.nproc=1",
    "--set", "compile.enabled=false", "--set", "train.epochs=4",
]  # fmt: skip
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def space_file(tmp: Path, text: str = GRID, name: str = "grid") -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return path


def sweep_args(tmp: Path, space: Path, name: str, *extra: str) -> list[str]:
    return ["sweep", *BASE, "--space", str(space), "--name", name, *folders(tmp), *extra]


def trials(root: Path) -> list[optuna.trial.FrozenTrial]:
    """Every trial of the sweep in ``root``, as Optuna's journal storage reads it."""
    journal = str(root / "study.journal")
    storage = JournalStorage(JournalFileBackend(journal, lock_obj=JournalFileOpenLock(journal)))
    return optuna.load_study(study_name=root.name, storage=storage).get_trials(deepcopy=False)


def results(root: Path) -> dict[tuple, float]:
    """Each finished trial's value by its parameters (sorted by name); fails on a trial that did not finish or a
    grid point run twice."""
    out = {}
    for t in trials(root):
        assert t.state == optuna.trial.TrialState.COMPLETE, (t.number, t.state, t.user_attrs)
        key = tuple(sorted(t.params.items()))
        assert key not in out, f"{key} ran twice"
        assert math.isfinite(t.value)
        out[key] = t.value
    return out


@dataclass
class LocalSweep:
    root: Path
    """The sweep's folder."""
    args: list[str]
    """Its command line (after ``python -m train``)."""
    rerun: subprocess.CompletedProcess
    """The command run again after the first was SIGKILLed."""
    results: dict[tuple, float]


def run_killed_and_continued(tmp: Path) -> LocalSweep:
    """The grid sweep, SIGKILLed once trial-000 has written a checkpoint, then run again to its end."""
    args = sweep_args(tmp, space_file(tmp), "grid")
    root = tmp / "runs" / "grid"
    first = launch_in_background(*args, env=ONE_THREAD, log=tmp / "first.log")
    checkpoints = root / "trial-000" / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step_*.pt")), "trial-000's first checkpoint", 60 * startup_s() + 120, first)
    os.kill(first.pid, signal.SIGKILL)  # no handler runs: its trials stop on their own (parent-death signal)
    first.wait()
    rerun = run_cli(*args, env=ONE_THREAD, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    return LocalSweep(root, args, rerun, results(root))
