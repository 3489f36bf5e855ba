"""Tests of the metrics sinks: the JSON-lines file and the TensorBoard event file, both read back from disk."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c

from train.obs.sinks import MetricsFollower, MetricSinks, read_metrics


def _lines(run_dir: Path) -> list[dict]:
    # parse_constant rejects NaN/Infinity: the file must be strict JSON.
    def strict(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return [json.loads(line, parse_constant=strict) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _events(run_dir: Path) -> list[Event]:
    """Every event of every event file under run_dir/tensorboard, read through the TFRecord framing."""
    files = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert files, "no event file written"
    events = []
    for path in files:
        data, at = path.read_bytes(), 0
        while at < len(data):
            header = data[at : at + 8]
            (length,) = struct.unpack("<Q", header)
            (header_crc,) = struct.unpack("<I", data[at + 8 : at + 12])
            assert header_crc == masked_crc32c(header), "corrupt length header"
            body = data[at + 12 : at + 12 + length]
            (body_crc,) = struct.unpack("<I", data[at + 12 + length : at + 16 + length])
            assert body_crc == masked_crc32c(body), "corrupt record"
            events.append(Event.FromString(body))
            at += 16 + length
    return events


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    found: dict[str, list[tuple[int, float]]] = {}
    for event in _events(run_dir):
        for value in event.summary.value:
            found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def test_lines_are_json_with_the_written_values(tmp_path):
    with MetricSinks(tmp_path) as sinks:
        sinks.write({"step": 10, "epoch": 0.5, "loss": 0.25, "loss/advection1d": np.float32(0.125), "note": "warm"})
        sinks.write({"step": 20, "epoch": 1, "val/darcy2d": 0.5, "counts": [1, 2]})
    assert _lines(tmp_path) == [
        {"step": 10, "epoch": 0.5, "loss": 0.25, "loss/advection1d": 0.125, "note": "warm"},
        {"step": 20, "epoch": 1, "val/darcy2d": 0.5, "counts": [1, 2]},
    ]


def test_a_second_writer_appends(tmp_path):
    with MetricSinks(tmp_path) as sinks:
        sinks.write({"step": 1, "loss": 1.0})
    with MetricSinks(tmp_path) as sinks:
        sinks.write({"step": 2, "loss": 0.5})
    assert [line["step"] for line in _lines(tmp_path)] == [1, 2]


def test_lines_reach_the_file_before_close(tmp_path):
    sinks = MetricSinks(tmp_path)
    try:
        sinks.write({"step": 1, "loss": 1.0})
        assert _lines(tmp_path) == [{"step": 1, "loss": 1.0}]
    finally:
        sinks.close()


def test_non_finite_values_are_null_in_json_and_absent_from_tensorboard(tmp_path):
    with MetricSinks(tmp_path) as sinks:
        sinks.write({"step": 3, "loss": math.nan, "lr": math.inf, "grad": -math.inf, "samples_per_s": 7.0})
    assert _lines(tmp_path) == [{"step": 3, "loss": None, "lr": None, "grad": None, "samples_per_s": 7.0}]
    assert _scalars(tmp_path) == {"samples_per_s": [(3, 7.0)]}


def test_tensorboard_holds_the_scalars_at_their_steps(tmp_path):
    with MetricSinks(tmp_path) as sinks:
        sinks.write({"step": 10, "epoch": 0.5, "loss": 0.25, "loss/advection1d": 0.5, "samples_per_s": 100.0})
        sinks.write({"step": 20, "epoch": 1.0, "loss": 0.125, "loss/advection1d": 0.25, "samples_per_s": 200.0})
        sinks.write({"step": 20, "epoch": 1, "val/darcy2d": 0.75, "tag": "text", "ok": True})
    assert _scalars(tmp_path) == {
        "loss": [(10, 0.25), (20, 0.125)],
        "loss/advection1d": [(10, 0.5), (20, 0.25)],
        "samples_per_s": [(10, 100.0), (20, 200.0)],
        "val/darcy2d": [(20, 0.75)],
    }


def test_a_resumed_writer_purges_the_redone_steps(tmp_path):
    with MetricSinks(tmp_path) as sinks:
        sinks.write({"step": 5, "loss": 1.0})
    with MetricSinks(tmp_path) as sinks:
        sinks.write({"step": 3, "loss": 2.0})
    starts = [event.step for event in _events(tmp_path) if event.HasField("session_log")]
    assert 3 in starts, "the second writer must mark step 3 as where its run starts"


def test_no_run_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with MetricSinks(None) as sinks:
        sinks.write({"step": 1, "loss": 1.0})
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_folder_waits_for_the_first_write(tmp_path):
    with MetricSinks(tmp_path):
        pass
    assert not (tmp_path / "tensorboard").exists()


def test_reading_metrics_while_a_record_is_half_written_sees_only_complete_records(tmp_path):
    """A reader polling metrics.jsonl (a test waiting for a step, the report) can catch rank 0 mid-line."""
    path = tmp_path / "metrics.jsonl"
    line = json.dumps({"step": 2, "loss": 0.25}) + "\n"
    path.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n" + line[: len(line) // 2])
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}]
    with open(path, "a") as f:
        f.write(line[len(line) // 2 :])
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text(line[:-3])  # the first line itself unfinished, ending inside a number
    assert read_metrics(path) == []
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_metrics_read_during_a_real_writers_appends_are_always_whole(tmp_path):
    """Another process appends records with the run's own sink while this one reads as fast as it can."""
    import subprocess
    import sys

    writer = (
        "import sys; from pathlib import Path; from train.obs.sinks import MetricSinks\n"
        "s = MetricSinks(Path(sys.argv[1]))\n"
        # no scalars (no TensorBoard); lines up to 12 kB straddle the 8 kB write buffer, so appends land in parts
        "for i in range(2000): s.write({'step': i, 'note': 'x' * (i * 7 % 12000)})\n"
        "s.close()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path)])
    reads = 0
    while proc.poll() is None or reads == 0:
        records = read_metrics(tmp_path / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(len(records)))
        reads += 1
    assert proc.returncode == 0
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2000


def test_the_follower_returns_each_whole_record_once_and_starts_over_on_a_shorter_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path)
    assert follower.new_records() == []  # not written yet
    path.write_bytes(b'{"step": 1}\n{"step": 2}\nnot json\n{"step": 3')
    assert follower.new_records() == [{"step": 1}, {"step": 2}]
    with open(path, "ab") as f:
        f.write(b"}\n")
    assert follower.new_records() == [{"step": 3}] and follower.new_records() == []
    # A run folder restored from an older mirror: the file is shorter than what was read, and grows again.
    path.write_bytes(b'{"step": 1}\n{"step": 2, "again": true}\n')
    assert follower.new_records() == [{"step": 1}, {"step": 2, "again": True}]
    # Another process continues where this one stopped.
    assert MetricsFollower(path, follower.offset).new_records() == []
