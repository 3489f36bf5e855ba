"""Where rank 0's metrics records go: a JSON-lines file and TensorBoard scalars, both in the run directory."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from train import run_files
from train.disk import disk_full_error

# Keys that place a record rather than measure something: not plotted as scalars.
POSITION_KEYS = frozenset({"step", "epoch"})


def _jsonable(value: Any) -> Any:
    """``value`` with NaN/inf as None and numpy scalars as Python numbers, so strict JSON readers accept the line."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _scalar(value: Any) -> float | None:
    """The value as a TensorBoard scalar, or None where it is not a finite number (flags count as not numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@contextlib.contextmanager
def _named(path: Path) -> Iterator[None]:
    """A write of ``path`` that fails on a full disk, as a DiskFullError naming that file."""
    try:
        yield
    except OSError as e:
        full = disk_full_error(e, path)
        if full is None:
            raise
        raise full from e


class MetricsFollower:
    """Follows a metrics.jsonl that rank 0 appends to, for the trackers and a sweep's scheduler: each call of
    :meth:`new_records` returns the records of the whole lines written since the last. Only lines that end in a
    newline are complete (what follows the last one is still being written); a line that is no JSON object (a
    crash cut it) is skipped. A file shorter than what was read (a run folder restored from an older mirror) is
    read again from its start. ``offset``: the bytes read so far, to continue where an earlier process stopped.
    """

    def __init__(self, path: Path | str, offset: int = 0):
        self.path, self.offset = Path(path), offset

    def new_records(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, os.SEEK_END) < self.offset:
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        records = []
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def read_metrics(path: Path | str) -> list[dict]:
    """The records of a metrics.jsonl in file order, also while rank 0 is appending to it (:class:`MetricsFollower`)."""
    return MetricsFollower(path).new_records()


class EventFile:
    """One TensorBoard event file of scalars, written and flushed in the caller's thread.

    Not tensorboardX's SummaryWriter: it hands events to a thread of its own through a bounded queue, and when
    that thread dies (a write that met a full disk) the next ``add_scalar`` blocks forever once the queue is full,
    so the step that called it never ends and the stop flag is never read. Here a failing write raises where
    it happened (a full disk becomes exit 4, like a checkpoint that meets it), and a write is a few hundred
    bytes per logging window. The file starts by telling TensorBoard to purge, from earlier event files in the
    same folder, every event at or after ``purge_step``: after a resume the curves show the run that continued,
    not the steps of the killed run that were redone."""

    def __init__(self, folder: Path, purge_step: int):
        # Imported here: tensorboardX pulls in protobuf, which ranks that never write should not pay for.
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        folder.mkdir(parents=True, exist_ok=True)
        self._event = Event
        self._writer = EventsWriter(str(folder / "events"))  # the file's version record first
        self.path = Path(self._writer._file_name)
        self._writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
        self._writer.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def add(self, scalars: dict[str, float], step: int) -> None:
        from tensorboardX.summary import scalar

        now = time.time()
        for key, number in scalars.items():
            self._writer.write_event(self._event(wall_time=now, step=step, summary=scalar(key, number)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricSinks:
    """Appends each metrics record to ``run_dir/metrics.jsonl`` and plots its numbers in ``run_dir/tensorboard/``.

    ``run_dir=None`` (every rank but 0) makes every method a no-op, so callers need no rank checks.
    The JSON file is flushed per line and opened in append mode: a killed run keeps every line, a resumed run
    continues the same file (so it may hold the steps between the last checkpoint and the kill twice; the later
    line is the one that counts). TensorBoard's events are flushed with each record (:class:`EventFile`), whose
    file starts at the first record's step. No write waits on anything but its own file: a write that fails
    (a full disk) raises in the step that made it.

    Not thread-safe: call it from one thread (the training loop).
    """

    def __init__(self, run_dir: Path | None):
        self._run_dir = run_dir
        self._tensorboard: EventFile | None = None
        self._jsonl = None
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            # Opened here rather than on the first write: a run directory we cannot write to should stop the
            # run before any training, not after the first logging interval.
            self._jsonl = open(run_dir / run_files.METRICS, "a")  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict) -> None:
        """Append ``record`` as one JSON line and add its finite numbers (all but step/epoch) as scalars.

        ``record["step"]`` is the TensorBoard global step and is required whenever the record holds a scalar.
        """
        if self._jsonl is None:
            return
        scalars = {key: value for key, value in record.items() if key not in POSITION_KEYS}
        scalars = {key: number for key, value in scalars.items() if (number := _scalar(value)) is not None}
        if scalars and "step" not in record:
            raise ValueError(f"a metrics record with scalars needs a 'step' to place them: {sorted(record)}")
        assert self._run_dir is not None
        with _named(self._run_dir / run_files.METRICS):
            self._jsonl.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
            self._jsonl.flush()
        if scalars:
            step = int(record["step"])
            with _named(self._tensorboard.path if self._tensorboard else self._run_dir / run_files.TENSORBOARD):
                if self._tensorboard is None:
                    self._tensorboard = EventFile(self._run_dir / run_files.TENSORBOARD, purge_step=step)
                self._tensorboard.add({str(key): number for key, number in scalars.items()}, step)

    def close(self) -> None:
        """Flush and close both sinks; later calls do nothing (and later writes are dropped)."""
        tensorboard, jsonl, self._tensorboard, self._jsonl = self._tensorboard, self._jsonl, None, None
        try:
            if tensorboard is not None:
                tensorboard.close()
        finally:
            if jsonl is not None:
                jsonl.close()

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
