"""python -m train.bench: the data loading benchmark (see train/bench/cache_io.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.bench import cache_io


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench", description=cache_io.__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="where cache_io.json/.md go")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench/work"), help="generated data and caches")
    parser.add_argument("--cache-gb", type=float, default=1.1, help="size the data is scaled to")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per rank, loaders (a) and (c)")
    parser.add_argument("--h5py-steps", type=int, default=40, help="timed steps per rank, loader (b)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per rank first")
    parser.add_argument("--quick", action="store_true", help="tiny data and few steps: checks that it runs")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.h5py_steps, args.warmup = 10, 4, 1
    result = cache_io.run(
        args.out, args.workdir, args.cache_gb, args.steps, args.h5py_steps, args.warmup, quick=args.quick
    )
    print((args.out / "cache_io.md").read_text())
    missed = [name for name, ok in result["targets"].items() if not ok]
    if missed and args.strict:
        print("missed: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
