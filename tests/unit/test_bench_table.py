"""The benchmarks and GPU checks are rows of their tables: every module a row, every row runnable as the command
line calls it, and nothing of the product importing them (tests/unit/test_layers.py puts train.bench on top)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from train.bench.__main__ import parse_args
from train.bench.gpu import checks
from train.bench.gpu.table import CHECKS, DEFAULT
from train.bench.table import BENCHMARKS

BENCH = Path(__file__).resolve().parents[2] / "train" / "bench"
HELPERS = {"__init__", "__main__", "table", "cgroup", "bare_ddp"}  # pieces the benchmarks share or run


def test_every_benchmark_module_is_a_row_and_every_row_takes_its_options():
    modules = {p.stem for p in BENCH.glob("*.py")} - HELPERS
    assert modules == {row.module for row in BENCHMARKS}
    for row in BENCHMARKS:
        parameters = inspect.signature(importlib.import_module(f"train.bench.{row.module}").run).parameters
        wanted = {"out", "workdir", "quick", *(o.name for o in row.options)}
        assert wanted <= set(parameters), f"{row.module}.run lacks {wanted - set(parameters)}"
        assert set(row.quick) <= {o.name for o in row.options}, row.name
        assert row.targets and row.budget and row.measures, row.name


def test_a_rows_options_reach_the_command_line_with_their_defaults():
    for row in BENCHMARKS:
        args = parse_args([row.name])
        assert {o.name: getattr(args, o.name) for o in row.options} == {o.name: o.default for o in row.options}


def test_every_gpu_check_is_a_row_and_every_row_a_check():
    functions = {name for name, f in vars(checks).items() if name.startswith("check_") and callable(f)}
    assert functions == {row.check for row in CHECKS}
    assert DEFAULT == ("perf", "no_sync", "accuracy", "fsdp", "smoke", "fno_bf16", "resume")
