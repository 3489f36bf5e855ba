"""``python -m train <command>``: the thin command line over the pipeline; maps errors to exit codes."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from pathlib import Path

from train.config import load_config
from train.disk import as_disk_full
from train.errors import ConfigError, PreflightError, StopRequested, TrainError
from train.heap import importing
from train.launch.stop import stop_on_signals
from train.launch.targets import TARGETS, target_named, write_job
from train.obs.log import setup_logging

log = logging.getLogger("train")

STAGE_COMMANDS = {
    "run": "all stages: data, cache, fit, evaluate (what is already valid is skipped)",
    "data": "generate or locate each task's HDF5 file",
    "cache": "build the memory-mapped training caches (after data)",
    "fit": "train under torchrun (after data and cache); resumes from the newest checkpoint",
    "evaluate": "test-split metrics of the newest checkpoint into runs/<name>/report",
}
OTHER_COMMANDS = {
    "doctor": "check this machine against the config (devices, /dev/shm, SLURM, ports, disk, data); exit 4 on a "
    "problem that would make a launch hang or crash",
    "smoke": "collectives, 5 DDP steps checked against one process, a checkpoint round trip and a torch.compile "
    "step, on every visible GPU (or 2 CPU processes)",
    "shard": "write each task's training data as a shard set (shards of whole trajectories, val and test whole, "
    "stream.json) to stream it with data.stream: true from any store (docs/streaming.md)",
    "push": "mirror the run folder to run.remote now (what a launch could not send: an unreachable or full remote); "
    "exit 4 when not all of it got there",
}
LAUNCHING = ("run", "fit", "evaluate", "smoke")
SWEEP_HELP = (
    "search many runs: the base config (--config, --set) with the parameters of a search space file (--space), "
    "each trial an ordinary run under runs/<sweep>/; re-running continues the search"
)
USING_COMMANDS = {
    "predict": "a trained model's predictions on a data file (rollouts from its initial frames), written in the "
    "same format and layout and scored when the file holds the true frames",
    "export": "write a trained model as a file that runs without this package (ONNX or TorchScript), one per task",
}


def _nproc(value: str) -> str:
    """--nproc (NPROC): a usage error (exit 2) when it is neither auto nor a positive number."""
    if value.strip() == "auto" or (value.strip().isdigit() and int(value) >= 1):
        return value.strip()
    raise argparse.ArgumentTypeError(f"{value!r} is not a process count: use auto or a number >= 1 (NPROC=2)")


def _positive(value: str) -> int:
    """--steps, --batch-size: a usage error (exit 2) unless a whole number >= 1."""
    if value.strip().isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1")


def _megabytes(value: str) -> float:
    """--shard-mb: a usage error (exit 2) unless a number above 0."""
    try:
        mb = float(value)
    except ValueError:
        mb = 0.0
    if mb > 0:
        return mb
    raise argparse.ArgumentTypeError(f"{value!r} is not a size in MB above 0 (e.g. 256 or 0.5)")


def _overrides(command: argparse.ArgumentParser, help_text: str) -> None:
    """``--set KEY=VALUE``, repeatable, into ``args.overrides``."""
    command.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description="Multi-task PDE surrogate training with DDP.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    jobs = {t.name: t.renders for t in TARGETS if t.renders}  # one command per engine with a job to render
    for name, help_text in {**STAGE_COMMANDS, **OTHER_COMMANDS, **jobs}.items():
        c = sub.add_parser(name, help=help_text, description=help_text)
        c.add_argument("--config", "-c", default="configs/default.yaml", help="YAML config (default: %(default)s)")
        _overrides(c, "override a config value, e.g. --set train.epochs=3 (repeatable)")
        c.add_argument("--run", help="run name (folder under run.runs_dir); default: the config file's stem")
        if name not in ("push", "shard", *jobs):
            c.add_argument("--nproc", default=None, type=_nproc, help="processes per node: auto (default) or a number")
        if name in STAGE_COMMANDS:
            c.add_argument(
                "--dry-run", action="store_true", help="print what the data stage would fetch from where, then stop"
            )
        if name in LAUNCHING:
            c.add_argument(
                "--skip-doctor",
                action="store_true",
                default=os.environ.get("SKIP_DOCTOR", "") not in ("", "0"),
                help="do not run the preflight checks before launching (also SKIP_DOCTOR=1)",
            )
        if name == "smoke":
            c.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile step")
        if name in jobs:
            c.add_argument("--output", "-o", help="write the job file here instead of printing it")
        if name == "shard":
            c.add_argument("--output", "-o", default="shards", help="folder of the shard sets, one per task")
            c.add_argument("--shard-mb", type=_megabytes, default=256, help="about this many MB a shard (0.1-2000)")
            c.add_argument(
                "--published",
                action="store_true",
                help="the files as published are the shards (The Well's): read them once, write only stream.json",
            )
    _sweep_command(sub)
    _using_commands(sub)
    return p


def _sweep_command(sub) -> None:
    c = sub.add_parser("sweep", help=SWEEP_HELP, description=SWEEP_HELP)
    c.add_argument("--config", "-c", default="configs/default.yaml", help="base YAML config (default: %(default)s)")
    c.add_argument("--space", "-s", required=True, help="the search space file (docs/sweeps.md)")
    c.add_argument("--name", help="the sweep's folder under run.runs_dir; default: the space file's stem")
    _overrides(c, "override a value of the base config (repeatable)")
    c.add_argument("--slurm", action="store_true", help="render the SLURM job array (runs/<sweep>/sweep.sbatch)")
    c.add_argument("--output", "-o", help="with --slurm: write the sbatch file here")
    c.add_argument(
        "--retry-failed", action="store_true", help="run the trials that failed again, with their parameters"
    )
    c.add_argument("--array-task", action="store_true", help=argparse.SUPPRESS)  # what each array task runs


def _sweep(args: argparse.Namespace) -> None:
    from train.sweep.driver import open_sweep, run_sweep, write_array

    study, base = open_sweep(args.config, args.overrides, args.space, args.name)
    if args.retry_failed:
        retried = study.retry_failed()
        log.info(
            "sweep %s: %s",
            study.name,
            f"failed trial(s) {', '.join(map(str, retried))} run again with their parameters, as new trials"
            if retried
            else "no failed trial to run again",
        )
    if args.slurm:
        write_array(study, base, args.config, args.overrides, args.space, args.output)
    else:
        run_sweep(study, base, array_task=args.array_task)


CONSOLIDATE_HELP = (
    "write a sharded checkpoint (a step_N.dcp or best.dcp folder of every rank's shards) as one .pt file, which "
    "any reader loads without a process group"
)


def _using_commands(sub) -> None:
    """Commands on a trained run: no config file, the run (or checkpoint, or remote) is the input."""
    c = sub.add_parser("consolidate", help=CONSOLIDATE_HELP, description=CONSOLIDATE_HELP)
    c.add_argument("--run", required=True, help="a run folder (runs/<name>) or a .dcp checkpoint folder")
    c.add_argument("--checkpoint", default="latest", help="latest (default), best, or a checkpoint's name or path")
    c.add_argument("--output", "-o", help="the .pt file to write (default: <checkpoints>/consolidated/<name>.pt)")
    for name, help_text in USING_COMMANDS.items():
        c = sub.add_parser(name, help=help_text, description=help_text)
        c.add_argument("--run", required=True, help="a run folder (runs/<name>), a checkpoint file or b2://.../<run>")
        c.add_argument("--checkpoint", default="best", help="best (default), latest, or a checkpoint path")
        c.add_argument("--task", help="the task to use; default: the only one (predict: the one the input fits)")
        c.add_argument("--output", "-o", help="the file to write" + (" (required)" if name == "predict" else ""))
        c.add_argument("--factory", help="where a model of your own lives now (file.py:function), if it moved")
        if name == "predict":
            c.add_argument(
                "--input", "-i", required=True, help="a data file in a format the task reads (HDF5, .mat, .pt)"
            )
            c.add_argument("--steps", type=_positive, help="frames to predict (default: to the input's last frame)")
            c.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
            c.add_argument("--batch-size", type=_positive, default=64, help="trajectories per forward (default 64)")
        else:
            c.add_argument("--format", choices=("onnx", "torchscript"), default="onnx", help="default: onnx")
            c.add_argument(
                "--accept-changed-model-source",
                action="store_true",
                help="export a model of your own whose file changed since training, as it is now",
            )


def _use(args: argparse.Namespace) -> None:
    if args.command == "consolidate":
        from train.checkpoint.shards import is_sharded_checkpoint
        from train.use.export import consolidate
        from train.use.outputs import check_output
        from train.use.surrogate import resolve_checkpoint

        if args.output:  # before anything is loaded (the default lies outside the checkpoint patterns)
            check_output(Path(args.output), "--output", folder=False)
        path = resolve_checkpoint(args.run, args.checkpoint)
        if not is_sharded_checkpoint(path):
            raise ConfigError(f"{path} is already one file (a .pt checkpoint): there is nothing to consolidate")
        print(f"consolidated {path} into {consolidate(path, Path(args.output) if args.output else None)}")
    elif args.command == "predict":
        from train.use.predict import predict_file

        if not args.output:
            raise ConfigError("predict needs --output FILE, the HDF5 file to write the predictions to")
        scores = predict_file(
            args.run,
            Path(args.input),
            Path(args.output),
            args.steps,
            args.checkpoint,
            args.task,
            args.device,
            args.batch_size,
            args.factory,
        )
        print(f"predictions written to {args.output}")
        if scores is not None:
            print(f"nRMSE {scores['nrmse']:.6g}, RMSE {scores['rmse']:.6g} over {scores['n_samples']} sample(s)")
    else:
        from train.use.export import export_run

        accept = args.accept_changed_model_source
        for path in export_run(args.run, args.format, args.output, args.checkpoint, args.task, args.factory, accept):
            print(f"exported {path}")


def main(argv: list[str] | None = None, exiting: bool = False) -> int:
    """The command line; ``exiting``: the process ends with this command (``python -m train``), see
    :func:`stop_on_signals`."""
    args = parser().parse_args(argv)
    setup_logging("launcher")
    try:
        with stop_on_signals(exiting):
            _dispatch(args)
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except StopRequested as e:
        print(f"stopped: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        full = as_disk_full(e, Path.cwd())  # a write no stage foresaw (a log, a record) on a full disk
        if full is not None:
            print(f"error: {full}", file=sys.stderr)
            return full.exit_code
        if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            # A folder no stage checked: this machine's file system refuses the write, which is no bug
            print(
                f"error: cannot write {e.filename or 'a file'}: {e.strerror}; point the folder that holds it at "
                "a writable place",
                file=sys.stderr,
            )
            return PreflightError.exit_code
        raise
    return 0


def _dispatch(args: argparse.Namespace) -> None:
    if args.command in (*USING_COMMANDS, "consolidate"):
        return _use(args)
    if args.command == "sweep":
        return _sweep(args)
    cfg = load_config(args.config, args.overrides, run_name=args.run or None)
    # torch is imported only once the config is known to be good
    if args.command == "doctor":
        with importing():
            from train.launch.doctor import doctor

        doctor(cfg, args.nproc)
    elif args.command == "smoke":
        with importing():
            from train.launch.smoke import run_smoke

        run_smoke(cfg, args.nproc, compile_step=not args.skip_compile, preflight=not args.skip_doctor)
    elif args.command in {t.name for t in TARGETS}:
        write_job(target_named(args.command), cfg, args.config, args.overrides, args.output)
    elif args.command == "shard":
        with importing():
            from train.pipeline import write_shard_sets

        write_shard_sets(cfg, Path(args.output), int(args.shard_mb * 2**20), published=args.published)
    elif args.command == "push":
        with importing():
            from train.launch.push import push_run

        push_run(cfg)
    else:
        with importing():
            from train.pipeline import run_stages

        preflight = args.command in LAUNCHING and not args.skip_doctor
        run_stages(cfg, args.command, args.nproc, dry_run=args.dry_run, preflight=preflight)
