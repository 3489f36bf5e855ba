"""Benchmarks (``make bench``): figures written as JSON and as a markdown table."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from train.atomic import write_json_atomic, write_text_atomic
from train.errors import TrainError

REPO = Path(__file__).resolve().parents[2]
QUICK_RUN = ["--set", "train.epochs=1", "--set", "train.steps_per_epoch=10"]
"""What --quick does to a benchmark's config run: a few steps, to check the benchmark itself."""


def save_result(out: Path, stem: str, result: dict, markdown: str) -> None:
    """``out/<stem>.json`` and ``out/<stem>.md``, each written atomically."""
    write_json_atomic(out / f"{stem}.json", result)
    write_text_atomic(out / f"{stem}.md", markdown)


def machine_figures(load_before: float) -> dict:
    """What the figures were measured on: CPUs, torch, and the 1-minute load average before the benchmark and
    now (other processes on the machine show up as noise in every timing; the load says how much there was)."""
    return {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }


def run_config(config: str, folders: dict[str, Path], quick: bool = False) -> tuple[float, dict[str, dict]]:
    """``python -m train run --config configs/<config>.yaml`` on 2 ranks, as a user runs it, with ``folders``
    ("data", "cache", "runs") as its run folders: its wall time and its report's summary (task -> scores; the run
    is named as the config). TrainError with the end of its output when it fails."""
    sets = [arg for key, folder in folders.items() for arg in ("--set", f"run.{key}_dir={folder}")]
    command = [sys.executable, "-m", "train", "run", "--config", f"configs/{config}.yaml", "--nproc", "2", *sets]
    start = time.perf_counter()
    proc = subprocess.run([*command, *(QUICK_RUN if quick else [])], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise TrainError(f"configs/{config}.yaml failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
    from train.obs.report import read_summary

    return wall, read_summary(folders["runs"] / config)
