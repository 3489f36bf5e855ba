"""Compile benchmark: the whole step compiled against the eager step, on the CPU.

- A small model whose step is bound by the host, not by arithmetic: a 1D FNO of 30,157 parameters (width 20,
  8 modes, 4 layers) at batch 20 on 160 points, one input frame, one-step objective, one process (the size at
  which another framework's JIT-compiled FNO ran 10,000 steps in 103 CPU seconds against this package's 145).
  Launched alternately compiled and eager (``repeats`` times); the step time is the median over logging windows
  after ``warmup`` steps (the compiled run's compile falls in its warm-up). Target: compiled at least 1.5x the
  eager step's speed.
- ``--default-run``: ``configs/default.yaml`` as a user runs it (2 ranks), compiled and eager, each timed from the
  command to its report (its data and caches built before either, compile time included), with steps per second
  and test nRMSE: what choosing compile for a CPU run costs or saves.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from train import run_files
from train.bench import machine_figures, save_result
from train.config import load_config
from train.data.acquire.sources import stage_data
from train.launch.torchrun import launch
from train.obs.sinks import read_metrics
from train.pipeline import stage_cache
from train.run_dir import RunDir

REPO = Path(__file__).resolve().parents[2]
TARGET = 1.5
TARGET_NAME = f"small FNO: compiled step >= {TARGET}x the eager step's speed"
SMALL = {
    "tasks": {
        "advection1d": {
            "pde": "advection1d",
            "source": "generate",
            "n_samples": 120,
            "resolution": 160,
            "coefficient": 0.1,
            "temporal_stride": 5,
            "initial_step": 1,
            "batch_size": 20,
            "patch_size": 8,
        }
    },
    "model": {"name": "fno", "fno": {"width": 20, "modes": 8, "layers": 4}},
    "train": {
        "objective": "one_step",
        "epochs": 1,
        "lr": 1.0e-3,
        "warmup_steps": 10,
        "checkpoint_every": None,
        "val_every": None,
    },
}


def _small_config(workdir: Path, compiled: bool, steps: int, warmup: int, log_every: int):
    path = workdir / "compile-small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    overrides = [
        f"compile.enabled={str(compiled).lower()}",
        f"train.steps_per_epoch={warmup + steps}",
        f"train.log_every={log_every}",
        f"run.data_dir={workdir / 'compile-data'}",
        f"run.cache_dir={workdir / 'compile-cache'}",
        f"run.runs_dir={workdir / 'compile-runs'}",
    ]
    return load_config(path, overrides, run_name=f"small-{'compiled' if compiled else 'eager'}")


def _steady(run: RunDir, warmup: int, log_every: int) -> dict:
    records = [r for r in read_metrics(run.root / run_files.METRICS) if "step_time_s" in r]
    steady = [r for r in records if r["step"] - log_every >= warmup]
    if not steady:
        raise RuntimeError(f"no metrics window after {warmup} warm-up steps in {run.root / run_files.METRICS}")
    compile_block = {}
    with_compile = run.report / run_files.COMPILE
    if with_compile.is_file():
        compile_block = json.loads(with_compile.read_text())
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
        "windows": len(steady),
        "compile": compile_block,
    }


def small_model(workdir: Path, steps: int, warmup: int, repeats: int, log_every: int) -> dict:
    """The small FNO compiled and eager, ``repeats`` launches each, alternating; one process each."""
    results = []
    folders = None
    for i in range(repeats):
        pair = {}
        for compiled in (True, False):
            cfg = _small_config(workdir, compiled, steps, warmup, log_every)
            if folders is None:
                folders = stage_cache(cfg, stage_data(cfg))
            run = RunDir.of(cfg)
            shutil.rmtree(run.root, ignore_errors=True)
            run.prepare(cfg)
            run.write_inputs(folders)
            print(
                f"compile benchmark: repeat {i + 1}/{repeats}, {'compiled' if compiled else 'eager'}",
                file=sys.stderr,
                flush=True,
            )
            launch(run, 1, cfg, ["--stages", "fit"], module="train.worker")
            pair["compiled" if compiled else "eager"] = _steady(run, warmup, log_every)
        pair["speedup"] = pair["eager"]["step_time_s"] / pair["compiled"]["step_time_s"]
        results.append(pair)
    return {
        "compiled_step_s": statistics.median(r["compiled"]["step_time_s"] for r in results),
        "eager_step_s": statistics.median(r["eager"]["step_time_s"] for r in results),
        "speedup": statistics.median(r["speedup"] for r in results),
        "compile": results[0]["compiled"]["compile"],
        "repeats": results,
    }


def default_config_both_ways(workdir: Path) -> dict:
    """configs/default.yaml compiled and eager, each from the command to its report (data and caches first)."""
    folders = {key: workdir / f"default-{key}" for key in ("data", "cache")}
    sets = [arg for key, folder in folders.items() for arg in ("--set", f"run.{key}_dir={folder}")]
    base = [sys.executable, "-m", "train"]
    subprocess.run([*base, "cache", "--config", "configs/default.yaml", *sets], cwd=REPO, check=True)
    out = {}
    for compiled in (False, True):
        runs = workdir / f"default-runs-{'compiled' if compiled else 'eager'}"
        shutil.rmtree(runs, ignore_errors=True)
        command = [
            *base,
            "run",
            "--config",
            "configs/default.yaml",
            "--nproc",
            "2",
            *sets,
            "--set",
            f"run.runs_dir={runs}",
            "--set",
            f"compile.enabled={str(compiled).lower()}",
        ]
        print(
            f"compile benchmark: configs/default.yaml, {'compiled' if compiled else 'eager'}",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f"configs/default.yaml failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        run = runs / "default"
        records = [r for r in read_metrics(run / run_files.METRICS) if "step_time_s" in r]
        summary = json.loads((run / run_files.REPORT / run_files.SUMMARY).read_text())
        out["compiled" if compiled else "eager"] = {
            "command_to_report_s": wall,
            "median_step_s": statistics.median(r["step_time_s"] for r in records[1:]),
            "test_nrmse": {n: s["nrmse"] for n, s in summary.items() if n != "compile"},
            "compile": summary.get("compile"),
        }
    return out


def run(out: Path, workdir: Path, steps: int, warmup: int, repeats: int, default_run: bool, quick: bool) -> dict:
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    log_every = 10 if not quick else 2
    # The default run first: a launch in this process sets OMP_NUM_THREADS for its one rank (all the cores),
    # which two ranks of a later subprocess would inherit and oversubscribe the cores with.
    default = default_config_both_ways(workdir) if default_run and not quick else None
    small = small_model(workdir, steps, warmup, repeats, log_every)
    result = {
        "machine": machine_figures(load_before),
        "setup": {
            "small": SMALL,
            "steps": steps,
            "warmup": warmup,
            "repeats": repeats,
            "log_every": log_every,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "small": small,
        "default": default,
        "targets": {TARGET_NAME: small["speedup"] >= TARGET},
    }
    result["machine"]["load_average_1min"]["after"] = os.getloadavg()[0]
    save_result(out, "compiled_step", result, markdown(result))
    return result


def markdown(r: dict) -> str:
    ms = lambda s: f"{1000 * s:.2f} ms"  # noqa: E731
    s, small, load = r["setup"], r["small"], r["machine"]["load_average_1min"]
    c = small["compile"]
    lines = [
        f"Small FNO (width 20, 8 modes, 4 layers; batch 20 on 160 points, one input frame, one-step), one process, "
        f"{s['warmup']} warm-up + {s['steps']} timed steps, windows of {s['log_every']}, {s['repeats']} repeat(s) "
        f"alternating; {r['machine']['cpus']} CPUs, torch {r['machine']['torch']}, OMP_NUM_THREADS "
        f"{s['omp_num_threads']}; 1-minute load {load['before']:.1f} before, {load['after']:.1f} after.",
        "",
        "| step | time per step |",
        "|---|---:|",
        f"| eager | {ms(small['eager_step_s'])} |",
        f"| compiled (whole step) | {ms(small['compiled_step_s'])} |",
        "",
        f"Speed-up (median over repeats): **{small['speedup']:.2f}x**. The compiled run: {c.get('graphs')} graph(s) in "
        f"{c.get('compile_s', 0):.1f} s, {len(c.get('breaks', []))} break(s), {c.get('ops_outside_graphs')} "
        "kernel-level operation(s) per step outside compiled graphs.",
        "",
    ]
    if r.get("default"):
        d = r["default"]
        lines += [
            "configs/default.yaml on 2 ranks, from the command to the report (data and caches built before):",
            "",
            "| run | command to report | median step | test nRMSE |",
            "|---|---:|---:|---|",
        ]
        for mode in ("eager", "compiled"):
            x = d[mode]
            scores = ", ".join(f"{n} {v:.4g}" for n, v in x["test_nrmse"].items())
            lines.append(f"| {mode} | {x['command_to_report_s']:.0f} s | {ms(x['median_step_s'])} | {scores} |")
        lines.append("")
    lines += [
        "| target | met |",
        "|---|---|",
        *(f"| {n} | {'yes' if ok else '**no**'} |" for n, ok in r["targets"].items()),
    ]
    return "\n".join(lines) + "\n"
