"""A rank's tie to its launcher: it dies with it, and holds the ranks' lock while it lives.

A rank asks the kernel to kill it when its launcher dies (a parent-death signal): ``kill -9`` of the
launcher, the OOM killer or ``timeout -s KILL`` leave no orphans training unseen. It also holds a shared lock
that its DataLoader workers inherit (they exit within seconds of their rank, by PyTorch's own watch on their
parent); the next launch into the same run folder waits for that lock (train.launch.run_lock).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

_held: list[int] = []  # the rank's lock descriptor, open for the life of the process


def set_parent_death_signal(sig: int) -> None:
    """Ask the kernel to send this process ``sig`` when its parent dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        log.warning("could not ask to be killed with the launcher: %s", os.strerror(ctypes.get_errno()))


def hold_for_launcher(launcher_pid: int, ranks_lock: str) -> None:
    """In a rank, first thing: die with the launcher ``launcher_pid``, and hold ``ranks_lock`` (shared) while
    alive. Called once per process."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher_pid:
        os._exit(128 + signal.SIGKILL)  # the launcher died before the signal was armed: behave as if it fired
    if not _held:
        # Forked DataLoader workers share this descriptor (and so the lock); programs the rank executes do not.
        fd = os.open(ranks_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _held.append(fd)
