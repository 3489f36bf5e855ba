"""Models benchmark: each built-in model, and each training objective of the time-dependent task, trained for the
same wall-clock budget, then scored on the test split, on two sets of data: configs/default.yaml's (PDEBench's
advection and Darcy) and configs/own-data.yaml's (generic arrays: the Kuramoto-Sivashinsky demo, periodic, its test
trajectories 200 steps long).

Every entry is its data's config with model.name and train.objective set (each model with its own default
settings), on 2 gloo ranks without torch.compile (--quick: one rank, the tiny config, each objective once and each
model but the local convolutional baselines once, and one entry of the own data, small). An entry first runs a
short calibration launch to measure its step time, then trains ``budget / step time`` steps (4 epochs, validated
by rollout nRMSE after each, the best checkpoint evaluated) and reports its parameters, step time, steps done, test
nRMSE per task and the rollout's nRMSE after 1, 10, 50, 100 and 200 steps. Entries run one after another: the
machine's load shows up in every entry's step time, which the table records. Per data set and task, the table
names the best entry at this equal wall time.
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
DATA = {
    "default": ("default.yaml", "tiny.yaml", []),
    "own-data": ("own-data.yaml", "own-data.yaml", ["tasks.ks.n_samples=16", "tasks.ks.resolution=32"]),
}
"""Data set -> its config, the config of --quick, and what --quick sets besides."""
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
# --quick checks the harness, not the figures: every objective and every model but the local convolutional
# baselines (conv, resnet: the harness is the same for them, and CI's time is spent) once, in three launches on one
# rank (a launch's ranks importing torch cost most of a quick entry's CPU time).
QUICK_ENTRIES = (("transformer", "one_step"), ("fno", "unrolled"), ("unet", "pushforward"))
OWN_ENTRIES = (
    ("transformer", "one_step"),
    ("fno", "one_step"),
    ("fno", "pushforward"),
    ("unet", "one_step"),
    ("conv", "one_step"),
    ("conv", "pushforward"),
    ("resnet", "one_step"),
)
"""On the own data (a 1D periodic task): every model, the FNO and the plain emulator by both objectives."""
QUICK_OWN_ENTRIES = (("fno", "one_step"),)
PLAN = {"default": (ENTRIES, QUICK_ENTRIES), "own-data": (OWN_ENTRIES, QUICK_OWN_ENTRIES)}
"""Data set -> its entries, and those of --quick."""
QUICK_RANKS = 1
CALIBRATION_STEPS, CALIBRATION_WARMUP = 30, 10
LOG_EVERY = 10  # steps per logging window, whose mean step time the metrics record
EPOCHS = 4
# What the best entry must reach on the default data (`--strict` fails otherwise).
TARGETS = {"advection1d": 0.05, "darcy2d": 0.10}
# PDEBench's published FNO nRMSE on full-size data (arXiv v7), for reference beside ours.
PUBLISHED_FNO = {"advection1d": 7.7e-3, "darcy2d": 6.4e-2}


def config(workdir: Path, data: str, model: str, objective: str, overrides: list[str], quick: bool) -> Config:
    """The entry's config: its data's config (or its quick one) with its model and objective, in the bench's
    folders."""
    full, small, smaller = DATA[data]
    return load_config(
        REPO / "configs" / (small if quick else full),
        [
            *(smaller if quick else []),
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
        run_name=f"{model}-{objective}" if data == "default" else f"{data}-{model}-{objective}",
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


def entry(workdir: Path, data: str, model: str, objective: str, budget_s: float, quick: bool) -> dict:
    """Calibrate, train for the budget, evaluate: one row of the table."""
    calibration = ["train.epochs=1", f"train.steps_per_epoch={CALIBRATION_STEPS}"]
    timing = config(workdir, data, model, objective, calibration, quick)
    folders = stage_cache(timing, stage_data(timing))  # generated once; the objective's window index per entry
    seconds = None  # quick: two steps an epoch whatever a step costs, so no calibration launch
    if not quick:
        seconds = step_time(_launch(timing, folders, "fit"), CALIBRATION_WARMUP)
    per_epoch = 2 if seconds is None else max(1, math.ceil(budget_s / seconds / EPOCHS))
    quick_log = ["train.log_every=2"] if quick else []  # windows of its few steps, for the step time
    steps = [f"train.epochs={EPOCHS}", f"train.steps_per_epoch={per_epoch}", *quick_log]
    cfg = config(workdir, data, model, objective, steps, quick)
    print(f"models benchmark: {data}, {model} {objective}, {per_epoch * EPOCHS} steps", file=sys.stderr, flush=True)
    start = time.perf_counter()
    run = _launch(cfg, folders, "fit,evaluate")
    wall = time.perf_counter() - start
    tasks = run.load_tasks(cfg)
    parameters = sum(p.numel() for p in initial_model(cfg, tasks, torch.device("cpu")).parameters())
    summary = read_summary(run.root)
    return {
        "data": data,
        "model": model,
        "objective": objective,
        "parameters": parameters,
        "step_time_s": step_time(run, CALIBRATION_WARMUP),
        "calibrated_step_time_s": seconds,
        "steps": per_epoch * EPOCHS,
        "wall_s": wall,
        "nrmse": {name: summary[name]["nrmse"] for name in cfg.tasks},
        "baseline_nrmse": {name: summary[name]["baseline_nrmse"] for name in cfg.tasks},
        "nrmse_at_step": {name: summary[name].get("nrmse_at_step", {}) for name in cfg.tasks},
    }


def run(out: Path, workdir: Path, budget_s: float, quick: bool, data: str = "both") -> dict:
    """Every entry of the data sets asked for (``PLAN``; --quick's entries with ``quick``), one after another;
    writes models.json/.md."""
    sets = list(PLAN) if data == "both" else [data]
    workdir = workdir.resolve()
    load_before = os.getloadavg()[0]
    rows = [
        entry(workdir, name, model, objective, budget_s, quick)
        for name in sets
        for model, objective in PLAN[name][1 if quick else 0]
    ]
    best = {
        name: {task: _best(rows, name, task) for task in next(r for r in rows if r["data"] == name)["nrmse"]}
        for name in sets
    }
    result = {
        "machine": machine_figures(load_before),
        "setup": {
            "configs": {name: f"configs/{DATA[name][1 if quick else 0]}" for name in sets},
            "ranks": QUICK_RANKS if quick else RANKS,
            "budget_s": budget_s,
            "epochs": EPOCHS,
            "batch_size": {
                n: t.batch_size
                for name in sets
                for n, t in config(workdir, name, "fno", "one_step", [], quick).tasks.items()
            },
        },
        "entries": rows,
        "best": best,
        "published_fno_nrmse": PUBLISHED_FNO,
        "targets": {
            f"{task} best test nRMSE <= {limit}": best.get("default", {}).get(task, {}).get("nrmse", math.inf) <= limit
            for task, limit in TARGETS.items()
            if "default" in sets
        },
    }
    save_result(out, "models", result, markdown(result))
    return result


def _best(rows: list[dict], data: str, task: str) -> dict:
    """The entry of ``data`` with the lowest test nRMSE on ``task``: its model, objective and score."""
    top = min((r for r in rows if r["data"] == data), key=lambda r: r["nrmse"][task])
    return {"model": top["model"], "objective": top["objective"], "nrmse": top["nrmse"][task]}


def markdown(r: dict) -> str:
    """Per data set: one row per entry, the trivial baseline (and PDEBench's published FNO) below them, the best
    entry per task named, and the rollout's nRMSE at fixed steps for its time-dependent tasks."""
    s, load = r["setup"], r["machine"]["load_average_1min"]
    lines = [
        f"{s['ranks']} gloo ranks, about {s['budget_s']:.0f} s of training per entry ({s['epochs']} epochs, best "
        f"validation rollout nRMSE evaluated), batch {s['batch_size']}; {r['machine']['cpus']} CPUs, torch "
        f"{r['machine']['torch']}; 1-minute load average {load['before']:.1f} before, {load['after']:.1f} after."
    ]
    for data, config_path in s["configs"].items():
        entries = [e for e in r["entries"] if e["data"] == data]
        tasks = list(entries[0]["nrmse"])
        header = ["model", "objective", "parameters", "step time", "steps", *(f"{t} nRMSE" for t in tasks)]
        lines += ["", f"{config_path}:", "", "| " + " | ".join(header) + " |"]
        lines.append("|---|---|---:|---:|---:|" + "---:|" * len(tasks))
        for e in entries:
            scores = " | ".join(f"{e['nrmse'][t]:.4f}" for t in tasks)
            lines.append(
                f"| {e['model']} | {e['objective']} | {e['parameters']:,} | {1000 * e['step_time_s']:.0f} ms | "
                f"{e['steps']} | {scores} |"
            )
        baseline = entries[0]["baseline_nrmse"]
        lines.append(f"| trivial baseline | | | | | {' | '.join(f'{baseline[t]:.4f}' for t in tasks)} |")
        if data == "default":
            published = " | ".join(f"{r['published_fno_nrmse'].get(t, math.nan):.4f}" for t in tasks)
            lines.append(f"| PDEBench FNO, published | one_step | | | 500 epochs | {published} |")
        named = [f"{t}: {b['model']} {b['objective']} ({b['nrmse']:.4f})" for t, b in r["best"][data].items()]
        lines += ["", "Best at equal wall time: " + "; ".join(named) + "."]
        lines += _horizons(entries)
    lines += [
        "",
        "| target | met |",
        "|---|---|",
        *(f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in r["targets"].items()),
    ]
    return "\n".join(lines) + "\n"


def _horizons(entries: list[dict]) -> list[str]:
    """The rollout's nRMSE after 1, 10, 50, 100 ... steps, per time-dependent task, one row per entry."""
    lines = []
    for task in entries[0]["nrmse_at_step"]:
        steps = sorted((k for k in entries[0]["nrmse_at_step"][task] if k != "last"), key=int)
        if not steps:
            continue
        lines += ["", f"{task}: nRMSE after so many rollout steps", ""]
        lines += ["| model | objective | " + " | ".join(steps) + " |", "|---|---|" + "---:|" * len(steps)]
        for e in entries:
            at = e["nrmse_at_step"][task]
            lines.append(f"| {e['model']} | {e['objective']} | " + " | ".join(f"{at[k]:.4f}" for k in steps) + " |")
    return lines
