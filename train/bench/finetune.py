"""Fine-tuning benchmark: the default advection model (beta 0.1) fine-tuned on advection with beta 0.4, against
the same model trained on beta 0.4 from scratch, for the same number of steps, at several step budgets.

Every run is `python -m train run` on 2 ranks, configs/default.yaml with its advection1d task only (the FNO,
pushforward training):

1. base: beta 0.1, the default's 6 epochs of 150 steps;
2. for each budget of ``BUDGETS`` steps, two runs on beta 0.4 with one epoch of that many steps (warm-up a
   sixth of it): fine-tuned (``train.init_from`` the base run: its weights, a new optimizer and schedule) and
   from scratch (a fresh initialisation).

It reports each run's test nRMSE (the beta 0.4 test split for the pairs), and the base model's nRMSE on every
beta 0.4 trajectory before any fine-tuning (`python -m train predict`), which says how far apart the two
coefficients are for the model. Target: fine-tuning ends at least as low as training from scratch at the
smallest budget, where a start matters most.
"""

from __future__ import annotations

import json
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
from train.use.predict import scores_path

REPO = Path(__file__).resolve().parents[2]
TASK = "advection1d"
SOURCE_BETA, TARGET_BETA = 0.1, 0.4
BUDGETS = (50, 150, 300)
QUICK = {"config": "tiny.yaml", "overrides": ["train.epochs=2", "train.steps_per_epoch=10"], "budgets": (10,)}


def _config(workdir: Path, quick: bool) -> Path:
    """The default config with its advection task only."""
    cfg = yaml.safe_load((REPO / "configs" / (QUICK["config"] if quick else "default.yaml")).read_text())
    cfg["tasks"] = {TASK: cfg["tasks"][TASK]}
    path = workdir / "finetune.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise TrainError(f"python -m train {' '.join(args[:3])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def run(out: Path, workdir: Path, quick: bool = False) -> dict:
    load_before = os.getloadavg()[0]
    root = workdir / "finetune"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config = _config(root, quick)
    folders = [a for key in ("data", "cache", "runs") for a in ("--set", f"run.{key}_dir={root / key}")]
    sets = [a for o in (QUICK["overrides"] if quick else []) for a in ("--set", o)]
    base = ["--set", f"tasks.{TASK}.coefficient={SOURCE_BETA}"]
    runs = {"base": base}
    budgets = QUICK["budgets"] if quick else BUDGETS
    for budget in budgets:
        target = [
            "--set",
            f"tasks.{TASK}.coefficient={TARGET_BETA}",
            "--set",
            "train.epochs=1",
            "--set",
            f"train.steps_per_epoch={budget}",
            "--set",
            f"train.warmup_steps={budget // 6}",
        ]
        runs[f"fine-tuned {budget}"] = [*target, "--set", f"train.init_from={root / 'runs' / 'base'}"]
        runs[f"scratch {budget}"] = target
    results, walls = {}, {}
    for name, extra in runs.items():
        start = time.perf_counter()
        run_name = name.replace(" ", "-")
        _cli("run", "--config", str(config), "--nproc", "2", "--run", run_name, *folders, *sets, *extra)
        walls[name] = time.perf_counter() - start
        results[name] = read_summary(root / "runs" / run_name)[TASK]["nrmse"]
    target_file = next((root / "data" / TASK).glob(f"*beta{TARGET_BETA}*.hdf5"))
    predicted = root / "zero-shot.h5"
    _cli("predict", "--run", str(root / "runs" / "base"), "--input", str(target_file), "--output", str(predicted))
    zero_shot = json.loads(scores_path(predicted).read_text())[TASK]["nrmse"]
    smallest = budgets[0]
    better = results[f"fine-tuned {smallest}"] <= results[f"scratch {smallest}"]
    result = {
        "task": TASK,
        "test_nrmse": results,
        "base_on_target_nrmse": zero_shot,
        "wall_s": walls,
        "machine": machine_figures(load_before),
        "targets": {f"fine-tuning ends at least as low as training from scratch in {smallest} steps": better},
    }
    rows = [
        f"| {budget} | {results[f'fine-tuned {budget}']:.4g} | {results[f'scratch {budget}']:.4g} | "
        f"{walls[f'fine-tuned {budget}']:.0f} s, {walls[f'scratch {budget}']:.0f} s |"
        for budget in budgets
    ]
    markdown = "\n".join(
        [
            f"# Fine-tuning: {TASK} beta {SOURCE_BETA} -> beta {TARGET_BETA}",
            "",
            f"The base model (beta {SOURCE_BETA}, the default's training): test nRMSE {results['base']:.4g}; on every "
            f"beta {TARGET_BETA} trajectory, before fine-tuning: {zero_shot:.4g}.",
            "",
            f"| steps on beta {TARGET_BETA} | fine-tuned from the base: test nRMSE | from scratch: test nRMSE | wall |",
            "|---|---|---|---|",
            *rows,
            "",
            f"{os.cpu_count()} CPUs, load average {load_before:.1f} before; reproduce with "
            "`make bench BENCH_ARGS=finetune`.",
            "",
        ]
    )
    save_result(out, "finetune", result, markdown)
    return result
