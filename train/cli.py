"""``python -m train <command>``: the thin command line over the pipeline; maps errors to exit codes."""

from __future__ import annotations

import argparse
import logging
import sys

from train.config import load_config
from train.errors import TrainError
from train.obs.log import setup_logging

log = logging.getLogger("train")

COMMANDS = {
    "run": "all stages: data, cache, fit, evaluate (what is already valid is skipped)",
    "data": "generate or locate each task's HDF5 file",
    "cache": "build the memory-mapped training caches (after data)",
    "fit": "train under torchrun (after data and cache); resumes from the newest checkpoint",
    "evaluate": "test-split metrics of the newest checkpoint into runs/<name>/report",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description="Multi-task PDE surrogate training with DDP.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        c = sub.add_parser(name, help=help_text, description=help_text)
        c.add_argument("--config", "-c", default="configs/default.yaml", help="YAML config (default: %(default)s)")
        c.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. --set train.epochs=3 (repeatable)",
        )
        c.add_argument("--run", help="run name (folder under run.runs_dir); default: the config file's stem")
        c.add_argument("--nproc", default=None, help="processes per node: auto (default) or a number")
        c.add_argument(
            "--dry-run", action="store_true", help="print what the data stage would fetch from where, then stop"
        )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging("launcher")
    try:
        cfg = load_config(args.config, args.overrides, run_name=args.run or None)
        from train.pipeline import run_stages  # torch is imported only once the config is known to be good

        run_stages(cfg, args.command, args.nproc, dry_run=args.dry_run)
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
