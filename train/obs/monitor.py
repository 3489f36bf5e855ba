"""What the training loop reports: loss and throughput per logging window, memory, time spent waiting for data,
and a progress bar."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from train.obs.procmem import shm_used_bytes

MIB = float(1 << 20)
SHM = "/dev/shm"

progress_log = logging.getLogger("train.progress")


def _rss_bytes() -> int:
    """Resident set of this process now; off Linux, its peak so far (all ``getrusage`` offers)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # macOS reports bytes, the BSDs (and Linux) kilobytes.
    return peak if sys.platform == "darwin" else peak * 1024


def system_figures(device: torch.device) -> dict[str, float]:
    """Memory figures in MiB for a metrics record: ``rss_mib``, ``shm_used_mib`` (where /dev/shm exists) and on
    CUDA ``gpu_mem_mib``/``gpu_reserved_mib``, the device's peak allocated/reserved memory since the previous call
    (the peak statistics are reset on each call, so there should be one caller per process).
    """
    figures = {"rss_mib": _rss_bytes() / MIB}
    if Path(SHM).is_dir():
        figures["shm_used_mib"] = shm_used_bytes(SHM) / MIB
    if device.type == "cuda":
        figures["gpu_mem_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        figures["gpu_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)
    return figures


class _Fetching:
    """The context of one fetch: adds its duration to the owning DataWait."""

    __slots__ = ("_start", "_wait")

    def __init__(self, wait: DataWait):
        self._wait = wait
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        # Counted even when the fetch raises (StopIteration at the end of an epoch): the time was spent waiting.
        self._wait._waited += time.perf_counter() - self._start


class DataWait:
    """The fraction of wall time a loop spends waiting for its data.

    ``with wait.fetching(): batch = next(iterator)`` around every fetch, then ``wait.take()`` at each logging
    interval. Not thread-safe, and fetches must not nest.
    """

    def __init__(self):
        self._waited = 0.0
        self._window_start = time.perf_counter()
        self._fetch = _Fetching(self)

    def fetching(self) -> _Fetching:
        """A context manager whose time inside counts as waiting for data."""
        return self._fetch

    def take(self) -> float:
        """The fraction (0 to 1) of the wall time since the previous take (or construction) spent fetching;
        starts a new window."""
        now = time.perf_counter()
        elapsed = now - self._window_start
        fraction = self._waited / elapsed if elapsed > 0 else 0.0
        self._waited, self._window_start = 0.0, now
        return min(1.0, fraction)


class _LogLines:
    """A file for tqdm to draw into that turns each redraw ("\\r" + the bar's text) into one log line."""

    # Cursor movements tqdm adds when other bars are open in the process: meaningless in a log.
    ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._last = ""

    def write(self, text: str) -> int:
        for piece in re.split(r"[\r\n]", self.ANSI.sub("", text)):
            line = piece.strip()
            # tqdm writes "" to probe the file and blanks to clear the bar; a close right after a redraw
            # repeats the same text.
            if line and line != self._last:
                self._logger.info("%s", line)
                self._last = line
        return len(text)

    def flush(self) -> None:
        pass


class Progress:
    """A tqdm progress bar over ``total`` steps, starting at ``initial``, for rank 0.

    ``enabled=False``: no output at all. ``live=True`` (the console is a terminal): a redrawn bar on stderr,
    and while it is open the root logger's console handlers write through ``tqdm.write`` so log lines do not
    break it. ``live=False`` (a log file, CI, SLURM): the bar's text becomes an INFO line on the
    "train.progress" logger when it opens, at most every ``line_interval_s`` seconds and once on close.

    Open it after logging is set up and close it before logging is set up again: in live mode the console
    handlers are swapped while the bar is open and put back on close. Not thread-safe.
    """

    def __init__(self, total: int, initial: int, desc: str, enabled: bool, live: bool, line_interval_s: float = 30.0):
        self._bar: tqdm | None = None
        self._redirect = None
        if not enabled:
            return
        common = {"total": total, "initial": initial, "desc": desc, "unit": "step", "leave": True}
        if live:
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
            self._bar = tqdm(file=sys.stderr, **common)
        else:
            # miniters=1 keeps tqdm's monitor thread from redrawing out of turn; mininterval is then the only
            # throttle, checked by the update that follows it.
            self._bar = tqdm(
                file=_LogLines(progress_log),
                mininterval=line_interval_s,
                miniters=1,
                position=0,
                ascii=True,
                dynamic_ncols=False,
                **common,
            )

    def update(self, n: int = 1, **postfix) -> None:
        """Advance by ``n`` steps; keyword arguments (e.g. ``loss=0.12``) replace the figures after the bar."""
        if self._bar is None:
            return
        if postfix:
            # No redraw of its own: the update below redraws when its interval has passed.
            self._bar.set_postfix(refresh=False, **postfix)
        self._bar.update(n)

    def close(self) -> None:
        """Draw the final state (in line mode: log it) and give the console handlers back; idempotent."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
