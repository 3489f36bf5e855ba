"""Memory figures of live processes, read from /proc, and the bytes in use on /dev/shm."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def pss_bytes(pid: int) -> int:
    """Proportional set size: private pages plus each shared page divided by the number of its mappers.

    Summed over processes it counts a page shared by all of them once, which is what "the memory the data
    costs" must do when every rank and worker maps the same cache.
    """
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (e.g. a rank's DataLoader workers)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # a thread that just ended
            continue
    return sorted(set(found))


def shm_used_bytes(path: str = "/dev/shm") -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def shm_size_bytes(path: str = "/dev/shm") -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


class ShmPeak:
    """Samples the bytes used on /dev/shm in a background thread; ``peak`` is the most seen above the start."""

    def __init__(self, path: str = "/dev/shm", interval_s: float = 0.002):
        self.path, self.interval_s = path, interval_s
        self.start = shm_used_bytes(path)
        self._peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, shm_used_bytes(self.path))
            time.sleep(self.interval_s)

    def __enter__(self) -> ShmPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(self._peak, shm_used_bytes(self.path)) - self.start
