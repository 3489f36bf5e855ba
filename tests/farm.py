"""The farm of trained runs the tests share: each run trained once, on first use, for every test process of
``make test`` at once; a test that reads a run reads the farm's, a test that writes into one gets a copy.

The farm is a folder: ``$TRAIN_TEST_FARM`` (which ``python -m tests.tiers`` sets for all its tiers, so that the
SLURM tier, beside the integration tier, finds the sweep the integration tier trained) or, for a pytest
session of its own, one of its temporary folders. Each entry is built by one process under a lock of its own
while any other that needs it waits, and is marked complete only when its build ended well: a build that failed
is built again by the next test that asks, which then fails with the build's own message.

Entries: ``tiny`` (``python -m train run`` of configs/tiny.yaml on 2 ranks: data, caches, the run folder with
checkpoints and report), ``fno`` (the same config's tasks learnt by a small FNO on one rank),
``reference-<variant>`` (the 160-step uninterrupted run that interrupted runs must end bitwise equal to, for each
objective of :data:`OBJECTIVES`, for the sharded model and for the multi-physics model drawing one dataset per
step: :data:`VARIANTS`, and with the whole step compiled: :data:`COMPILED`) and ``sweep`` (tests/sweeps.py's
grid, killed mid-trial and continued).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from tests.helpers import folders, run_cli

DONE = ".done"

# 160 steps of about 20 ms: a window of seconds in which to interrupt the run at a random step.
LONG = [
    "--set", "train.epochs=4", "--set", "train.steps_per_epoch=40", "--set", "train.checkpoint_every=10",
    "--set", "train.log_every=1", "--set", "model.transformer.d_model=64", "--set", "model.transformer.n_layers=2",
    "--set", "model.transformer.dropout=0.1",  # randomness inside the step must replay too
]  # fmt: skip
# The default objective, and one whose steps draw how far they roll out: both must replay exactly.
OBJECTIVES = {"one_step": [], "pushforward": ["--set", "train.objective=pushforward", "--set", "train.rollout_steps=3"]}
# ... and the model sharded over the ranks (FSDP2) instead of replicated: every fault must replay as exactly. So
# must the multi-physics model with each rank drawing one dataset per step: the draws replay too.
MULTIPHYSICS = [
    "--set", "model.name=multiphysics", "--set", "model.multiphysics.d_model=32", "--set",
    "model.multiphysics.n_heads=2", "--set", "model.multiphysics.n_layers=2", "--set", "model.multiphysics.dropout=0.1",
    "--set", "train.task_sampling=weighted",
]  # fmt: skip
VARIANTS = {**OBJECTIVES, "fsdp": ["--set", "dist.parallel=fsdp"], "multiphysics": MULTIPHYSICS}
# ... and the whole step compiled (torch.compile of the rollout, loss, gradients, their all-reduce and AdamW): a
# resumed compiled run replays the uninterrupted compiled one (its dropout drawn in the graph from the same seeds).
# The graphs run on PyTorch's kernels (aot_eager): what a resume must restore (the compiled step's optimizer state,
# its learning-rate tensors, each step's seeds) is the graph's, not the code generator's, and generating C++ for
# three launches' graphs cost two minutes of CI's two cores.
COMPILED = ["--set", "compile.enabled=true", "--set", "compile.backend=aot_eager"]
REFERENCES = {**VARIANTS, "compiled": COMPILED}
TINY = ["--config", "configs/tiny.yaml", "--nproc", "2"]
FNO = ["--set", "model.name=fno", "--set", "model.fno.modes=8", "--set", "model.fno.width=8"]


def fit_argv(tmp: Path, run: str, *extra: str) -> list[str]:
    """The LONG fit of the tiny config in ``tmp``'s data, cache and runs folders."""
    return ["fit", *TINY, "--run", run, *LONG, *folders(tmp), *extra]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model of a LONG run's last checkpoint (which must be its end: epoch 4, step 160)."""
    from train.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    state = load_checkpoint(path)
    assert state["progress"]["epoch"] == 4 and state["progress"]["global_step"] == 160, (path, state["progress"])
    return state["model"]


class Farm:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def entry(self, name: str, build: Callable[[Path], None]) -> Path:
        """The folder of entry ``name``, built by ``build(folder)`` the first time any test process asks."""
        folder = self.root / name
        fd = os.open(self.root / f".{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another process building it: wait for its end
            if not (folder / DONE).is_file():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                (folder / DONE).touch()
        finally:
            os.close(fd)
        return folder

    def copy(self, name: str, build: Callable[[Path], None], dest: Path) -> Path:
        """A private copy of entry ``name`` (data, caches and runs alike) at ``dest``, for a test that writes."""
        shutil.copytree(self.entry(name, build), dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(DONE))
        return dest

    # -- the entries -------------------------------------------------------------------------------------------

    def tiny(self, into: Path | None = None) -> Path:
        """The tiny run's folder root (``data/``, ``cache/``, ``runs/tiny/``); ``into``: a copy of it there."""
        return self.entry("tiny", _tiny) if into is None else self.copy("tiny", _tiny, into)

    def fno(self) -> Path:
        """The run folder of the tiny FNO run (both tiny tasks, one rank, :data:`FNO` settings), for reading."""
        return self.entry("fno", _fno) / "runs" / "base"

    def reference(self, variant: str) -> dict[str, torch.Tensor]:
        """The final weights of the uninterrupted LONG run of ``variant`` (an objective, or fsdp)."""
        return final_weights(self.reference_run(variant))

    def reference_run(self, variant: str) -> Path:
        """The run folder of the uninterrupted LONG run of ``variant``, for reading."""
        return self.entry(f"reference-{variant}", lambda f: _reference(f, variant)) / "runs" / "reference"

    def sweep(self):
        """tests/sweeps.py's grid sweep, killed mid-trial and continued (a LocalSweep)."""
        from tests.sweeps import LocalSweep, run_killed_and_continued

        def build(folder: Path) -> None:
            done = run_killed_and_continued(folder)
            rerun = {"returncode": done.rerun.returncode, "stdout": done.rerun.stdout, "stderr": done.rerun.stderr}
            results = [[[list(pair) for pair in key], value] for key, value in done.results.items()]
            (folder / "sweep.json").write_text(json.dumps({"args": done.args, **rerun, "results": results}))

        folder = self.entry("sweep", build)
        record = json.loads((folder / "sweep.json").read_text())
        rerun = subprocess.CompletedProcess(record["args"], record["returncode"], record["stdout"], record["stderr"])
        results = {tuple(tuple(pair) for pair in key): value for key, value in record["results"]}
        return LocalSweep(folder / "runs" / "grid", record["args"], rerun, results)


def _tiny(folder: Path) -> None:
    proc = run_cli("run", *TINY, *folders(folder))
    assert proc.returncode == 0, proc.stderr[-4000:]


def _fno(folder: Path) -> None:
    proc = run_cli("run", "--config", "configs/tiny.yaml", "--nproc", "1", "--run", "base", *FNO, *folders(folder))
    assert proc.returncode == 0, proc.stderr[-4000:]


def _reference(folder: Path, variant: str) -> None:
    proc = run_cli(*fit_argv(folder, "reference", *REFERENCES[variant]))
    assert proc.returncode == 0, proc.stderr[-3000:]
