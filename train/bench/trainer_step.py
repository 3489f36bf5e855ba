"""Trainer benchmark: steady-state step time of our trainer against a bare, hand-written DDP loop.

Both run the same model, batches, optimizer, schedule, loss and clipping (see train/bench/bare_ddp.py) on
2 gloo ranks launched by torchrun, without torch.compile, alternately (ours, bare, ours, bare, ...) so that
the machine's noise hits both. Per loop:
- step time: the median over logging windows after warmup of the window's mean step time (the trainer's
  ``step_time_s`` records; the bare loop's per-step timings cut into windows of the same length);
- data wait: the fraction of those windows the trainer spent fetching batches;
- launch to first step: from the launcher starting torchrun to rank 0's first finished optimizer step.
The ratio ours/bare is taken per repeat, and its median reported.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from train import run_files
from train.bench import machine_figures, save_result
from train.config import Config, load_config
from train.data.acquire.sources import stage_data
from train.launch.torchrun import launch
from train.obs.sinks import read_metrics
from train.pipeline import stage_cache
from train.run_dir import RunDir

REPO = Path(__file__).resolve().parents[2]
RANKS = 2
TARGET = 1.05
TARGET_NAME = f"step time ratio <= {TARGET}"


def config(workdir: Path, name: str, steps: int, warmup: int, log_every: int, quick: bool) -> tuple[Config, list]:
    """The benchmark's config (configs/default.yaml, or tiny.yaml with ``quick``) for run ``name``; also returns
    the overrides applied to the file."""
    overrides = [
        "compile.enabled=false",
        "dist.backend=gloo",
        f"dist.nproc={RANKS}",
        "train.epochs=1",
        f"train.steps_per_epoch={warmup + steps}",
        f"train.log_every={log_every}",
        "train.checkpoint_every=null",  # the only checkpoint is the one at the end, after the last window
        "train.val_every=null",
    ]
    if not quick:  # the transformer, one step at a time: the least work per step, where overhead shows most
        overrides += [
            "model.name=transformer",
            "model.transformer.d_model=96",
            "model.transformer.n_heads=4",
            "model.transformer.n_layers=3",
            "tasks.darcy2d.batch_size=16",
            "train.objective=one_step",
        ]
    folders = [
        f"run.data_dir={workdir / 'trainer-data'}",
        f"run.cache_dir={workdir / 'trainer-cache'}",
        f"run.runs_dir={workdir / 'trainer-runs'}",
    ]
    path = REPO / "configs" / ("tiny.yaml" if quick else "default.yaml")
    return load_config(path, [*overrides, *folders], run_name=name), overrides


def prepare(cfg: Config, folders: dict) -> RunDir:
    """A fresh run folder for ``cfg``: nothing of an earlier repeat (checkpoints, metrics) carries over."""
    run = RunDir.of(cfg)
    shutil.rmtree(run.root, ignore_errors=True)
    run.prepare(cfg)
    run.write_inputs(folders)
    return run


def ours(cfg: Config, folders: dict, warmup: int) -> dict:
    """One launch of the trainer; its figures from rank 0's metrics records."""
    run = prepare(cfg, folders)
    launch(run, RANKS, cfg, ["--stages", "fit"], module="train.worker")
    records = read_metrics(run.root / run_files.METRICS)
    windows = [r for r in records if "step_time_s" in r]
    # A record at step s covers the log_every steps up to s: keep the windows that start after warmup.
    steady = [r for r in windows if r["step"] - cfg.train.log_every >= warmup]
    if not steady:
        raise RuntimeError(f"no metrics window after {warmup} warmup steps in {run.root / 'metrics.jsonl'}")
    return {
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "data_wait": statistics.fmean(r["data_wait"] for r in steady),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
        "launch_to_first_step_s": windows[0].get("launch_to_first_step_s"),
        "windows": len(steady),
    }


