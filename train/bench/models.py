"""Models benchmark: each built-in model, and each training objective of the time-dependent task, trained on the
default data for the same wall-clock budget, then scored on the test split.

Every entry is configs/default.yaml with model.name and train.objective set (each model with its own default
settings), on 2 gloo ranks without torch.compile (--quick: one rank, each objective once and each model but the
local convolutional baselines, conv and resnet, once). An entry first runs a short calibration launch to measure
its step time, then trains ``budget / step time`` steps (4 epochs, validated by rollout nRMSE after each, the best
checkpoint evaluated) and reports its parameters, step time, steps done and test nRMSE per task. Entries run one
after another: the machine's load shows up in every entry's step time, which the table records.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from train import run_files
from train.bench import machine_figures, save_result
from train.config import Config, load_config
from train.data.acquire.sources import stage_data
from train.engine.loaders import initial_model
from train.launch.torchrun import launch
from train.obs.report import read_summary
from train.obs.sinks import read_metrics
from train.pipeline import stage_cache
from train.run_dir import RunDir

REPO = Path(__file__).resolve().parents[2]
RANKS = 2
ENTRIES = (
    ("transformer", "one_step"),
    ("fno", "one_step"),
    ("fno", "pushforward"),
    ("fno", "unrolled"),
    ("unet", "one_step"),
    ("unet", "pushforward"),
    ("conv", "one_step"),
    ("conv", "pushforward"),
    ("resnet", "one_step"),
    ("resnet", "pushforward"),
)
# --quick checks the harness, not the figures: every objective once and every model but the local convolutional
# baselines (conv, resnet: the harness is the same for them, and CI's time is spent), on one rank (each entry is a
# launch, and a launch's ranks importing torch cost most of a quick entry's CPU time).
QUICK_ENTRIES = (("transformer", "one_step"), ("fno", "pushforward"), ("fno", "unrolled"), ("unet", "one_step"))
QUICK_RANKS = 1
CALIBRATION_STEPS, CALIBRATION_WARMUP = 30, 10
LOG_EVERY = 10  # steps per logging window, whose mean step time the metrics record
EPOCHS = 4
# What the best entry must reach on the default data (`--strict` fails otherwise).
TARGETS = {"advection1d": 0.05, "darcy2d": 0.10}
# PDEBench's published FNO nRMSE on full-size data (arXiv v7), for reference beside ours.
PUBLISHED_FNO = {"advection1d": 7.7e-3, "darcy2d": 6.4e-2}


def config(workdir: Path, model: str, objective: str, overrides: list[str], quick: bool) -> Config:
    """The entry's config: the default (or tiny) config with its model and objective, in the bench's folders."""
    path = REPO / "configs" / ("tiny.yaml" if quick else "default.yaml")
    return load_config(
        path,
        [
            f"model.name={model}",
            f"train.objective={objective}",
            "train.rollout_steps=3" if quick else "train.rollout_steps=4",
            "compile.enabled=false",
            "dist.backend=gloo",
            f"dist.nproc={QUICK_RANKS if quick else RANKS}",
            "train.checkpoint_every=null",
            "train.val_every=null",
            f"train.log_every={LOG_EVERY}",
            f"run.data_dir={workdir / 'models-data'}",
            f"run.cache_dir={workdir / 'models-cache'}",
            f"run.runs_dir={workdir / 'models-runs'}",
            *overrides,
        ],
        run_name=f"{model}-{objective}",
    )


def _launch(cfg: Config, folders: dict, stages: str) -> RunDir:
    run = RunDir.of(cfg)
    shutil.rmtree(run.root, ignore_errors=True)  # nothing of an earlier bench carries over
    run.prepare(cfg)
    run.write_inputs(folders)
    launch(run, int(cfg.dist.nproc), cfg, ["--stages", stages], module="train.worker")
    return run


def step_time(run: RunDir, after: int) -> float:
    """Median step time of rank 0's logging windows that start after step ``after``."""
    windows = [r for r in read_metrics(run.root / run_files.METRICS) if "step_time_s" in r]
    steady = [r["step_time_s"] for r in windows if r["step"] - LOG_EVERY >= after] or [
        r["step_time_s"] for r in windows
    ]
    if not steady:
        raise RuntimeError(f"no step time in {run.root / 'metrics.jsonl'}")
    return statistics.median(steady)


