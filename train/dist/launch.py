"""Launch the ranks with torchrun (torch.distributed.run, in process) and pass their exit code through.

torchrun itself exits 1 whatever its workers returned; running its ``run()`` here lets us read every
failed rank's exit code and error file, print one summary and exit with the rank's own code.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import torch

from train.config import Config
from train.errors import DistributedError, PreflightError, TrainError

log = logging.getLogger(__name__)

# What a signal usually means here, for the failure summary.
SIGNAL_HINTS = {
    signal.SIGBUS: "often /dev/shm exhausted (Docker defaults to 64 MB: run with --shm-size or ipc: host)",
    signal.SIGKILL: "killed from outside, often the host's out-of-memory killer (check dmesg)",
    signal.SIGSEGV: "a native crash (library version mismatch or a bug in an extension)",
    signal.SIGTERM: "terminated by the launcher, the scheduler or a user",
}


def resolve_nproc(requested: str | int, cfg: Config) -> int:
    """Processes for this node: one per visible GPU, or dist.cpu_nproc without GPUs, unless set explicitly."""
    value = cfg.dist.nproc if requested in (None, "") else requested
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value == "auto":
        return gpus or cfg.dist.cpu_nproc
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise PreflightError(f"nproc {value!r} (NPROC / --nproc / dist.nproc) must be 'auto' or a positive integer") from None
    if n < 1:
        raise PreflightError(f"nproc must be at least 1, got {n}")
    if gpus and n > gpus and cfg.dist.backend != "gloo":
        raise PreflightError(
            f"nproc={n} but only {gpus} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): ranks would wait forever for GPUs that do not "
            f"exist. Use NPROC=auto or NPROC={gpus}."
        )
    return n


class WorkerFailure(TrainError):
    """A rank exited non-zero; carries the rank's own exit code to the shell."""

    def __init__(self, code: int, summary: str):
        super().__init__(summary)
        self.exit_code = code


def _describe(rank: int, failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if failure.exitcode < 0:
        sig = signal.Signals(-failure.exitcode)
        hint = SIGNAL_HINTS.get(sig, "")
        return f"rank {rank} was killed by {sig.name}{': ' + hint if hint else ''}"
    detail = f": {message}" if message and not message.startswith("To enable traceback") else ""
    return f"rank {rank} exited with code {failure.exitcode}{detail}"


def _blame_order(failure) -> int:
    """Root cause first: a rank killed from outside (SIGKILL, SIGBUS, ...) takes its peers down with it, and
    their errors ("connection reset by peer") are consequences; SIGTERM is what the agent sends to the
    survivors, so it comes last."""
    if failure.exitcode < 0:
        return 3 if -failure.exitcode == signal.SIGTERM else 0
    return 1 if os.path.isfile(failure.error_file) else 2


def launch(run_dir: Path, nproc: int, cfg: Config, worker_args: list[str]) -> None:
    """Run ``python -m train.worker WORKER_ARGS`` on ``nproc`` local ranks; raise WorkerFailure on failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Ranks sharing a CPU must not each start one thread per core: that oversubscribes and crawls.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    log_dir = run_dir / "logs" / "torchrun"
    argv = [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={cfg.dist.max_restarts}",
        f"--log-dir={log_dir}",
        "--module",
        "train.worker",
        *worker_args,
    ]
    log.info("launching %d rank(s): torchrun %s", nproc, " ".join(argv))
    # torchrun's agent turns SIGINT/SIGTERM into exceptions and leaves its handlers installed; put ours back.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        failures = sorted(e.failures.items(), key=lambda item: (_blame_order(item[1]), item[1].timestamp, item[0]))
        lines = [_describe(rank, failure) for rank, failure in failures]
        first = failures[0][1]
        code = first.exitcode if first.exitcode > 0 else DistributedError.exit_code
        summary = "training failed:\n  " + "\n  ".join(lines) + f"\n  per-rank logs: {run_dir / 'logs'}"
        raise WorkerFailure(code, summary) from None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
