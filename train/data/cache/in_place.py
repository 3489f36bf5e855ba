"""Caches that map a dataset where it lies in its source file instead of copying it.

A PDEBench single-file dataset stored uncompressed and contiguous as little-endian float32 (how PDEBench
publishes them) is, byte for byte, the array a cache would hold when the run uses all of it, unstrided: its
(N, t, *space) samples are the (N, t, *space, 1) trajectories of a one-field family, or one channel of a
several-field family (CFD's density, pressure, velocities). Such a cache holds no array at all, only where
each field lies in the file; reads normalise per batch (train.data.cache.cached_array). Its build reads every byte
once, sequentially, to take the train split's statistics and to refuse non-finite values, as a copying build
would, and writes nothing but its manifest. Which sources qualify is the format's to say (``Format.in_place``):
PDEBench's single files, and neuraloperator's zip-format ``.pt`` files of contiguous float32 tensors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

import numpy as np

from train.config import TaskConfig
from train.data.cache.cached_array import Field
from train.data.cache.running_stats import RunningStats
from train.data.formats import format_of
from train.errors import DataError, StopRequested
from train.pdes import LAYOUTS

SCAN_BLOCK_BYTES = 32 << 20


@dataclass(frozen=True)
class Placed:
    """One cached array in place: its fields (one per channel) and the samples ``first..first + count``."""

    fields: tuple[Field, ...]
    first: int
    count: int
    keys: tuple[str, ...]

    def record(self) -> dict:
        return {"fields": [f.record() for f in self.fields], "first": self.first, "count": self.count}


def locate(path: Path, keys: tuple[str, ...], task: TaskConfig) -> tuple[Field, ...] | None:
    """Where each of ``keys`` lies in ``path``, when the task reads them whole and unstrided and the format finds
    them stored as the cache would hold them (``Format.in_place``: plain little-endian float32, samples first,
    uncompressed); None when the cache must copy."""
    layout, places = LAYOUTS[task.pde], format_of(task.pde).in_place
    whole = task.spatial_stride == 1 and (not layout.autoregressive or task.temporal_stride == 1)
    found = places(Path(path), keys, task) if places is not None and whole else None
    return (
        tuple(
            Field(str(Path(file).resolve()), int(offset), tuple(shape), *rest)
            for file, offset, shape, *rest in found or ()
        )
        or None
    )


def file_identity(path: str | Path) -> list[int]:
    """What a mapped source must still be when the cache is used: size, modification time, inode and change
    time. A rewrite that restores the size and mtime (``os.utime``, ``touch -r``, ``cp -p``) still moves the
    ctime, which user space cannot set; a file replaced by another gets another inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def same_identity(recorded: list[int], now: list[int]) -> bool:
    """Whether a file is still the one ``recorded`` (a cache built before inode and ctime were recorded holds
    size and mtime only: those are compared)."""
    return now[: len(recorded)] == list(recorded)


class ChannelStats:
    """Per-field running statistics of the train split, fed with flat float32 blocks (one field at a time)."""

    def __init__(self, n_fields: int):
        self.fields = [RunningStats() for _ in range(n_fields)]

    def update(self, field: int, block: np.ndarray) -> None:
        self.fields[field].update(block.reshape(-1, 1))

    def result(self, std_floor: float | None) -> tuple[np.ndarray, np.ndarray]:
        means, stds = zip(*(acc.result(std_floor) for acc in self.fields), strict=True)
        return np.concatenate(means), np.concatenate(stds)


def _byte_ranges(placed: Placed) -> Iterator[tuple[int, Field, int, int]]:
    """(field number, field, first sample, end sample) of every block to read, in file order per field."""
    for i, field in enumerate(placed.fields):
        row = 4 * int(np.prod(field.shape[1:]))
        step = max(1, SCAN_BLOCK_BYTES // row)
        for start in range(placed.first, placed.first + placed.count, step):
            yield i, field, start, min(start + step, placed.first + placed.count)


def _read_ahead(placed: Placed, out: Queue, stop: threading.Event) -> None:
    """Read blocks into fresh buffers on a thread (the read releases the GIL): the scan's arithmetic on one
    block overlaps the disk's read of the next."""
    try:
        for i, field, start, end in _byte_ranges(placed):
            if stop.is_set():
                break
            row = 4 * int(np.prod(field.shape[1:]))
            buffer = np.empty((end - start) * row // 4, np.float32)
            with open(field.file, "rb", buffering=0) as f:
                f.seek(field.offset + start * row)
                view, done = memoryview(buffer).cast("B"), 0
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        raise DataError(f"{field.file}: the file ends inside a dataset; re-create or re-download it")
                    done += n
            out.put((i, start, buffer))
    except BaseException as e:  # handed to the consumer, which raises it
        out.put(e)
    out.put(None)


def scan(placed: Placed, stats: ChannelStats | None) -> None:
    """Read ``placed``'s samples once, front to back: refuse non-finite values, feed ``stats`` (the train split)."""
    blocks: Queue = Queue(maxsize=2)
    stop = threading.Event()
    reader = threading.Thread(target=_read_ahead, args=(placed, blocks, stop), name="cache-scan", daemon=True)
    reader.start()
    finished = False
    try:
        while (item := blocks.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            StopRequested.check()
            i, start, block = item
            block = placed.fields[i].pick(block.reshape(-1, *placed.fields[i].shape[1:]))
            if not np.isfinite(block).all():
                row = int(np.prod(placed.fields[i].sample_shape))
                bad = start + int(np.flatnonzero(~np.isfinite(block))[0]) // row
                name = placed.fields[i].file
                raise DataError(f"{name}: non-finite values (NaN/Inf) in '{placed.keys[i]}' at sample {bad}")
            if stats is not None:
                stats.update(i, block)
        finished = True
    finally:
        stop.set()
        # Unblock a reader waiting on the full queue; it puts None last, whatever ended it.
        while not finished and blocks.get() is not None:
            pass
        reader.join()
