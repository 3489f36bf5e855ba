"""Pretraining benchmark: one multi-physics model trained on configs/pretrain.yaml's ten datasets (1D, 2D and
3D; PDEBench's, The Well's, neuraloperator's, the FNO paper's and PDEArena's formats) against single-task models, then
fine-tuned onto the held-out dataset of configs/finetune-riemann1d.yaml against training from scratch.

Every run is `python -m train run` on 2 ranks (1 in --quick):

1. pretrain: the recipe as it is (each rank draws one dataset per step);
2. for each dataset of the mix, a single-task model: the same model settings and the same total steps, on that
   dataset alone (so it sees about ten times more of its own data than the pretrained model did);
3. for each budget of ``BUDGETS`` steps, two runs on the held-out dataset with one epoch of that many steps
   (warm-up a sixth of it): fine-tuned (``train.init_from`` the pretrained run, at the fine-tuning recipe's
   learning rates) and from scratch (at the pretraining recipe's, the one a fresh model is trained with).

It reports each dataset's test nRMSE after pretraining and alone, and the held-out dataset's test nRMSE against
steps for both starts. Target: fine-tuning reaches the from-scratch model's final error (at the largest budget)
in at most a third of its steps.
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
from train.obs.report import read_summary, summary_score

REPO = Path(__file__).resolve().parents[2]
RECIPE, FINETUNE = "pretrain.yaml", "finetune-riemann1d.yaml"
BUDGETS = (50, 150, 300, 900)
RANKS = 2
QUICK = {
    "tasks": ("advection", "flow3d", "gray_scott"),
    "train": {"epochs": 1, "steps_per_epoch": 6, "warmup_steps": 2},
    "data": {"n_samples": 24},
    "budgets": (3,),
    "ranks": 1,  # its six launches: a rank fewer in each saves a torch import, and --quick checks wiring, not scale
}


def _load(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


def _write(cfg: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _quick(cfg: dict) -> dict:
    """A few small datasets of the mix, for --quick."""
    tasks = {n: t for n, t in cfg["tasks"].items() if n in QUICK["tasks"] or n not in _load(RECIPE)["tasks"]}
    for task in tasks.values():
        if "n_samples" in task:
            task.update(QUICK["data"], batch_size=min(task["batch_size"], 4))
    return {**cfg, "tasks": tasks, "train": {**cfg["train"], **QUICK["train"]}}


def _cli(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise TrainError(f"python -m train {' '.join(args[:4])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def run(out: Path, workdir: Path, quick: bool = False) -> dict:
    load_before = os.getloadavg()[0]
    root = workdir / "pretrain"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    recipe, target = _load(RECIPE), _load(FINETUNE)
    if quick:
        recipe, target = _quick(recipe), _quick(target)
    folders = [a for key in ("data", "cache", "runs") for a in ("--set", f"run.{key}_dir={root / key}")]
    ranks = QUICK["ranks"] if quick else RANKS
    walls: dict[str, float] = {}

    def train(name: str, cfg: dict, *extra: str) -> dict:
        began = time.perf_counter()
        config = _write(cfg, root / f"{name}.yaml")
        _cli("run", "--config", str(config), "--nproc", str(ranks), "--run", name, *folders, *extra)
        walls[name] = time.perf_counter() - began
        return read_summary(root / "runs" / name)

    pretrained = train("pretrain", recipe)
    steps = recipe["train"]["epochs"] * recipe["train"]["steps_per_epoch"]
    alone = {}
    for task in recipe["tasks"]:
        single = {**recipe, "tasks": {task: recipe["tasks"][task]}, "train": {**recipe["train"], "held_out": []}}
        alone[task] = train(f"alone-{task}", single)[task]
    held_out = next(iter(target["tasks"]))
    budgets = QUICK["budgets"] if quick else BUDGETS
    curves: dict[str, dict[int, float]] = {"fine-tuned": {}, "scratch": {}}
    for budget in budgets:
        schedule = {"epochs": 1, "steps_per_epoch": budget, "warmup_steps": max(1, budget // 6)}
        for start in curves:
            if start == "fine-tuned":
                how = {"init_from": str(root / "runs" / "pretrain")}
            else:  # a fresh model: the pretraining recipe's rate, every parameter alike
                how = {"lr": recipe["train"]["lr"]}
            recipe_only = ("init_from", "lr_groups", "init_reset") if start == "scratch" else ("init_from",)
            own = {k: v for k, v in target["train"].items() if k not in recipe_only}
            cfg = {**target, "train": {**own, **schedule, **how}}
            curves[start][budget] = train(f"{start}-{budget}", cfg)[held_out]["nrmse"]
    final = curves["scratch"][budgets[-1]]
    reached = [b for b in budgets if curves["fine-tuned"][b] <= final]
    pre, single = summary_score(pretrained), summary_score(alone)
    result = {
        "steps": steps,
        "pretrained": {task: r["nrmse"] for task, r in pretrained.items()},
        "alone": {task: r["nrmse"] for task, r in alone.items()},
        "baseline": {task: r["baseline_nrmse"] for task, r in pretrained.items()},
        "summary": {"pretrained": pre, "alone": single},
        "held_out": held_out,
        "curves": curves,
        "fine_tuned_reaches_scratch_final_at": reached[0] if reached else None,
        "wall_s": walls,
        "machine": machine_figures(load_before),
        "targets": {
            "fine-tuning reaches the from-scratch final error in at most a third of its steps": bool(
                reached and reached[0] * 3 <= budgets[-1]
            )
        },
    }
    save_result(out, "pretrain", result, _markdown(result, recipe, budgets, load_before))
    return result


def _markdown(result: dict, recipe: dict, budgets: tuple[int, ...], load_before: float) -> str:
    rows = []
    for task, cfg in recipe["tasks"].items():
        a, b = result["pretrained"][task], result["alone"][task]
        rows.append(f"| {task} | {cfg['pde']} | {a:.4g} | {b:.4g} | {a / b:.2f} | {result['baseline'][task]:.4g} |")
    curve = [
        f"| {b} | {result['curves']['fine-tuned'][b]:.4g} | {result['curves']['scratch'][b]:.4g} |" for b in budgets
    ]
    pre, alone = result["summary"]["pretrained"], result["summary"]["alone"]
    reached = result["fine_tuned_reaches_scratch_final_at"]
    walls = result["wall_s"]
    return "\n".join(
        [
            "# Pretraining on many datasets",
            "",
            f"One multi-physics model trained {result['steps']} steps on {len(rows)} datasets at once (each rank draws "
            f"one per step) against a model of the same settings trained {result['steps']} steps on each dataset "
            "alone; test nRMSE (rollouts over the whole test trajectories for the time-dependent datasets).",
            "",
            "| dataset | pde | pretrained on the mix | alone | mix / alone | baseline |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Geometric mean of nRMSE / baseline: {pre['nrmse_to_baseline']:.3g} pretrained, "
            f"{alone['nrmse_to_baseline']:.3g} alone. Wall: {walls['pretrain']:.0f} s for the mix, "
            f"{sum(v for k, v in walls.items() if k.startswith('alone-')):.0f} s for the {len(rows)} single models.",
            "",
            f"## Fine-tuning onto {result['held_out']}, held out of the mix",
            "",
            "| steps | fine-tuned from the mix: test nRMSE | from scratch: test nRMSE |",
            "|---|---|---|",
            *curve,
            "",
            (
                f"Fine-tuning reaches the from-scratch model's final error ({budgets[-1]} steps) in {reached} steps."
                if reached
                else f"Fine-tuning does not reach the from-scratch model's final error in {budgets[-1]} steps."
            ),
            "",
            f"{os.cpu_count()} CPUs, load average {load_before:.1f} before; reproduce with "
            "`make bench BENCH_ARGS=pretrain`.",
            "",
        ]
    )
