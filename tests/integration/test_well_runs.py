"""Well datasets through the whole pipeline: trained together with a PDEBench task on 2 ranks, from a folder and
from a (simulated) B2 bucket, and bad datasets stopped with their exit codes before anything is cached."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest

from tests.b2sim import Account
from tests.helpers import folders, run_cli
from tests.well_files import channel_names, write_dataset, write_stats
from train.config import validate
from train.data.acquire import download
from train.data.acquire.sources import stage_data

pytestmark = pytest.mark.integration


def _well(source: Path, *more: str) -> list[str]:
    return [
        "--set", "tasks.rich.pde=well", "--set", f"tasks.rich.source={source}",
        "--set", "tasks.rich.well.n_steps_input=2", "--set", "tasks.rich.batch_size=4", *more,
    ]  # fmt: skip


def test_a_pdebench_task_and_a_well_task_train_together(tmp_path):
    root = write_dataset(tmp_path / "rich", 2)
    write_stats(root)
    sets = ["--set", "model.name=fno", "--set", "model.fno.width=8", "--set", "model.fno.modes=4"]
    args = ["--config", "configs/tiny.yaml", "--nproc", "2", *folders(tmp_path), *_well(root), *sets]
    proc = run_cli("run", *args, "--set", "tasks.darcy2d.source=generate", "--run", "mixed", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "mixed"
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert set(summary) == {"advection1d", "darcy2d", "rich"} and "well" not in summary["advection1d"]
    well = summary["rich"]["well"]
    assert well["statistics"] == "stats.yaml"
    fields = channel_names(2)
    for part in ("one_step", "baseline_one_step", "rollout"):
        assert sorted(well[part]["vrmse_by_field"]) == sorted(fields) == sorted(well[part]["nrmse_by_field"])
        assert all(v > 0 for v in well[part]["vrmse_by_field"].values())
    assert len(well["rollout"]["vrmse_by_step"]) == 9 - 2 and "vrmse_6_12" not in well["rollout"]  # 7 < 12 steps
    md = (run / "report" / "summary.md").read_text()
    assert "## rich: The Well's metrics" in md and "| stress_yx |" in md
    # Each file of a split is in the run's record, with its own checksum.
    data = json.loads((run / "inputs.json").read_text())["rich"]["data"]
    assert [Path(f["file"]).name for f in data["train"]["files"]] == ["rich_0.hdf5", "rich_1.hdf5"]
    assert all(len(f["xxh3_128"]) == 32 for split in data.values() for f in split["files"])
    assert data["val"]["samples"] == [0, 3] and data["test"]["samples"] == [0, 2]


@pytest.mark.parametrize(
    ("damage", "code", "message"),
    [
        ("empty", 3, "/data/train/*.hdf5\n  (fix tasks.rich.source"),
        ("group", 3, "rich_1.hdf5: group 'scalars' missing"),
        ("resolution", 3, "rich_1.hdf5: resolution [8, 4] differs from [8, 6]"),
        ("name", 3, "rich_1.hdf5: dataset_name other differs from rich"),
        ("window", 2, "spans 10 saved steps, longer than the trajectories' 9"),
    ],
)
def test_a_bad_dataset_is_refused_with_its_exit_code_and_no_partial_cache(tmp_path, damage, code, message):
    root = write_dataset(tmp_path / "rich", 2)
    train = root / "data" / "train"
    more = []
    if damage == "empty":
        for f in train.iterdir():
            f.unlink()
    elif damage == "group":
        with h5py.File(train / "rich_1.hdf5", "a") as f:
            del f["scalars"]
    elif damage == "resolution":
        other = write_dataset(tmp_path / "other", 2, grid=(8, 4))
        shutil.copy(other / "data" / "train" / "rich_1.hdf5", train / "rich_1.hdf5")
    elif damage == "name":
        with h5py.File(train / "rich_1.hdf5", "a") as f:
            f.attrs["dataset_name"] = "other"
    else:
        more = ["--set", "tasks.rich.well.n_steps_output=8"]
    args = ["--config", "configs/tiny.yaml", *folders(tmp_path), *_well(root, *more)]
    proc = run_cli("cache", *args, "--set", "tasks.rich.well.n_steps_input=2")
    assert proc.returncode == code, proc.stderr[-2000:]
    assert message in proc.stderr
    # A bad file stops the cache stage before a cache exists; a window too long for a good cache is refused after it.
    assert len(list((tmp_path / "cache").glob("rich/*/manifest.json"))) == (code == 2)
    assert not list((tmp_path / "cache").glob("rich/.*.tmp"))


def test_a_well_dataset_from_a_bucket(tmp_path, monkeypatch):
    monkeypatch.setattr(download, "RETRY_DELAY_S", 0.0)
    account = Account(monkeypatch)
    root = write_dataset(tmp_path / "upload" / "rich", 2)
    write_stats(root)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        account.bucket.upload_local_file(str(path), f"well/rich/{path.relative_to(root)}")
    cfg = validate(
        {
            "tasks": {"rich": {"pde": "well", "well": {"base_path": "b2://pdebench/well", "dataset": "rich"}}},
            "run": {"data_dir": str(tmp_path / "data")},
        },
        "test",
    )
    files = stage_data(cfg, b2_api=account.api)["rich"]
    local = tmp_path / "data" / "rich"
    assert files.paths("val") == [local / "data" / "valid" / f"rich_{i}.hdf5" for i in (0, 1)]
    assert files.stats_file == local / "stats.yaml" and len(account.downloads) == 6
    origin = files.provenance.origins["train"]
    assert origin["origin"] == "b2" and origin["url"] == "b2://pdebench/well/rich/data/train"
    assert [f["key"] for f in origin["files"]] == [f"well/rich/data/train/rich_{i}.hdf5" for i in (0, 1)]
    assert all(f["sha1_verified"] and len(f["sha256"]) == 64 for f in origin["files"])
    stage_data(cfg, b2_api=account.api)
    assert len(account.downloads) == 6  # the manifest vouches for every file
