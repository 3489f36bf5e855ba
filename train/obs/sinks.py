"""Where rank 0's metrics records go: a JSON-lines file and TensorBoard scalars, both in the run directory."""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any

from train import run_files

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


def read_metrics(path: Path | str) -> list[dict]:
    """The records of a metrics.jsonl in file order, also while rank 0 is appending to it: only lines that end in
    a newline are complete, and a line that is no JSON object (a crash cut it) is skipped."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    records = []
    for line in data.split(b"\n")[:-1]:  # what follows the last newline is still being written
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricSinks:
    """Appends each metrics record to ``run_dir/metrics.jsonl`` and plots its numbers in ``run_dir/tensorboard/``.

    ``run_dir=None`` (every rank but 0) makes every method a no-op, so callers need no rank checks.
    The JSON file is flushed per line and opened in append mode: a killed run keeps every line, a resumed run
    continues the same file (so it may hold the steps between the last checkpoint and the kill twice; the later
    line is the one that counts). TensorBoard events are flushed by a background thread every ``flush_secs``.
    On the first write the TensorBoard writer is told to purge, from earlier event files in the same folder,
    every event at or after that record's step: after a resume the curves show the run that continued, not
    the steps of the killed run that were redone.

    Not thread-safe: call it from one thread (the training loop).
    """

    def __init__(self, run_dir: Path | None, flush_secs: int = 5):
        self._run_dir = run_dir
        self._flush_secs = flush_secs
        self._tensorboard = None
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
        self._jsonl.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        self._jsonl.flush()
        if scalars:
            step = int(record["step"])
            writer = self._writer(step)
            for key, number in scalars.items():
                writer.add_scalar(str(key), number, global_step=step)

    def _writer(self, first_step: int):
        if self._tensorboard is None:
            # Imported here: tensorboardX pulls in protobuf, which ranks that never write should not pay for.
            from tensorboardX import SummaryWriter

            assert self._run_dir is not None
            self._tensorboard = SummaryWriter(
                logdir=str(self._run_dir / run_files.TENSORBOARD), flush_secs=self._flush_secs, purge_step=first_step
            )
        return self._tensorboard

    def close(self) -> None:
        """Flush and close both sinks; later calls do nothing (and later writes are dropped)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