def bare(cfg: Config, folders: dict, steps: int, warmup: int) -> dict:
    """One launch of the hand-written loop; rank 0 writes its figures."""
    run = prepare(cfg, folders)
    out = run.root / "bare.json"
    args = ["--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    launch(run, RANKS, cfg, args, module="train.bench.bare_ddp")
    return json.loads(out.read_text())


def run(out: Path, workdir: Path, steps: int, warmup: int, repeats: int, quick: bool, log_every: int = 10) -> dict:
    """Prepare data and caches, run both loops ``repeats`` times alternately, write trainer_step.json/.md."""
    if warmup % log_every:
        raise ValueError(f"warmup ({warmup}) must be a multiple of log_every ({log_every}): windows start after it")
    workdir = workdir.resolve()
    cfg_ours, overrides = config(workdir, "bench-ours", steps, warmup, log_every, quick)
    cfg_bare, _ = config(workdir, "bench-bare", steps, warmup, log_every, quick)
    folders = stage_cache(cfg_ours, stage_data(cfg_ours))
    load_before = os.getloadavg()[0]
    results = []
    for i in range(repeats):
        print(f"trainer benchmark: repeat {i + 1}/{repeats}, our trainer", file=sys.stderr, flush=True)
        a = ours(cfg_ours, folders, warmup)
        print(f"trainer benchmark: repeat {i + 1}/{repeats}, bare DDP loop", file=sys.stderr, flush=True)
        b = bare(cfg_bare, folders, steps, warmup)
        results.append({"ours": a, "bare": b, "ratio": a["step_time_s"] / b["step_time_s"]})
    median = lambda key, loop: statistics.median(r[loop][key] for r in results)  # noqa: E731
    ratio = statistics.median(r["ratio"] for r in results)
    bare_launch = [r["bare"]["launch_to_first_step_s"] for r in results]
    result = {
        "machine": machine_figures(load_before),
        "setup": {
            "config": f"configs/{'tiny' if quick else 'default'}.yaml",
            "overrides": overrides,
            "ranks": RANKS,
            "steps": steps,
            "warmup": warmup,
            "log_every": log_every,
            "repeats": repeats,
            "batch_size": {n: t.batch_size for n, t in cfg_ours.tasks.items()},
            "model": cfg_ours.model.model_dump(mode="json"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "ours": {
            "step_time_s": median("step_time_s", "ours"),
            "data_wait": median("data_wait", "ours"),
            "samples_per_s": median("samples_per_s", "ours"),
            "launch_to_first_step_s": median("launch_to_first_step_s", "ours"),
        },
        "bare": {
            "step_time_s": median("step_time_s", "bare"),
            "median_step_s": median("median_step_s", "bare"),
            "launch_to_first_step_s": statistics.median(bare_launch) if None not in bare_launch else None,
        },
        "ratio": ratio,
        "repeats": results,
        "targets": {TARGET_NAME: ratio <= TARGET},
    }
    save_result(out, "trainer_step", result, markdown(result))
    return result


def markdown(r: dict) -> str:
    """The figures as a short report: medians over repeats, then each repeat."""
    ms = lambda s: f"{1000 * s:.2f} ms"  # noqa: E731
    sec = lambda s: "n/a" if s is None else f"{s:.1f} s"  # noqa: E731
    o, b, s, load = r["ours"], r["bare"], r["setup"], r["machine"]["load_average_1min"]
    rows = [
        "| loop | step time | launch to first step | data wait |",
        "|---|---:|---:|---:|",
        f"| our trainer | {ms(o['step_time_s'])} | {sec(o['launch_to_first_step_s'])} | {100 * o['data_wait']:.1f}% |",
        f"| bare DDP loop | {ms(b['step_time_s'])} | {sec(b['launch_to_first_step_s'])} | |",
    ]
    per_repeat = ["| repeat | ours | bare | ratio |", "|---:|---:|---:|---:|"]
    for i, x in enumerate(r["repeats"], 1):
        per_repeat.append(
            f"| {i} | {ms(x['ours']['step_time_s'])} | {ms(x['bare']['step_time_s'])} | {x['ratio']:.3f} |"
        )
    lines = [
        f"{s['config']} ({', '.join(s['overrides'])}); batch {s['batch_size']}, {s['ranks']} gloo ranks, "
        f"{s['warmup']} warmup + {s['steps']} timed steps, windows of {s['log_every']} steps, {s['repeats']} "
        f"repeat(s) alternating; {r['machine']['cpus']} CPUs, torch {r['machine']['torch']}, OMP_NUM_THREADS "
        f"{s['omp_num_threads']}.",
        "",
        *rows,
        "",
        f"Step time ratio ours/bare (median over repeats): **{r['ratio']:.3f}** (repeats "
        f"{min(x['ratio'] for x in r['repeats']):.3f} to {max(x['ratio'] for x in r['repeats']):.3f}); 1-minute "
        f"load average {load['before']:.1f} before, {load['after']:.1f} after.",
        "",
        *per_repeat,
        "",
        "| target | met |",
        "|---|---|",
        *(f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in r["targets"].items()),
    ]
    return "\n".join(lines) + "\n"
