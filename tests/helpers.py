"""Helpers shared by the test tiers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def assert_bitwise_equal(weights: dict, reference: dict) -> None:
    """The final weights of an interrupted run are those of the uninterrupted one, bit for bit."""
    assert weights.keys() == reference.keys()
    different = [name for name in weights if not torch.equal(weights[name], reference[name])]
    assert not different, f"weights differ from the uninterrupted run: {different}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, environ: dict, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's, as it is now: the forkserver's is as it was when it started
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)  # torch was imported (by the forkserver) before OMP_NUM_THREADS was set
    # DataLoader workers forked, as a torchrun rank's are (a process the forkserver started would start its own
    # children through a forkserver too).
    mp.set_start_method("fork", force=True)
    fn(rank, *args)


# Importing torch costs a process seconds of CPU on CI's two cores: the ranks are forked from one server that
# imported it once per test process (multiprocessing's forkserver), a process of its own with no thread and no
# process group, rather than each one importing it again.
mp.set_forkserver_preload(["torch", "torch.distributed", "train.engine.trainer", "tests.helpers"])


def run_ranks(fn: Callable, world_size: int, *args) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` new processes set up like torchrun's ranks (gloo)."""
    mp.start_processes(
        _entry, args=(fn, world_size, free_port(), dict(os.environ), args), nprocs=world_size, start_method="forkserver"
    )


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m train ARGS`` in a subprocess; returns the completed process (never raises on failure).
    ``env``: variables to set, or to unset where the value is None."""
    environ = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in environ.items() if v is not None},
    )


def folders(tmp: Path) -> list[str]:
    """--set overrides that keep data, caches and runs of a test inside its tmp folder."""
    return [
        "--set", f"run.data_dir={tmp / 'data'}",
        "--set", f"run.cache_dir={tmp / 'cache'}",
        "--set", f"run.runs_dir={tmp / 'runs'}",
    ]  # fmt: skip


def prepare_run(
    tmp: Path, config: str | Path = "configs/tiny.yaml", overrides: list[str] = (), name: str = "run"
) -> Path:
    """Data, caches and run folder of a config inside ``tmp``, as the launcher prepares them; returns the run
    folder that rank processes read (config.yaml, inputs.json)."""
    from train.config import load_config
    from train.data.acquire.sources import stage_data
    from train.pipeline import stage_cache
    from train.run_dir import RunDir

    cfg = load_config(
        REPO / config,
        [f"run.data_dir={tmp / 'data'}", f"run.cache_dir={tmp / 'cache'}", f"run.runs_dir={tmp / 'runs'}", *overrides],
        run_name=name,
    )
    folders = stage_cache(cfg, stage_data(cfg))
    run = RunDir.of(cfg)
    run.prepare(cfg)
    run.write_inputs(folders)
    return run.root


def rank_trainer(run_dir: Path):
    """In a rank process started by run_ranks: join the gloo group and build the run's Trainer."""
    from train.distributed.env import DistEnv, init_distributed
    from train.engine.trainer import Trainer
    from train.obs.log import setup_logging
    from train.run_dir import RunDir

    run = RunDir(run_dir)
    cfg = run.load_config()
    env = init_distributed(DistEnv.from_environ("gloo"), 60)
    setup_logging(f"rank{env.rank}", run.rank_log(env.rank), console=False)
    return Trainer(cfg, env, run.load_tasks(cfg), run)


def local_trainer(run_dir: Path):
    """The run's Trainer in this process, as rank 0 of a gloo group of one (made on first use)."""
    import torch.distributed as dist

    from train.distributed.env import DistEnv, init_distributed
    from train.engine.trainer import Trainer
    from train.run_dir import RunDir

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")  # fmt: skip
        init_distributed(DistEnv.from_environ("gloo"), 60)
    run = RunDir(run_dir)
    cfg = run.load_config()
    return Trainer(cfg, DistEnv.from_environ("gloo"), run.load_tasks(cfg), run)


_startup: list[tuple[float, float]] = []  # (when measured, seconds)
_remeasuring = threading.Lock()


def _measure_startup() -> None:
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch.distributed.run, train.pipeline"], cwd=REPO, check=True)
    _startup.append((time.monotonic(), time.monotonic() - start))


def _remeasure_startup() -> None:
    try:
        _measure_startup()
    finally:
        _remeasuring.release()


def startup_s() -> float:
    """Seconds this machine takes, now, to start a launcher (Python, torch and the package imported).

    Tests that wait on other processes size their deadlines in multiples of it, so a deadline that holds on a
    quiet machine holds on a busy one too. Only the first call of a test process waits for the measurement
    (the helpers that start a launch make it before they start it); a figure over a minute old is measured again
    in the background (the load of a shared machine changes during a session). A call never blocks while a
    launch it times runs: on a busy machine, measuring took as long as a whole tiny run, which ended before the
    test began to watch it."""
    if not _startup:
        _measure_startup()
    elif time.monotonic() - _startup[-1][0] > 60 and _remeasuring.acquire(blocking=False):
        threading.Thread(target=_remeasure_startup, daemon=True).start()
    return _startup[-1][1]


def launch_in_background(*args: str, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """``python -m train ARGS`` started in a session of its own (the test can signal the whole job), output
    captured as text; with ``log``, both go to that file instead, to be polled while the launch runs."""
    startup_s()  # measured before the launch: the caller's deadline must not cost the launch's time
    output = open(log, "w") if log is not None else None  # noqa: SIM115 - closed once the child holds it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "train", *args],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=output or subprocess.PIPE,
            stderr=subprocess.STDOUT if output else subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    finally:
        if output is not None:
            output.close()


def wait_for(condition: Callable[[], bool], what: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``condition`` every 10 ms until it holds; fail naming ``what`` (and ``proc``'s output if it ended)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            output = proc.communicate()[1][-3000:]
            raise AssertionError(f"the process ended ({proc.returncode}) before {what}: {output}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.01)


def unavailable(reason: str, required_by: str) -> None:
    """A tier's engine or cluster is missing: skip with the reason, or fail where the environment variable
    ``required_by`` says the tier must run (CI sets it)."""
    import pytest

    if os.environ.get(required_by, "") not in ("", "0"):
        pytest.fail(f"{reason} ({required_by} is set)")
    pytest.skip(reason)


def mount_namespace_problem() -> str | None:
    """Why a private mount namespace with a tmpfs of its own cannot be made here (root and unshare are
    needed), or None when it can."""
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"a private mount namespace is not permitted here: {probe.stderr.strip()}"
    return None


def in_namespace_with_tmpfs(
    folder: Path, size: str, *command: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``command`` in a private mount namespace where ``folder`` is a fresh tmpfs of ``size`` (e.g. '4m'):
    a small disk (or /dev/shm) that nothing outside the command sees."""
    script = f'mount -t tmpfs -o size={size} tmpfs "{folder}" && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
