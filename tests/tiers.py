"""``make test``: every tier of the suite, two pytest processes at a time (one per 2 cores where there are more
than 5), each tier (or part of one) a pytest process of its own.

The computing workers (:func:`workers`) take the tiers from one queue, in the order of :func:`queue`: SLURM's
first (its jobs train while its time-limit clock runs), then the longest first, the integration tier in parts of a
few minutes, so that no worker idles while another still has most of the work. The container tier comes after
the long ones: Docker's provisioning runs in the background until then. The waits tier, whose tests wait on
timeouts, runs in a lane of its own beside the computing ones rather than taking one of their places. A
tier's output is held in a log and printed whole when it ends, so two tiers never interleave; each has its own
pytest summary (and ``--durations`` list). The end is a table of every tier: its tests, its result and its wall time.

The exit code is the first failing tier's own (pytest's: 1 a test failed, 2 interrupted, 3 an internal error,
4 a usage error), or 5 when no tier ran a test. ``python -m tests.tiers [pytest arguments]``; the arguments go
to every tier (``-k`` may leave a tier with nothing to run, which alone is no failure; a ``-m`` replaces the
split of tests/integration between its parts and the waits tier).
"""

from __future__ import annotations

import compileall
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


AT_ONCE_ENV = "TRAIN_TEST_TIERS_AT_ONCE"
"""Overrides how many tiers run at once."""


def workers(cores: int | None = None) -> int:
    """Tiers run at once: a tier that trains runs 2 ranks, so one per 2 cores, and at least 2 (CI's 2 cores
    run a tier that waits beside one that computes). A third tier on 2 cores made `.ci/run` slower (1,743 s of
    `make test` against 1,637 s): the machine is busy nearly all the time, and more processes share it worse."""
    if os.environ.get(AT_ONCE_ENV):
        return max(1, int(os.environ[AT_ONCE_ENV]))
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(2, cores // 2)


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
    cpu_seconds: float = 0.0
    """User and system CPU time of the tier's pytest and every process it waited for (not SLURM's jobs nor
    Docker's containers, which their daemons start, nor the ranks tests.helpers.run_ranks forks from its
    forkserver, whose parent never waits for them)."""
    summary: str = ""
    waits: bool = False
    """The tier mostly waits (on timeouts): it runs in a lane of its own beside the computing tiers rather than
    taking one of their places."""


INTEGRATION = "tests/integration"
OUT_OF_CORE = f"{INTEGRATION}/test_out_of_core.py"
# The integration tier's parts, a few minutes each on 2 cores; a file in none of them is in the last part.
PARTS = {
    "integration-1": ["test_bench.py", "test_3d_runs.py"],
    "integration-2": ["test_faults.py", "test_remote_runs.py", "test_tracking.py", "test_data_sources.py"],
    "integration-3": ["test_sweeps.py", "test_models.py", "test_surrogate.py", "test_well_runs.py"],
    "integration-4": ["test_full_disk.py", "test_data_changes.py", "test_trainer_runs.py", "test_launcher_signals.py"],
}


def queue() -> list[Tier]:
    """Every tier, in the order the workers take them."""
    parts = {name: [f"{INTEGRATION}/{file}" for file in files] for name, files in PARTS.items()}
    elsewhere = [OUT_OF_CORE, *(path for paths in parts.values() for path in paths)]
    part = {name: Tier(name, paths, marks="not waits") for name, paths in parts.items()}
    # Longest first, so that the short ones fill in at the end: on 2 cores (the walls of the last clean-clone
    # run: integration-2 418 s, integration-1 404 s, integration-5 347 s, integration-3 317 s, slurm 308 s, unit
    # 286 s, integration-4 223 s, container 181 s, multinode 137 s, distributed 91 s, out-of-core 86 s) the two
    # lanes then end about a minute apart, not three.
    return [
        Tier("slurm", ["tests/slurm"]),  # its jobs train while SLURM's clocks run: it computes
        part["integration-2"],
        part["integration-1"],
        part["integration-3"],
        Tier("unit", ["tests/unit"]),
        Tier("integration-5", [INTEGRATION], ignore=elsewhere, marks="not waits"),
        part["integration-4"],
        Tier("container", ["tests/container"]),  # Docker's provisioning has had a quarter of an hour
        Tier("multinode", ["tests/multinode"]),
        Tier("distributed", ["tests/distributed"]),
        Tier("out-of-core", [OUT_OF_CORE]),
        Tier("waits", [INTEGRATION], ignore=[OUT_OF_CORE], marks="waits", waits=True),
    ]


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
        proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # its own usage: the threads' tiers share this process's
        proc.returncode = tier.code = os.waitstatus_to_exitcode(status)
    tier.cpu_seconds = usage.ru_utime + usage.ru_stime
    tier.seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    found = _SUMMARY.findall(text)
    tier.summary = found[-1][0] if found else f"exit {tier.code}"
    with _printing:
        print(f"\n{'=' * 30} tier {tier.name}: {tier.summary} ({tier.seconds:.0f} s) {'=' * 30}", flush=True)
        print(text, end="" if text.endswith("\n") else "\n", flush=True)


def work(pending: list[Tier], pytest_args: list[str], logs: Path) -> None:
    while True:
        with _printing:
            if not pending:
                return
            tier = pending.pop(0)
        run_tier(tier, pytest_args, logs)


def exit_code(tiers: list[Tier]) -> int:
    failed = [t.code for t in tiers if t.code not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(t.code == NO_TESTS for t in tiers) else 0


def table(tiers: list[Tier], seconds: float) -> str:
    rows = [
        f"  {t.name:<14} {t.seconds:7.0f} s {t.cpu_seconds:7.0f} CPU s   exit {t.code}   {t.summary}" for t in tiers
    ]
    cpu = sum(t.cpu_seconds for t in tiers)
    return "\n".join(
        [
            f"tests: every tier ({workers()} computing at a time, and those that wait)",
            *rows,
            f"  {'all':<14} {seconds:7.0f} s {cpu:7.0f} CPU s",
        ]
    )


def main(pytest_args: list[str]) -> int:
    tiers = queue()
    pending = list(tiers)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="test-tiers-") as folder:
        # One farm of trained runs for every tier (tests/farm.py): the SLURM tier reads the sweep the
        # integration tier trained, whichever asks first builds it.
        os.environ[FARM_ENV] = str(Path(folder) / "farm")
        # Two tiers share the cores: a process with a thread per core (a test computing in pytest itself, a
        # single-rank launch) would spin its OpenMP threads against the other tier's ranks, and two ranks in
        # lockstep wait for each other's time slices. One thread each, as torchrun gives each of 2 ranks here.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # Compiled code for every tier's processes in one place (the launcher's default is each run's cache
        # folder, so that a resume finds it): a step compiled once by a test is loaded, not compiled, by the next.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(folder) / "compiled"))
        # Some 500 processes import the package: compiled once here, not by each of them where
        # PYTHONDONTWRITEBYTECODE is set (pip compiles what it installs, not an editable install's source).
        for package in ("train", "tests"):
            compileall.compile_dir(Path(__file__).parent.parent / package, quiet=1)
        # The computing tiers in workers() lanes; those that mostly wait in one more, in their order.
        computing, waiting = [t for t in pending if not t.waits], [t for t in pending if t.waits]
        lanes = [computing] * workers() + [waiting]
        threads = [threading.Thread(target=work, args=(lane, pytest_args, Path(folder))) for lane in lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    print("\n" + table(tiers, time.monotonic() - started), flush=True)
    return exit_code(tiers)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
