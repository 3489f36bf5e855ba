"""The reference of the trainer benchmark: the plain DDP loop a competent user would write by hand.

Same model, batches, optimizer, schedule, loss and clipping as train.engine.trainer, and nothing else: no
stop-request all-reduce, no per-step seeding, no loss bookkeeping, no progress bar, no metrics files. Each
rank runs it under torchrun (``train.launch.torchrun.launch(..., module="train.bench.bare_ddp")``) from a run
folder the launcher prepared; rank 0 writes the timings to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from train.distributed.env import DistEnv
from train.engine.loaders import initial_model, training_loaders
from train.engine.loss import task_loss
from train.engine.optim import build_optimizer
from train.run_dir import rank_arguments


def window_means(times: list[float], window: int) -> list[float]:
    """Mean step time of each run of ``window`` consecutive steps (a last, shorter run included), as the
    trainer's metrics records report it."""
    return [statistics.fmean(times[i : i + window]) for i in range(0, len(times), window)]


def main(argv: list[str] | None = None) -> int:
    run, launch, rest = rank_arguments(argv)  # the run folder the launcher prepared
    parser = argparse.ArgumentParser(prog="python -m train.bench.bare_ddp")
    parser.add_argument("--steps", type=int, required=True, help="timed steps")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes its timings here (JSON)")
    args = parser.parse_args(rest)
    cfg = run.load_config()
    dist.init_process_group("gloo")
    env = DistEnv.from_environ("gloo")
    tasks = run.load_tasks(cfg)
    total = args.warmup + args.steps

    model = initial_model(cfg, tasks, env.device)
    ddp = DistributedDataParallel(model)
    # The trainer's optimizer and schedule over the same total, so both loops take identical steps.
    optimizer, scheduler = build_optimizer(model.parameters(), cfg.train, total)
    loaders, _ = training_loaders(cfg, env, tasks, total)
    iterators = {name: iter(loader) for name, loader in loaders.items()}
    weights = {t.name: cfg.tasks[t.name].loss_weight for t in tasks}
    clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")

    times, first_step_done = [], None
    start = time.perf_counter()
    for step in range(total):
        if step == args.warmup:
            dist.barrier()  # both ranks start the clock together; nothing syncs inside the timed loop
            start = time.perf_counter()
        batches = {name: next(it) for name, it in iterators.items()}
        preds = ddp({name: b["x"] for name, b in batches.items()})
        loss = sum(weights[n] * task_loss(preds[n], b["y"]) for n, b in batches.items())
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        now = time.perf_counter()
        if step >= args.warmup:
            times.append(now - start)
            start = now
        first_step_done = first_step_done or time.time()

    if env.is_main:
        launched = launch.started_at if launch is not None else None
        window = cfg.train.log_every
        result = {
            "step_time_s": statistics.median(window_means(times, window)),
            "median_step_s": statistics.median(times),
            "mean_step_s": statistics.fmean(times),
            "window": window,
            "steps": len(times),
            "warmup": args.warmup,
            "launch_to_first_step_s": first_step_done - launched if launched else None,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    dist.barrier()  # no rank tears down its gloo group while the other still uses it
    # DDP's reducer is freed while the group lives: freed after it (at the function's return), the last reference
    # to a gloo group joins gloo's threads while holding the GIL they wait for, and the rank never exits.
    del ddp
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
