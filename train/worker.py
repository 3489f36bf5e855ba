"""The entry point of each rank under torchrun: join the group, train and/or evaluate, leave cleanly.

Launched by ``python -m train run|fit|evaluate`` (never by hand): it reads everything from the run folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from train.config import load_config
from train.data.cache import CacheInfo
from train.data.latent import LatentInfo
from train.dist.env import DistEnv, destroy_distributed, init_distributed, rank_from_environ
from train.dist.run_lock import hold_for_rank
from train.engine.checkpoint import checkpoint_for_evaluation, load_checkpoint
from train.engine.evaluate import TaskData, evaluate_split, example_prediction
from train.engine.loaders import build_model
from train.engine.trainer import Trainer
from train.errors import PREEMPTED_MARKER, DataError, Preempted, TrainError
from train.model.multitask import TaskSpec
from train.obs.log import setup_logging
from train.obs.report import write_report
from train.obs.sinks import MetricSinks

log = logging.getLogger(__name__)

INPUTS = "inputs.json"


def load_tasks(run_dir: Path, cfg) -> list[TaskData]:
    """The caches the launcher prepared for this run (run_dir/inputs.json), with each task's model spec."""
    inputs = json.loads((run_dir / INPUTS).read_text())
    tasks = []
    for name, task in cfg.tasks.items():
        folders = inputs[name]
        info = CacheInfo.load(Path(folders["cache"]))
        latent = LatentInfo.load(Path(folders["latent"])) if folders["latent"] else None
        if info is None or (folders["latent"] and latent is None):
            raise DataError(f"task {name}: a cache in {folders} is missing or incomplete; run 'python -m train cache'")
        spec = TaskSpec(
            grid=info.grid,
            in_channels=info.in_channels,
            out_channels=info.out_channels,
            patch_size=task.patch_size,
            initial_step=task.initial_step,
            autoregressive=info.autoregressive,
        )
        tasks.append(TaskData(name, info, spec, latent))
    return tasks


def evaluate(cfg, env: DistEnv, tasks: list[TaskData], run_dir: Path) -> None:
    path = checkpoint_for_evaluation(run_dir / "checkpoints")
    if path is None:
        raise DataError(f"no checkpoint in {run_dir / 'checkpoints'} to evaluate; train first (python -m train fit)")
    model = build_model(cfg, tasks, env.device)
    model.load_state_dict(load_checkpoint(path)["model"])
    results = evaluate_split(model, tasks, env, "test", cfg.train.eval_batch_size)
    for name, r in results.items():
        log.info(
            "test %s: nRMSE %.4g (baseline %.4g), RMSE %.4g, cRMSE %.4g, bRMSE %.4g, max error %.4g",
            name, r["nrmse"], r["baseline_nrmse"], r["rmse"], r["crmse"], r["brmse"], r["max_error"],
        )  # fmt: skip
    if env.is_main:
        examples = {t.name: example_prediction(model, t, "test") for t in tasks if t.info.sizes["test"]}
        write_report(run_dir, results, path, {t.name: t.info.splits for t in tasks}, examples)
        log.info("report written to %s", run_dir / "report")


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--stages", default="fit,evaluate", help="comma-separated: fit, evaluate")
    args = parser.parse_args(argv)
    hold_for_rank()
    cfg = load_config(args.run_dir / "config.yaml")
    rank = rank_from_environ()
    setup_logging(f"rank{rank}", args.run_dir / "logs" / f"rank{rank}.log", console=rank == 0)
    metrics = MetricSinks(args.run_dir if rank == 0 else None)
    try:
        if (args.run_dir / PREEMPTED_MARKER).is_file():
            # The launcher removes the marker before it starts the ranks: this is torchrun restarting a group
            # that stopped for a signal, which must stay stopped.
            raise Preempted(f"{args.run_dir} was stopped by a signal in this launch; re-run to resume")
        env = DistEnv.from_environ(cfg.dist.backend, cfg.dist.backend_fallback)
        env = init_distributed(env, cfg.dist.timeout_s, cfg.dist.backend_fallback)
        tasks = load_tasks(args.run_dir, cfg)
        stages = args.stages.split(",")
        if "fit" in stages:
            Trainer(cfg, env, tasks, args.run_dir).fit(metrics)
        if "evaluate" in stages:
            evaluate(cfg, env, tasks, args.run_dir)
        destroy_distributed(wait_for_peers=True)
    except TrainError as e:
        log.error("%s", e)
        # The launcher reads this file to name the failing rank's error in its summary.
        get_error_handler().record_exception(e)
        return e.exit_code
    except Exception:
        log.exception("unexpected error")  # the traceback in this rank's log file; @record writes the error file
        raise
    finally:
        metrics.close()
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
