"""One process at a time per folder on this node: the others wait, then find the work done.

The data and cache stages run in every launcher of a job; where several launchers share a node (or a
folder), one downloads or builds and the others wait for it instead of racing it. A lock held by a process
that died is released with it (``filelock`` uses ``flock``), so a killed build never blocks the next one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)


@contextlib.contextmanager
def node_lock(lock_file: Path, waiting_for: str) -> Iterator[None]:
    """Hold ``lock_file`` for the block; when another process holds it, log "waiting for ``waiting_for``" once
    and wait (a signal still stops the wait: see the launcher's stop handling)."""
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_file))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for %s", waiting_for)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
