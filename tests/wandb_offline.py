"""Reads a W&B offline run back: the records of its run-<id>.wandb file, as the W&B service wrote them.

The file is a LevelDB-style log (a 7-byte ':W&B' header, then 32 KiB blocks of records, each with a 7-byte
header: CRC32C, little-endian length, and a type: full, first, middle or last piece), whose records are
wandb's own protobuf ``Record`` messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is no W&B run file"
    pos, pending, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the rest of a block too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    return out


@dataclass
class OfflineRun:
    id: str = ""
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None
    preempting: bool = False
    config: dict = field(default_factory=dict)
    group: str = ""


def _value(item) -> object:
    return json.loads(item.value_json)


def read_run(path: Path) -> OfflineRun:
    """What one offline run file holds: history rows, the last summary, the exit code, a preempting mark."""
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun()
    for data in raw_records(path):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.id = record.run.run_id
            run.group = record.run.run_group
            run.config.update({i.key: _value(i) for i in record.run.config.update})
        elif kind == "history":
            run.history.append({i.key or "/".join(i.nested_key): _value(i) for i in record.history.item})
        elif kind == "summary":
            run.summary.update({i.key or "/".join(i.nested_key): _value(i) for i in record.summary.update})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
        elif kind == "preempting":
            run.preempting = True
    return run


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    """Every offline run W&B wrote under ``run_dir/wandb`` (one per launch), oldest first."""
    return [read_run(p) for p in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))]
