"""``val_fraction: 0``, said plainly: nothing carved and nothing warned, no val split in the report, and the run's
model is its last step's checkpoint, which Surrogate.load says it took."""

from __future__ import annotations

import json
import logging

import pytest

from tests.unit.test_report import _data, _results
from tests.unit.test_use import ADV, _checkpoint
from train.config import validate
from train.data.acquire.generate import generate
from train.data.acquire.sources import stage_data
from train.data.cache.build import build_cache
from train.obs.report import write_report


@pytest.mark.parametrize("val_fraction", [0.0, 0.2])
def test_no_val_file_and_val_fraction_0_carves_nothing_and_warns_of_nothing(tmp_path, caplog, val_fraction):
    folder = tmp_path / "own"
    generate("advection1d", folder / "adv_Train.hdf5", n_samples=20, resolution=32, coefficient=0.1, seed=1)
    task = {"pde": "advection1d", "source": str(folder), "templates": ["adv_{Split}.hdf5"]}
    cfg = validate({"tasks": {"adv": {**task, "val_fraction": val_fraction}}}, "test")
    caplog.set_level(logging.INFO, "train.data")
    files = stage_data(cfg)["adv"]
    info = build_cache("adv", cfg.tasks["adv"], files, tmp_path / "cache")
    warnings, val = files.provenance.warnings, files.provenance.origins["val"]
    if val_fraction:  # carving, the other case, still says so: the test can tell the two apart
        assert val["origin"] == "carved" and any("no val file" in w for w in warnings)
        assert info.sizes["val"] == 4
        return
    assert val == {"origin": "none"} and not any("no val file" in w for w in warnings)
    assert "no val split (tasks.adv.val_fraction is 0)" in caplog.text
    assert info.sizes == {"train": 18, "val": 0, "test": 2}


def test_the_report_lists_no_split_the_run_has_none_of(tmp_path):
    run = tmp_path / "runs" / "own"
    (run / "checkpoints").mkdir(parents=True)
    data = _data(["adv"])
    data["adv"]["val"] = {"file": "/data/x.h5", "samples": [3, 3], "carved": True}
    write_report(run, _results(["adv"]), run / "checkpoints" / "step_00000010.pt", data, {})
    assert set(json.loads((run / "report" / "summary.json").read_text())["adv"]["data"]) == {"train", "test"}
    md = (run / "report" / "summary.md").read_text()
    assert "| adv | train |" in md and "| adv | val |" not in md


def test_a_run_without_best_pt_loads_its_last_step_and_says_so(tmp_path, caplog):
    from train.use.surrogate import Surrogate

    best, _, _ = _checkpoint(tmp_path, "fno", {"adv": ADV})
    checkpoints = tmp_path / "runs" / "own" / "checkpoints"
    checkpoints.mkdir(parents=True)
    step = checkpoints / "step_00000010.pt"
    step.write_bytes(best.read_bytes())
    caplog.set_level(logging.INFO, "train.use")
    surrogate = Surrogate.load(tmp_path / "runs" / "own")
    assert surrogate.checkpoint == step and "no best.pt" in surrogate.chosen
    assert f"loaded {step} (the newest step checkpoint" in caplog.text
    (checkpoints / "best.pt").write_bytes(best.read_bytes())
    surrogate = Surrogate.load(tmp_path / "runs" / "own")
    assert surrogate.checkpoint.name == "best.pt" and "best validation score" in surrogate.chosen
    assert Surrogate.load(step).chosen == "as given"
