"""Sweep benchmark: an 8-trial search over the FNO's width, modes and learning rate on the default data, each
trial about 60 s of training, against the default config trained alone at the same budget.

Every run is `python -m train` on 2 ranks with configs/default.yaml (both tasks, FNO, pushforward) cut to 3
epochs of 60 steps, validated by rollout nRMSE after each epoch:

1. the default config alone (``python -m train run``), timed;
2. ``python -m train sweep`` with configs/sweeps/fno.yaml (TPE, median pruning), timed; each trial is the same
   run with its own width, modes and learning rate.

It reports every trial (parameters, validation nRMSE, test nRMSE from its report, steps, state, time), the best
trial's test nRMSE against the default's, and the sweep's wall time against the sum of its trials' and against 8
times the default run: the first difference is the machinery's own cost. Target: the best trial scores at most
the default's validation nRMSE (the default is one point of the space).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from train.bench import machine_figures, save_result
from train.errors import TrainError
from train.obs.report import read_summary

REPO = Path(__file__).resolve().parents[2]
SPACE = REPO / "configs" / "sweeps" / "fno.yaml"
BUDGET = ["train.epochs=3", "train.steps_per_epoch=60", "train.warmup_steps=15"]
QUICK = {"config": "tiny.yaml", "budget": ["model.name=fno", "train.epochs=2"], "trials": 2}


def _cli(*args: str) -> float:
    """Run ``python -m train ARGS``; its wall time."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise TrainError(f"python -m train {' '.join(args[:3])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def _mean_test_nrmse(run: Path) -> float:
    summary = read_summary(run)
    return sum(r["nrmse"] for r in summary.values()) / len(summary)


def run(out: Path, workdir: Path, quick: bool = False) -> dict:
    load_before = os.getloadavg()[0]
    root = workdir / "sweep"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config = str(REPO / "configs" / (QUICK["config"] if quick else "default.yaml"))
    budget = QUICK["budget"] if quick else BUDGET
    spec = yaml.safe_load(SPACE.read_text())
    if quick:
        spec["trials"] = QUICK["trials"]
    n_trials = spec["trials"]
    sets = [a for o in [*budget, *(f"run.{k}_dir={root / k}" for k in ("data", "cache", "runs"))] for a in ("--set", o)]
    _cli("cache", "--config", config, *sets)  # the data exist before either timing starts
    default_s = _cli("run", "--config", config, "--nproc", "2", "--run", "default", *sets)
    space = root / "space.yaml"
    space.write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep_s = _cli("sweep", "--config", config, "--space", str(space), "--name", "fno", *sets)

    from train.sweep.space import read_spec
    from train.sweep.study import SweepStudy

    study = SweepStudy(root / "runs" / "fno", "fno", read_spec(space))
    rows = []
    for t in sorted(study.trials(), key=lambda t: t.number):
        run_dir = root / "runs" / "fno" / f"trial-{t.number:03d}"
        finished = t.state.name == "COMPLETE"
        rows.append(
            {
                "trial": t.number,
                "params": t.params,
                "state": t.state.name.lower(),
                "val_nrmse": t.value if finished else t.user_attrs.get("pruned_score"),
                "test_nrmse": _mean_test_nrmse(run_dir) if finished else None,
                "steps": t.user_attrs.get("steps"),
                "seconds": t.user_attrs.get("seconds"),
            }
        )
    default_val = min(
        r["val_nrmse"] for r in _validations(root / "runs" / "default" / "metrics.jsonl")
    )  # the default run's best validation, as a trial is scored
    best = min((r for r in rows if r["state"] == "complete"), key=lambda r: r["val_nrmse"])
    trial_s = sum(r["seconds"] or 0 for r in rows)
    result = {
        "trials": rows,
        "best": best,
        "default": {
            "val_nrmse": default_val,
            "test_nrmse": _mean_test_nrmse(root / "runs" / "default"),
            "wall_s": default_s,
            "per_task": read_summary(root / "runs" / "default"),
        },
        "best_per_task": read_summary(root / "runs" / "fno" / f"trial-{best['trial']:03d}"),
        "sweep_wall_s": sweep_s,
        "trials_wall_s": trial_s,
        "machine": machine_figures(load_before),
        "targets": {"the best trial's validation nRMSE is at most the default's": best["val_nrmse"] <= default_val},
    }
    save_result(out, "sweep", result, _markdown(result, n_trials, load_before))
    return result


def _validations(metrics: Path) -> list[dict]:
    from train.obs.sinks import read_metrics

    return [r for r in read_metrics(metrics) if "val_nrmse" in r]


def _markdown(r: dict, n_trials: int, load_before: float) -> str:
    def fmt(x):
        return "" if x is None else f"{x:.4g}"

    lines = [
        f"# Sweep: {n_trials} trials over the FNO's width, modes and learning rate",
        "",
        "| trial | width | modes | lr | val nRMSE | test nRMSE (mean of tasks) | steps | state | time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["trials"]:
        p = row["params"]
        lines.append(
            f"| {row['trial']} | {p['model.fno.width']} | {p['model.fno.modes']} | {p['train.lr']:.2g} | "
            f"{fmt(row['val_nrmse'])} | {fmt(row['test_nrmse'])} | {row['steps']} | {row['state']} | "
            f"{fmt(row['seconds'])} s |"
        )
    d, b = r["default"], r["best"]
    tasks = sorted(d["per_task"])
    lines += [
        "",
        "| | " + " | ".join(f"{t} test nRMSE" for t in tasks) + " | val nRMSE |",
        "|---|" + "---|" * (len(tasks) + 1),
        "| default config (width 20, modes 12, lr 1e-3) | "
        + " | ".join(f"{d['per_task'][t]['nrmse']:.4g}" for t in tasks)
        + f" | {d['val_nrmse']:.4g} |",
        f"| best trial ({b['trial']}) | "
        + " | ".join(f"{r['best_per_task'][t]['nrmse']:.4g}" for t in tasks)
        + f" | {b['val_nrmse']:.4g} |",
        "",
        f"Sweep wall time {r['sweep_wall_s']:.0f} s; its trials' own time {r['trials_wall_s']:.0f} s (the machinery: "
        f"{r['sweep_wall_s'] - r['trials_wall_s']:.0f} s); {n_trials} x the default run alone: "
        f"{n_trials * d['wall_s']:.0f} s ({d['wall_s']:.0f} s each).",
        "",
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} before; reproduce with `make bench BENCH_ARGS=sweep`.",
        "",
    ]
    return "\n".join(lines)
