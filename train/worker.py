"""The entry point of each rank under torchrun: join the group, train and/or evaluate, leave cleanly.

Launched by ``python -m train run|fit|evaluate`` (never by hand): it reads everything from the run folder
(train.run_dir) and its node's launch record.
"""

from __future__ import annotations

import argparse
import logging
import sys

from train.checkpoint import MODEL, checkpoint_for_evaluation, load_checkpoint
from train.config import Config
from train.disk import as_disk_full
from train.distributed.env import DistEnv, destroy_distributed, init_distributed, rank_from_environ
from train.distributed.error_file import record, record_error
from train.distributed.lifeline import hold_for_launcher
from train.engine.evaluate import evaluate_split, example_prediction
from train.engine.loaders import initial_model
from train.engine.trainer import Trainer
from train.errors import DataError, Preempted, TrainError
from train.model.specs import TaskData
from train.obs.log import setup_logging
from train.obs.report import write_report
from train.obs.sinks import MetricSinks
from train.run_dir import RunDir, rank_arguments

log = logging.getLogger(__name__)


def evaluate(cfg: Config, env: DistEnv, tasks: list[TaskData], run: RunDir) -> None:
    path = checkpoint_for_evaluation(run.checkpoints)
    if path is None:
        raise DataError(f"no checkpoint in {run.checkpoints} to evaluate; train first (python -m train fit)")
    model = initial_model(cfg, tasks, env.device)
    model.load_state_dict(load_checkpoint(path)[MODEL])
    results = evaluate_split(model, tasks, env, "test", cfg.train.eval_batch_size)
    for name, r in results.items():
        log.info(
            "test %s: nRMSE %.4g (baseline %.4g), RMSE %.4g, cRMSE %.4g, bRMSE %.4g, max error %.4g",
            name, r["nrmse"], r["baseline_nrmse"], r["rmse"], r["crmse"], r["brmse"], r["max_error"],
        )  # fmt: skip
    if env.is_main:
        examples = {t.name: example_prediction(model, t, "test") for t in tasks if t.info.sizes["test"]}
        splits = {t.name: t.info.splits for t in tasks}
        write_report(run.root, results, path, splits, examples, provenance=run.load_data())
        log.info("report written to %s", run.report)


@record
def main(argv: list[str] | None = None) -> int:
    run, launch, rest = rank_arguments(argv)
    if launch is not None:
        hold_for_launcher(launch.launcher_pid, launch.ranks_lock)
    parser = argparse.ArgumentParser(prog="python -m train.worker")
    parser.add_argument("--stages", default="fit,evaluate", help="comma-separated: fit, evaluate")
    args = parser.parse_args(rest)
    cfg = run.load_config()
    rank = rank_from_environ()
    setup_logging(f"rank{rank}", run.rank_log(rank), console=rank == 0)
    metrics = MetricSinks(run.root if rank == 0 else None)
    try:
        if run.preempted:
            # The launcher removes the marker before it starts the ranks: this is torchrun restarting a group
            # that stopped for a signal, which must stay stopped.
            raise Preempted(f"{run.root} was stopped by a signal in this launch; re-run to resume")
        env = DistEnv.from_environ(cfg.dist.backend, cfg.dist.backend_fallback)
        env = init_distributed(env, cfg.dist.timeout_s, cfg.dist.backend_fallback)
        tasks = run.load_tasks(cfg)
        stages = args.stages.split(",")
        if "fit" in stages:
            # No reference kept: DDP's reducer must be freed while the process group lives (freed after it, the
            # last reference to a gloo group joins gloo's threads while holding the GIL they wait for).
            Trainer(cfg, env, tasks, run).fit(
                metrics,
                launched_at=launch.started_at if launch else None,
                live_console=bool(launch and launch.live_console),
            )
        if "evaluate" in stages:
            evaluate(cfg, env, tasks, run)
        destroy_distributed(wait_for_peers=True)
    except TrainError as e:
        log.error("%s", e)
        # The launcher reads this file to name the failing rank's error in its summary.
        record_error(e)
        return e.exit_code
    except Exception as e:
        full = as_disk_full(e, run.root)  # a write anywhere (metrics, logs, the report) on a full disk
        if full is not None:
            log.error("%s", full)
            record_error(full)
            return full.exit_code
        log.exception("unexpected error")  # the traceback in this rank's log file; @record writes the error file
        raise
    finally:
        metrics.close()
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
