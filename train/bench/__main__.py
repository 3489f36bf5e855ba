"""python -m train.bench [cache-io|trainer|compile|models|remote|well|operators|finetune|pretrain|transfer|sweep|
parallel|scale|all]: the benchmarks, each writing NAME.json/.md to --out.

- cache-io: data loading, our mmap cache against per-sample h5py and shared memory (train/bench/cache_io.py);
- trainer: our trainer's step time against a bare DDP loop (train/bench/trainer_step.py);
- compile: the whole step compiled against the eager step on a small, host-bound FNO, and configs/default.yaml from
  the command to the report both ways (train/bench/compiled_step.py);
- models: each built-in model and training objective at the same time budget, test nRMSE (train/bench/models.py);
- remote: the trainer's step time with and without a slow remote mirroring its checkpoints (train/bench/remote.py);
- well: configs/well.yaml from nothing, timed, one-step VRMSE against the baseline (train/bench/well.py);
- operators: configs/fno-darcy.yaml, fno-burgers.yaml and pdearena-ns.yaml from nothing, test relative L2 against
  the baseline and beside the published FNO errors (train/bench/operators.py);
- finetune: the default advection model fine-tuned on another coefficient against training from scratch
  (train/bench/finetune.py);
- pretrain: one multi-physics model on configs/pretrain.yaml's ten datasets against single-task models, then
  fine-tuned onto a held-out dataset against training from scratch (train/bench/pretrain.py);
- transfer: the multi-physics model pretrained on a mix of physics, then fine-tuned against from scratch on two
  held-out datasets of shocks with 8 and 32 training trajectories, 3 seeds, each arm at its best learning rate
  (train/bench/transfer.py);
- sweep: an 8-trial search over the FNO's width, modes and learning rate against the default config
  (train/bench/sweep.py);
- parallel: ddp, fsdp and hsdp on 2 and 4 CPU ranks: model state per rank, step time, checkpoint write and load,
  sharded and full (train/bench/parallel.py);
- all (the default, also when only options are given): all twelve (not scale), with their default sizes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.bench import (
    cache_io,
    compiled_step,
    finetune,
    models,
    operators,
    parallel,
    pretrain,
    remote,
    scale,
    sweep,
    trainer_step,
    transfer,
    well,
)
from train.errors import TrainError

COMMANDS = (
    *("cache-io", "trainer", "compile", "models", "remote", "well", "operators", "finetune", "pretrain"),
    *("transfer", "sweep"),
    *("parallel", "scale", "all"),
)
# Each benchmark's own options and their defaults (``all`` runs both with these).
CACHE_IO = {"cache_gb": 1.1, "steps": 400, "h5py_steps": 40, "warmup": 5}
TRAINER = {"steps": 150, "warmup": 20, "repeats": 5}
COMPILE = {"steps": 300, "warmup": 60, "repeats": 3}
MODELS = {"budget_s": 150.0}  # about the training time of `make train`
REMOTE = {"steps": 150, "warmup": 20, "repeats": 3, "rate_mb_s": 2.0}
LOG_EVERY = 10  # the trainer's logging window in the benchmark: several in the timed steps, each costing little


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="where NAME.json/.md go")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/work"), help="generated data and caches")
    parser.add_argument("--quick", action="store_true", help="tiny data and few steps: checks that it runs")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per benchmark, and ``all``."""
    parser = argparse.ArgumentParser(
        prog="python -m train.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    io = sub.add_parser("cache-io", help=cache_io.__doc__.splitlines()[0])
    _common(io)
    io.add_argument("--cache-gb", type=float, default=CACHE_IO["cache_gb"], help="size the data is scaled to")
    io.add_argument("--steps", type=int, default=CACHE_IO["steps"], help="timed steps per rank, loaders (a) and (c)")
    io.add_argument("--h5py-steps", type=int, default=CACHE_IO["h5py_steps"], help="timed steps per rank, loader (b)")
    io.add_argument("--warmup", type=int, default=CACHE_IO["warmup"], help="untimed steps per rank first")
    tr = sub.add_parser("trainer", help=trainer_step.__doc__.splitlines()[0])
    _common(tr)
    tr.add_argument("--steps", type=int, default=TRAINER["steps"], help="timed steps per launch")
    tr.add_argument(
        "--warmup", type=int, default=TRAINER["warmup"], help=f"untimed steps first (a multiple of {LOG_EVERY})"
    )
    tr.add_argument("--repeats", type=int, default=TRAINER["repeats"], help="launches of each loop, alternating")
    co = sub.add_parser("compile", help=compiled_step.__doc__.splitlines()[0])
    _common(co)
    co.add_argument("--steps", type=int, default=COMPILE["steps"], help="timed steps per launch")
    co.add_argument("--warmup", type=int, default=COMPILE["warmup"], help="untimed steps first (compiling among them)")
    co.add_argument("--repeats", type=int, default=COMPILE["repeats"], help="launches of each, alternating")
    co.add_argument("--default-run", action="store_true", help="also configs/default.yaml both ways (tens of minutes)")
    mo = sub.add_parser("models", help=models.__doc__.splitlines()[0])
    _common(mo)
    mo.add_argument("--budget-s", type=float, default=MODELS["budget_s"], help="seconds of training per entry")
    re = sub.add_parser("remote", help=remote.__doc__.splitlines()[0])
    _common(re)
    re.add_argument("--steps", type=int, default=REMOTE["steps"], help="timed steps per launch")
    re.add_argument(
        "--warmup", type=int, default=REMOTE["warmup"], help=f"untimed steps first (a multiple of {LOG_EVERY})"
    )
    re.add_argument("--repeats", type=int, default=REMOTE["repeats"], help="pairs of launches, alternating")
    re.add_argument("--rate-mb-s", type=float, default=REMOTE["rate_mb_s"], help="upload speed of the remote")
    _common(sub.add_parser("well", help=well.__doc__.splitlines()[0]))
    _common(sub.add_parser("operators", help=operators.__doc__.splitlines()[0]))
    _common(sub.add_parser("finetune", help=finetune.__doc__.splitlines()[0]))
    _common(sub.add_parser("pretrain", help=pretrain.__doc__.splitlines()[0]))
    _common(sub.add_parser("transfer", help=transfer.__doc__.splitlines()[0]))
    _common(sub.add_parser("sweep", help=sweep.__doc__.splitlines()[0]))
    _common(sub.add_parser("parallel", help=parallel.__doc__.splitlines()[0]))
    sc = sub.add_parser("scale", help=scale.__doc__.splitlines()[0])
    _common(sc)
    sc.add_argument(
        "--cfd-fraction", type=float, default=0.1, help="share of PDEBench's 10,000-sample (55 GB) 2D CFD file to write"
    )
    every = sub.add_parser("all", help="every benchmark with its default sizes (the default command)")
    _common(every)
    return parser


def _options(args: argparse.Namespace, defaults: dict) -> dict:
    """A benchmark's own options: from the command line under its subcommand, its defaults under ``all``."""
    return {key: getattr(args, key, value) for key, value in defaults.items()}


def cache_io_main(args: argparse.Namespace) -> dict:
    o = _options(args, CACHE_IO)
    if args.quick:
        o.update(steps=10, h5py_steps=4, warmup=1)
    result = cache_io.run(
        args.out, args.workdir, o["cache_gb"], o["steps"], o["h5py_steps"], o["warmup"], quick=args.quick
    )
    print((args.out / "cache_io.md").read_text(), flush=True)
    return result


def trainer_main(args: argparse.Namespace) -> dict:
    o, log_every = _options(args, TRAINER), LOG_EVERY
    if args.quick:
        o, log_every = {"steps": 6, "warmup": 2, "repeats": 1}, 2
    result = trainer_step.run(
        args.out, args.workdir, o["steps"], o["warmup"], o["repeats"], args.quick, log_every=log_every
    )
    print((args.out / "trainer_step.md").read_text(), flush=True)
    return result


def compile_main(args: argparse.Namespace) -> dict:
    o = _options(args, COMPILE)
    if args.quick:
        o = {"steps": 6, "warmup": 4, "repeats": 1}
    result = compiled_step.run(
        args.out, args.workdir, o["steps"], o["warmup"], o["repeats"], getattr(args, "default_run", False), args.quick
    )
    print((args.out / "compiled_step.md").read_text(), flush=True)
    return result


def models_main(args: argparse.Namespace) -> dict:
    o = _options(args, MODELS)
    result = models.run(args.out, args.workdir, o["budget_s"], args.quick)
    print((args.out / "models.md").read_text(), flush=True)
    return result


def remote_main(args: argparse.Namespace) -> dict:
    o = _options(args, REMOTE)
    if args.quick:
        o.update(steps=20, warmup=4, repeats=1)
    result = remote.run(args.out, args.workdir, o["steps"], o["warmup"], o["repeats"], o["rate_mb_s"], args.quick)
    print((args.out / "remote.md").read_text(), flush=True)
    return result


def well_main(args: argparse.Namespace) -> dict:
    result = well.run(args.out, args.workdir, args.quick)
    print((args.out / "well.md").read_text(), flush=True)
    return result


def operators_main(args: argparse.Namespace) -> dict:
    result = operators.run(args.out, args.workdir, args.quick)
    print((args.out / "operators.md").read_text(), flush=True)
    return result


def parallel_main(args: argparse.Namespace) -> dict:
    result = parallel.run(args.out, args.workdir)
    print((args.out / "parallel.md").read_text(), flush=True)
    return result


def finetune_main(args: argparse.Namespace) -> dict:
    result = finetune.run(args.out, args.workdir, args.quick)
    print((args.out / "finetune.md").read_text(), flush=True)
    return result


def pretrain_main(args: argparse.Namespace) -> dict:
    result = pretrain.run(args.out, args.workdir, args.quick)
    print((args.out / "pretrain.md").read_text(), flush=True)
    return result


def transfer_main(args: argparse.Namespace) -> dict:
    result = transfer.run(args.out, args.workdir, args.quick)
    print((args.out / "transfer.md").read_text(), flush=True)
    return result


def sweep_main(args: argparse.Namespace) -> dict:
    result = sweep.run(args.out, args.workdir, args.quick)
    print((args.out / "sweep.md").read_text(), flush=True)
    return result


def scale_main(args: argparse.Namespace) -> dict:
    result = scale.run(args.out, args.workdir, args.quick, args.cfd_fraction)
    print((args.out / "scale.md").read_text(), flush=True)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options; without a subcommand (none, or only options) the command is ``all``."""
    argv = list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "all")  # `make bench BENCH_ARGS=--quick` runs everything
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("trainer", "remote") and args.warmup % LOG_EVERY:
        parser.error(
            f"{args.command}: --warmup must be a multiple of {LOG_EVERY}, the logging window, so windows start after it"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    runs = {
        "cache-io": [cache_io_main],
        "trainer": [trainer_main],
        "compile": [compile_main],
        "models": [models_main],
        "remote": [remote_main],
        "well": [well_main],
        "operators": [operators_main],
        "finetune": [finetune_main],
        "pretrain": [pretrain_main],
        "transfer": [transfer_main],
        "sweep": [sweep_main],
        "parallel": [parallel_main],
        "scale": [scale_main],  # 15 GB of disk and tens of minutes: not part of all
        "all": [
            cache_io_main,
            trainer_main,
            compile_main,
            models_main,
            remote_main,
            well_main,
            operators_main,
            finetune_main,
            pretrain_main,
            sweep_main,
            parallel_main,
            transfer_main,  # last: its runs share this process
        ],
    }
    missed = []
    try:
        for bench in runs[args.command]:
            missed += [name for name, ok in bench(args)["targets"].items() if not ok]
    except TrainError as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        return e.exit_code
    if missed and args.strict:
        print("missed: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
