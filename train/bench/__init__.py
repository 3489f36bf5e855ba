"""Benchmarks (``make bench``): figures written as JSON and as a markdown table."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from train.atomic import write_json_atomic, write_text_atomic


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
