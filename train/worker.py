"""The entry point of each rank under torchrun: join the group, train and/or evaluate, leave cleanly.

Launched by ``python -m train run|fit|evaluate`` (never by hand): it reads everything from the run folder
(train.run_dir) and its node's launch record.
"""

from __future__ import annotations

from train.heap import pause_while_importing

pause_while_importing(__name__)  # resumed by run_rank once the modules below are imported

import argparse
import contextlib
import gc
import logging
import os
import sys

# DDP's constructor imports dynamo (and sympy), a second for every rank: here, with the collector paused.
import torch._dynamo  # noqa: F401
import torch.distributed as dist

from train.checkpoint import MODEL, PROGRESS, check_same_model, checkpoint_for_evaluation, load_model_state
from train.config import Config
from train.distributed.env import DistEnv
from train.distributed.error_file import record
from train.distributed.shared_checkpoint import shared_checkpoint
from train.engine.evaluate import evaluate_split, example_prediction
from train.engine.loaders import initial_model
from train.engine.trainer import Trainer
from train.errors import DataError, Preempted
from train.model.specs import TaskData
from train.obs.report import diverged, diverged_error, write_report
from train.obs.sinks import MetricSinks
from train.rank_start import Rank, run_rank
from train.run_dir import RunDir

log = logging.getLogger(__name__)


def evaluate(cfg: Config, env: DistEnv, tasks: list[TaskData], run: RunDir) -> None:
    path, saved = shared_checkpoint(env, run.checkpoints, lambda: checkpoint_for_evaluation(run.checkpoints))
    if path is None or saved is None:
        raise DataError(f"no checkpoint in {run.checkpoints} to evaluate; train first (python -m train fit)")
    check_same_model(saved, cfg.model, {t.name: t.spec.as_dict() for t in tasks}, path, "evaluate")
    model = initial_model(cfg, tasks, env.device)
    load_model_state(model, saved[MODEL], path)
    results = evaluate_split(model, tasks, env, "test", cfg.train.eval_batch_size)
    for name, r in results.items():
        log.info(
            "test %s: nRMSE %.4g (baseline %.4g), RMSE %.4g, cRMSE %.4g, bRMSE %.4g, max error %.4g, rel. L2 %.4g "
            "(baseline %.4g)",
            name,
            r["nrmse"],
            r["baseline_nrmse"],
            r["rmse"],
            r["crmse"],
            r["brmse"],
            r["max_error"],
            r["rel_l2"],
            r["baseline_rel_l2"],
        )
    if env.is_main:
        examples = {t.name: example_prediction(model, t, "test") for t in tasks if t.info.sizes["test"]}
        splits = {t.name: t.info.splits for t in tasks}
        write_report(run.root, results, path, splits, examples, provenance=run.load_data())
        log.info("report written to %s", run.report)
    # Every rank holds the same reduced metrics, so every rank stops here alike.
    failed = diverged(results)
    if failed:
        dist.barrier()  # rank 0's report first: a rank that raised at once would have it killed mid-write
        step = saved.get(PROGRESS, {}).get("global_step", "?")
        raise diverged_error(failed, f"{path} (global step {step})", run.report)


def _stages(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", default="fit,evaluate", help="comma-separated: fit, evaluate")


def _still_stopped(run: RunDir) -> None:
    if run.preempted:
        # The launcher removes the marker before it starts the ranks: this is torchrun restarting a group that
        # stopped for a signal, which must stay stopped.
        raise Preempted(f"{run.root} was stopped by a signal in this launch; re-run to resume")


def _train_and_evaluate(rank: Rank) -> None:
    cfg, env, run, launch = rank.cfg, rank.env, rank.run, rank.launch
    tasks = run.load_tasks(cfg)
    stages = rank.args.stages.split(",")
    metrics = MetricSinks(run.root if env.is_main else None)
    try:
        if "fit" in stages:
            # No reference kept: DDP's reducer must be freed while the process group lives (freed after it, the
            # last reference to a gloo group joins gloo's threads while holding the GIL they wait for, or torch
            # aborts the rank at exit: "terminate called without an active exception", exit 134).
            Trainer(cfg, env, tasks, run).fit(
                metrics,
                launched_at=launch.started_at if launch else None,
                live_console=bool(launch and launch.live_console),
                resume_sha1=launch.resume_sha1 if launch and first_attempt() else None,
            )
            # The trainer sits in reference cycles (closures over it, frames torch keeps): collected now, while
            # the group lives, not by whichever later collection happens to run.
            gc.collect()
        if "evaluate" in stages:
            evaluate(cfg, env, tasks, run)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk fails the flush too: the first error is the one to tell
            metrics.close()
        raise
    metrics.close()


@record
def main(argv: list[str] | None = None) -> int:
    return run_rank("python -m train.worker", _stages, _train_and_evaluate, argv, before_joining=_still_stopped)


def first_attempt() -> bool:
    """Not a group torchrun restarted after a failure (which continues from what this launch wrote since)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


if __name__ == "__main__":
    sys.exit(main())
