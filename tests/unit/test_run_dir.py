"""The run folder contract: what the launcher writes is what a rank reads."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.helpers import REPO
from train.config import load_config
from train.data.acquire.sources import Provenance
from train.errors import ConfigError, DataError
from train.run_dir import LaunchRecord, RunDir, rank_arguments


def config(tmp_path, *overrides: str):
    return load_config(REPO / "configs" / "tiny.yaml", [f"run.runs_dir={tmp_path / 'runs'}", *overrides], run_name="r")


def test_the_launch_record_tells_the_rank_whether_the_console_is_live(tmp_path):
    run = RunDir(tmp_path / "run")
    for live in (True, False):
        path = run.write_launch_record(1, run.lock_paths(1)[1], live)
        parsed, record, rest = rank_arguments(["--run-dir", str(run.root), "--launch-record", str(path), "--x"])
        assert parsed.root == run.root and rest == ["--x"]
        assert record.live_console is live
        assert record.launcher_pid == os.getpid() and record.ranks_lock == str(run.root / ".ranks-node1.lock")
        assert abs(record.started_at - time.time()) < 60
    # A rank started without a launcher (by hand, by a test harness) has no record.
    assert rank_arguments(["--run-dir", str(run.root)])[1] is None


def test_an_unreadable_launch_record_is_named(tmp_path):
    bad = tmp_path / "launch-node0.json"
    bad.write_text("{")
    with pytest.raises(DataError, match=r"launch-node0\.json"):
        LaunchRecord.read(bad)


def test_prepare_refuses_a_folder_that_holds_a_different_run(tmp_path):
    run = RunDir.of(config(tmp_path))
    run.prepare(config(tmp_path))
    assert run.load_config().train.lr == config(tmp_path).train.lr and run.logs.is_dir()
    with pytest.raises(ConfigError, match="different config"):
        run.prepare(config(tmp_path, "train.lr=0.5"))
    run.prepare(config(tmp_path, "train.lr=0.5"), same_run=False)  # the smoke test's folder takes any config
    assert run.load_config().train.lr == 0.5


def test_the_preempted_marker_round_trip(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    assert not run.preempted
    run.mark_preempted({"global_step": 3})
    assert run.preempted
    run.clear_preempted()
    assert not run.preempted


def test_inputs_record_where_each_split_came_from(tmp_path):
    cache = tmp_path / "cache" / "adv" / "abc"
    cache.mkdir(parents=True)
    manifest = {
        "splits": {
            "train": {"file": "/old/name.h5", "samples": [4, 40], "carved": False},
            "val": {"file": "/old/name.h5", "samples": [0, 4], "carved": True},
            "test": {"file": "/data/test.h5", "samples": [0, 10], "carved": False},
        },
        "source": {"train": {"path": "/data/train.h5", "xxh3_128": "aa" * 16}, "test": {"xxh3_128": "bb" * 16}},
    }
    (cache / "manifest.json").write_text(json.dumps(manifest))
    b2 = {"origin": "b2", "file": "/data/train.h5", "url": "b2://bkt/p/train.h5", "bucket": "bkt", "key": "p/train.h5"}
    carved = {"origin": "carved", "file": "/data/train.h5", "carved_from": "b2://bkt/p/train.h5", "convention": "c"}
    local = {"origin": "local", "file": "/data/test.h5", "size": 7, "modified": "2025-01-02T03:04:05.000Z"}
    provenance = Provenance({"train": b2, "val": carved, "test": local}, ("data adv: no val file",))
    folders = {"adv": {"cache": str(cache), "latent": None}, "darcy": {"cache": str(cache), "latent": None}}
    run = RunDir(tmp_path / "run")
    run.root.mkdir()

    run.write_inputs(folders, {"adv": provenance, "darcy": None})

    inputs = json.loads(run.inputs.read_text())
    assert inputs["darcy"] == {"cache": str(cache), "latent": None}  # no provenance, nothing made up
    assert inputs["adv"] == {
        "cache": str(cache),
        "latent": None,
        "data": {
            "train": {**b2, "samples": [4, 40], "carved": False, "xxh3_128": "aa" * 16},
            "val": {**carved, "samples": [0, 4], "carved": True},
            "test": {**local, "samples": [0, 10], "carved": False, "xxh3_128": "bb" * 16},
        },
        "data_warnings": ["data adv: no val file"],
    }
    assert run.load_data() == {"adv": {"data": inputs["adv"]["data"], "data_warnings": ["data adv: no val file"]}}