def entry(workdir: Path, model: str, objective: str, budget_s: float, quick: bool) -> dict:
    """Calibrate, train for the budget, evaluate: one row of the table."""
    timing = config(workdir, model, objective, ["train.epochs=1", f"train.steps_per_epoch={CALIBRATION_STEPS}"], quick)
    folders = stage_cache(timing, stage_data(timing))  # generated once; the objective's window index per entry
    seconds = None  # quick: two steps an epoch whatever a step costs, so no calibration launch
    if not quick:
        seconds = step_time(_launch(timing, folders, "fit"), CALIBRATION_WARMUP)
    per_epoch = 2 if seconds is None else max(1, math.ceil(budget_s / seconds / EPOCHS))
    quick_log = ["train.log_every=2"] if quick else []  # windows of its few steps, for the step time
    steps = [f"train.epochs={EPOCHS}", f"train.steps_per_epoch={per_epoch}", *quick_log]
    cfg = config(workdir, model, objective, steps, quick)
    print(f"models benchmark: {model} {objective}, {per_epoch * EPOCHS} steps", file=sys.stderr, flush=True)
    start = time.perf_counter()
    run = _launch(cfg, folders, "fit,evaluate")
    wall = time.perf_counter() - start
    tasks = run.load_tasks(cfg)
    parameters = sum(p.numel() for p in initial_model(cfg, tasks, torch.device("cpu")).parameters())
    summary = read_summary(run.root)
    return {
        "model": model,
        "objective": objective,
        "parameters": parameters,
        "step_time_s": step_time(run, CALIBRATION_WARMUP),
        "calibrated_step_time_s": seconds,
        "steps": per_epoch * EPOCHS,
        "wall_s": wall,
        "nrmse": {name: summary[name]["nrmse"] for name in cfg.tasks},
        "baseline_nrmse": {name: summary[name]["baseline_nrmse"] for name in cfg.tasks},
    }


def run(out: Path, workdir: Path, budget_s: float, quick: bool, entries=None) -> dict:
    """Every entry in turn (``ENTRIES``, or ``QUICK_ENTRIES`` with ``quick``); writes models.json/.md."""
    entries = entries or (QUICK_ENTRIES if quick else ENTRIES)
    workdir = workdir.resolve()
    first = config(workdir, *entries[0], [], quick)
    load_before = os.getloadavg()[0]
    rows = [entry(workdir, model, objective, budget_s, quick) for model, objective in entries]
    best = {task: min(r["nrmse"][task] for r in rows) for task in rows[0]["nrmse"]}
    result = {
        "machine": machine_figures(load_before),
        "setup": {
            "config": f"configs/{'tiny' if quick else 'default'}.yaml",
            "ranks": QUICK_RANKS if quick else RANKS,
            "budget_s": budget_s,
            "epochs": EPOCHS,
            "batch_size": {n: t.batch_size for n, t in first.tasks.items()},
        },
        "entries": rows,
        "published_fno_nrmse": PUBLISHED_FNO,
        "targets": {
            f"{task} best test nRMSE <= {limit}": best.get(task, math.inf) <= limit for task, limit in TARGETS.items()
        },
    }
    save_result(out, "models", result, markdown(result))
    return result


def markdown(r: dict) -> str:
    """The table: one row per entry, PDEBench's published FNO below it."""
    tasks = list(r["entries"][0]["nrmse"])
    s, load = r["setup"], r["machine"]["load_average_1min"]
    header = ["model", "objective", "parameters", "step time", "steps", *(f"{t} nRMSE" for t in tasks)]
    lines = [
        f"{s['config']}, {s['ranks']} gloo ranks, about {s['budget_s']:.0f} s of training per entry ({s['epochs']} "
        f"epochs, best validation rollout nRMSE evaluated), batch {s['batch_size']}; {r['machine']['cpus']} CPUs, "
        f"torch {r['machine']['torch']}; 1-minute load average {load['before']:.1f} before, {load['after']:.1f} "
        "after.",
        "",
        "| " + " | ".join(header) + " |",
        "|---|---|---:|---:|---:|" + "---:|" * len(tasks),
    ]
    for e in r["entries"]:
        scores = " | ".join(f"{e['nrmse'][t]:.4f}" for t in tasks)
        lines.append(
            f"| {e['model']} | {e['objective']} | {e['parameters']:,} | {1000 * e['step_time_s']:.0f} ms | "
            f"{e['steps']} | {scores} |"
        )
    baseline = r["entries"][0]["baseline_nrmse"]
    lines.append(f"| trivial baseline | | | | | {' | '.join(f'{baseline[t]:.4f}' for t in tasks)} |")
    published = " | ".join(f"{r['published_fno_nrmse'][t]:.4f}" if t in r["published_fno_nrmse"] else "" for t in tasks)
    lines += [
        f"| PDEBench FNO, published | one_step | | | 500 epochs | {published} |",
        "",
        "| target | met |",
        "|---|---|",
        *(f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in r["targets"].items()),
    ]
    return "\n".join(lines) + "\n"
