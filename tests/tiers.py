"""``make test``: every tier of the suite, in two lanes at once, each tier a pytest process of its own.

The compute lane runs the tiers that keep the cores busy (unit, then integration) one after another; the
waiting lane, beside it, runs those that mostly wait (the out-of-core run inside its memory cgroup, the two
boxes of the multinode tier, the integration tests marked ``waits``, SLURM's time-limit clock, and the container
tier, which waits for Docker's provisioning) and the distributed tier, which balances the two. A tier's output
is held in a log and printed whole when it ends, so two tiers never interleave; each has its own pytest
summary (and ``--durations`` list). The end is a table of every tier: its tests, its
result and its wall time.

The exit code is the first failing tier's own (pytest's: 1 a test failed, 2 interrupted, 3 an internal error,
4 a usage error), or 5 when no tier ran a test. ``python -m tests.tiers [pytest arguments]``; the arguments go
to every tier (``-k`` may leave a tier with nothing to run, which alone is no failure; a ``-m`` replaces the
split of tests/integration between the integration and waits tiers).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_TESTS = 5
FARM_ENV = "TRAIN_TEST_FARM"
"""The farm of trained runs every tier shares (tests/farm.py), a folder of this run's."""


@dataclass
class Tier:
    name: str
    paths: list[str]
    ignore: list[str] = field(default_factory=list)
    marks: str | None = None
    """A pytest ``-m`` expression: the tier's share of tests its paths hold with others."""
    code: int | None = None
    seconds: float = 0.0
    summary: str = ""


def lanes() -> list[list[Tier]]:
    """The two lanes, about equal in time on 2 cores: each tier that computes keeps both cores busy (two ranks),
    so the lane beside it gets the tiers that wait and as much computing as balances them."""
    out_of_core = ["tests/integration/test_out_of_core.py"]
    compute = [
        Tier("unit", ["tests/unit"]),
        Tier("integration", ["tests/integration"], ignore=out_of_core, marks="not waits"),
    ]
    beside = [
        Tier("slurm", ["tests/slurm"]),
        Tier("waits", ["tests/integration"], ignore=out_of_core, marks="waits"),
        Tier("out-of-core", out_of_core),
        Tier("multinode", ["tests/multinode"]),
        Tier("distributed", ["tests/distributed"]),
        Tier("container", ["tests/container"]),  # last: Docker's provisioning runs in the background until then
    ]
    return [compute, beside]


_printing = threading.Lock()
_SUMMARY = re.compile(r"^=+ (.*\b(passed|failed|skipped|error|errors|deselected|no tests ran)\b.*) =+$", re.M)


def run_tier(tier: Tier, pytest_args: list[str], logs: Path) -> None:
    log = logs / f"{tier.name}.log"
    ignored = [f"--ignore={path}" for path in tier.ignore]
    marks = ["-m", tier.marks] if tier.marks else []
    command = [sys.executable, "-m", "pytest", *tier.paths, *ignored, *marks, *pytest_args]
    started = time.monotonic()
    with _printing:
        print(f"tests: {tier.name} started ({' '.join(tier.paths)})", flush=True)
    with open(log, "w") as out:
        tier.code = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
    tier.seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    found = _SUMMARY.findall(text)
    tier.summary = found[-1][0] if found else f"exit {tier.code}"
    with _printing:
        print(f"\n{'=' * 30} tier {tier.name}: {tier.summary} ({tier.seconds:.0f} s) {'=' * 30}", flush=True)
        print(text, end="" if text.endswith("\n") else "\n", flush=True)


def run_lane(tiers: list[Tier], pytest_args: list[str], logs: Path) -> None:
    for tier in tiers:
        run_tier(tier, pytest_args, logs)


def exit_code(tiers: list[Tier]) -> int:
    failed = [t.code for t in tiers if t.code not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(t.code == NO_TESTS for t in tiers) else 0


def table(tiers: list[Tier], seconds: float) -> str:
    rows = [f"  {t.name:<12} {t.seconds:7.0f} s   exit {t.code}   {t.summary}" for t in tiers]
    return "\n".join(["tests: every tier (the two lanes ran at once)", *rows, f"  {'all':<12} {seconds:7.0f} s"])


def main(pytest_args: list[str]) -> int:
    all_lanes = lanes()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="test-tiers-") as folder:
        # One farm of trained runs for every tier (tests/farm.py): the SLURM tier reads the sweep the
        # integration tier trained, whichever asks first builds it.
        os.environ[FARM_ENV] = str(Path(folder) / "farm")
        # Two lanes share the cores: a process with a thread per core (a test computing in pytest itself, a
        # single-rank launch) would spin its OpenMP threads against the other lane's ranks, and two ranks in
        # lockstep wait for each other's time slices. One thread each, as torchrun gives each of 2 ranks here.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        threads = [threading.Thread(target=run_lane, args=(lane, pytest_args, Path(folder))) for lane in all_lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    tiers = [tier for lane in all_lanes for tier in lane]
    print("\n" + table(tiers, time.monotonic() - started), flush=True)
    return exit_code(tiers)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
