"""Jobs on the test cluster: render an sbatch file, submit it, watch it, signal it.

Every wait is bounded, and a wait that runs out fails with the job's output file and ``scontrol show job``, so
a failure on CI says what the job was doing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tests.helpers import REPO, folders, run_cli
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.obs.sinks import read_metrics

# States after which a job never runs again (a requeued job is PENDING, then RUNNING, in between).
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
    "PREEMPTED", "SPECIAL_EXIT",
}  # fmt: skip

# The rendered jobs run CPU ranks (the test node's GPU is fake). Their time limit is far beyond any test, and
# within the rule that it exceeds the signal lead by 120 s; the tiny ranks stop within 20 s of the signal, which
# leaves the lead room for it (slurm.preempt_signal_s >= dist.shutdown_timeout_s + 30 s).
CPU_JOB = ["--set", "slurm.gpus_per_node=0", "--set", "slurm.time=00:10:00", "--set", "slurm.preempt_signal_s=60",
           "--set", "dist.shutdown_timeout_s=20"]  # fmt: skip


def render(tmp: Path, name: str, *overrides: str, config: str = "configs/tiny.yaml") -> Path:
    """``python -m train slurm`` of ``config`` for run ``name``, data/cache/runs inside ``tmp``."""
    script = tmp / f"{name}.sbatch"
    proc = run_cli(
        "slurm", "--config", config, "--run", name, *CPU_JOB, *folders(tmp), *overrides, "--output", str(script),
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return script


def scontrol(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, f"scontrol {' '.join(args)} failed: {proc.stderr.strip()}"
    return proc


class Job:
    """A submitted job: its id and output file."""

    def __init__(self, job_id: str, output: Path):
        self.id = job_id
        self.output = output

    def __repr__(self) -> str:
        return f"job {self.id}"

    def show(self) -> dict[str, str]:
        """``scontrol show job`` as a dict (the job stays known to the controller for MinJobAge after it ends)."""
        text = scontrol("show", "job", "--oneliner", self.id).stdout
        fields: dict[str, str] = {}
        key = None
        for word in text.split():
            name, sep, value = word.partition("=")
            if sep:
                key = name
                fields[key] = value
            elif key is not None:  # a value with a space in it
                fields[key] += " " + word
        return fields

    @property
    def state(self) -> str:
        return self.show()["JobState"]

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def context(self) -> str:
        """What a failure message shows: the job's record and the end of its output."""
        shown = scontrol("show", "job", self.id, check=False)
        return (
            f"\n--- scontrol show job {self.id} ---\n{shown.stdout or shown.stderr}"
            f"--- {self.output} (last 6000 characters) ---\n{self.text()[-6000:]}"
        )

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float, poll: float = 0.2) -> None:
        """Poll ``ready`` until it is true; fail with ``what`` and the job's context after ``timeout`` seconds, or
        when the job ends first."""
        deadline = time.monotonic() + timeout
        asked = 0.0
        while not ready():
            now = time.monotonic()
            # The controller is asked once a second: a fast poll of a file must not become a stream of RPCs.
            if now - asked >= 1.0:
                asked = now
                state = self.state
                if state in FINAL_STATES and not ready():
                    raise AssertionError(f"{self} ended ({state}) before {what}{self.context()}")
            if now > deadline:
                raise AssertionError(f"{self}: no {what} within {timeout:.0f} s{self.context()}")
            time.sleep(poll)

    def wait_done(self, timeout: float) -> dict[str, str]:
        """Wait until the job has ended for good; returns its final record."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.show()
            if shown["JobState"] in FINAL_STATES:
                return shown
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self} still {shown['JobState']} after {timeout:.0f} s (restarts {shown.get('Restarts')})"
                    f"{self.context()}"
                )
            time.sleep(1)

    def signal_batch(self, name: str = "USR1") -> None:
        """What ``--signal=B:...`` does: the signal to the batch script only."""
        proc = subprocess.run(["scancel", f"--signal={name}", "--batch", self.id], capture_output=True, text=True)
        assert proc.returncode == 0, f"scancel --signal={name} --batch {self.id}: {proc.stderr}{self.context()}"

    def cancel(self) -> None:
        subprocess.run(["scancel", self.id], capture_output=True, timeout=60)


def submit(script: Path, output: Path, *sbatch_args: str) -> Job:
    """``sbatch`` from the repository (the job runs in the folder it was submitted from) with the tests' Python."""
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={output}", *sbatch_args, str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        # sbatch hands its environment to the job: PYTHON makes the rendered script use this virtual environment.
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, f"sbatch {script} failed: {proc.stderr}"
    return Job(proc.stdout.strip().split(";")[0], output)


def logged_step(metrics: Path) -> int:
    """The newest training step in a run's metrics.jsonl (-1 before the first)."""
    steps = [record["step"] for record in read_metrics(metrics) if "loss" in record]  # whole lines only
    return steps[-1] if steps else -1


def final_weights(run_dir: Path, epochs: int, steps: int) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None, f"no checkpoint in {run_dir}"
    state = load_checkpoint(path)
    assert (state["progress"]["epoch"], state["progress"]["global_step"]) == (epochs, steps), (path, state["progress"])
    return state["model"]
