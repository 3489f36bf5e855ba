"""python -m train.bench [NAME|all] [options]: the benchmarks of train/bench/table.py:BENCHMARKS, each writing
NAME.json/.md to --out; without a name, every benchmark the table runs under ``all``."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from train.bench.table import BENCHMARKS, BY_NAME, LOG_EVERY, Benchmark
from train.errors import TrainError

COMMANDS = (*BY_NAME, "all")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="where NAME.json/.md go")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/work"), help="generated data and caches")
    parser.add_argument("--quick", action="store_true", help="tiny data and few steps: checks that it runs")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")


def _listing() -> str:
    """The table as the command's help shows it."""
    lines = ["benchmarks (make bench BENCH_ARGS=NAME):"]
    for row in BENCHMARKS:
        scope = "" if row.in_all else "; only when named"
        lines.append(f"  {row.name}: {row.measures} ({row.budget}{scope})")
        lines += [f"      target: {target}" for target in row.targets]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per row of the table, with its own options, and ``all``."""
    parser = argparse.ArgumentParser(
        prog="python -m train.bench",
        description=__doc__,
        epilog=_listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for row in BENCHMARKS:
        command = sub.add_parser(row.name, help=row.measures)
        _common(command)
        for option in row.options:
            flag = "--" + option.name.replace("_", "-")
            if isinstance(option.default, bool):
                command.add_argument(flag, action="store_true", help=option.help)
            else:
                command.add_argument(flag, type=type(option.default), default=option.default, help=option.help)
    _common(sub.add_parser("all", help="every benchmark the table runs under all, with its default sizes"))
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options; without a subcommand (none, or only options) the command is ``all``."""
    argv = list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "all")  # `make bench BENCH_ARGS=--quick` runs everything
    parser = build_parser()
    args = parser.parse_args(argv)
    log_every = getattr(args, "log_every", LOG_EVERY)
    if args.command in ("trainer", "remote") and args.warmup % log_every:
        parser.error(
            f"{args.command}: --warmup must be a multiple of {log_every}, the logging window, so windows start after it"
        )
    return args


def run_benchmark(row: Benchmark, args: argparse.Namespace) -> dict:
    """One row: its options from the command line (its defaults under ``all``), ``--quick``'s sizes over them;
    its table printed; its figures returned."""
    options = {option.name: getattr(args, option.name, option.default) for option in row.options}
    if args.quick:
        options.update(row.quick)
    module = importlib.import_module(f"train.bench.{row.module}")
    result = module.run(args.out, args.workdir, quick=args.quick, **options)
    print((args.out / f"{row.module}.md").read_text(), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rows = [row for row in BENCHMARKS if row.in_all] if args.command == "all" else [BY_NAME[args.command]]
    missed = []
    try:
        for row in rows:
            missed += [name for name, ok in run_benchmark(row, args)["targets"].items() if not ok]
    except TrainError as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        return e.exit_code
    if missed and args.strict:
        print("missed: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
