"""One launch per run folder, held until the last process of that launch is gone.

Two launches into one run folder would both train, append to the same metrics, corrupt the TensorBoard file
and resume from each other's checkpoints. So the launcher takes an exclusive lock on the folder for the whole
launch (every stage, every torchrun restart) and a second launch fails at once, naming the holder.

The ranks outlive nothing (train.distributed.lifeline): each dies with its launcher and holds a shared lock
of its own that its DataLoader workers inherit. A new launch waits briefly for that lock too, so it never
starts while processes of the previous launch still run.

``flock`` locks belong to open files, not to paths: a process that dies releases them, so a lock left by a
dead launch never blocks the next one, whatever the lock file still says.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from datetime import datetime
from pathlib import Path

from train.errors import PreflightError
from train.run_dir import RunDir

log = logging.getLogger(__name__)

# A rank dies with its launcher at once; its DataLoader workers notice within a few seconds.
RANK_EXIT_GRACE_S = 15.0


def try_flock(fd: int, mode: int) -> bool:
    """``flock`` without waiting: False when another open file holds a conflicting lock."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return False
        raise
    return True


def _describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']} ({holder['command']})"
    except (OSError, ValueError, KeyError):
        return f"a process that has not yet written {path}"


class RunLock:
    """The launcher's exclusive lock on a run folder; a context manager."""

    def __init__(self, run: RunDir, node_rank: int = 0):
        self.run_dir = run.root
        self.path, self.ranks_path = run.lock_paths(node_rank)
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if not try_flock(fd, fcntl.LOCK_EX):
            os.close(fd)
            raise PreflightError(
                f"{self.run_dir} is in use by another launch: {_describe_holder(self.path)}. Wait for it to end or "
                "stop it, or give this run another name (RUN=... or --run)"
            )
        try:
            self._wait_for_ranks_of_earlier_launch()
            holder = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": " ".join(sys.argv[1:]) or "python -m train",
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _wait_for_ranks_of_earlier_launch(self) -> None:
        fd = os.open(self.ranks_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            deadline = time.monotonic() + RANK_EXIT_GRACE_S
            while not try_flock(fd, fcntl.LOCK_EX):
                if time.monotonic() > deadline:
                    raise PreflightError(
                        f"processes of an earlier launch in {self.run_dir} are still running after "
                        f"{RANK_EXIT_GRACE_S:.0f}s (they hold {self.ranks_path}; `fuser -v {self.ranks_path}` lists "
                        "them): stop them before launching again"
                    )
                time.sleep(0.2)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the lock
            self._fd = None
