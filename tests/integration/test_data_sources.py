"""Data from a (simulated) B2 bucket and from a local folder, through the whole pipeline."""

from __future__ import annotations

import hashlib
import json
import signal
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.b2sim import SENTINEL_KEY, Account
from tests.helpers import folders, run_cli
from train.config import load_config
from train.data.acquire import download
from train.data.acquire.generate import generate
from train.data.acquire.sources import SplitFiles, stage_data
from train.data.checksum import hash_file
from train.errors import DataError, PreflightError
from train.pipeline import run_stages

pytestmark = pytest.mark.integration


def _iso_utc(ms: int) -> str:
    return datetime.fromtimestamp(ms // 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"


def _overrides(tmp: Path, source: str) -> list[str]:
    return [
        f"tasks.advection1d.source={source}",
        f"tasks.darcy2d.source={source}",
        f"run.data_dir={tmp / 'data'}",
        f"run.cache_dir={tmp / 'cache'}",
        f"run.runs_dir={tmp / 'runs'}",
    ]


def _datasets(folder: Path) -> dict[str, Path]:
    """Small PDEBench-format files, stored under three different path patterns; val never exists."""
    files = {
        "full/advection1d/advection1d_train.h5": ("advection1d", 40, 64, 0.1, 1),
        "full/advection1d/advection1d_test_000.h5": ("advection1d", 10, 64, 0.1, 2),
        "pdebench/darcy2d_full_v1/darcy2d_train.h5": ("darcy2d", 40, 16, 1.0, 3),
    }
    out = {}
    for rel, (pde, n, res, coefficient, seed) in files.items():
        path = folder / rel
        generate(pde, path, n_samples=n, resolution=res, coefficient=coefficient, seed=seed)
        out[rel] = path
    return out


@pytest.fixture
def bucket(monkeypatch, tmp_path) -> Account:
    monkeypatch.setattr(download, "RETRY_DELAY_S", 0.0)
    account = Account(monkeypatch)
    for rel, path in _datasets(tmp_path / "upload").items():
        account.bucket.upload_local_file(str(path), f"data/{rel}")
    return account


def test_training_on_data_from_a_bucket(bucket, tmp_path, caplog, monkeypatch):
    cfg = load_config("configs/tiny.yaml", _overrides(tmp_path, "b2://pdebench/data"))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    run_dir = run_stages(cfg, "run", nproc=2, b2_api=bucket.api)
    # torchrun's signal handlers do not outlive the launch: Ctrl-C is a KeyboardInterrupt again.
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    downloads = len(bucket.downloads)
    assert downloads == 3
    data = tmp_path / "data"
    assert sorted(p.name for p in (data / "advection1d").iterdir()) == [".manifest.json", "test.h5", "train.h5"]
    assert sorted(p.name for p in (data / "darcy2d").iterdir()) == [".manifest.json", "train.h5"]
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    adv, darcy = summary["advection1d"]["data"], summary["darcy2d"]["data"]
    # Where each split came from, down to B2's record of the object, without the data folder.
    key = "data/full/advection1d/advection1d_test_000.h5"
    remote, test_file = bucket.bucket.get_file_info_by_name(key), data / "advection1d" / "test.h5"
    b2_test = {
        "origin": "b2", "file": str(test_file), "url": f"b2://pdebench/{key}", "bucket": "pdebench", "key": key,
        "size": test_file.stat().st_size, "sha1": hashlib.sha1(test_file.read_bytes()).hexdigest(),
        "sha1_verified": True, "uploaded": _iso_utc(remote.upload_timestamp), "file_id": remote.id_,
        "sha256": hashlib.sha256(test_file.read_bytes()).hexdigest(),
    }  # fmt: skip
    assert adv["test"] == {**b2_test, "samples": [0, 10], "carved": False, "xxh3_128": hash_file(test_file)}
    assert adv["train"]["key"] == "data/full/advection1d/advection1d_train.h5" and not adv["train"]["carved"]
    train_url = "b2://pdebench/data/full/advection1d/advection1d_train.h5"
    assert adv["val"] == {
        "origin": "carved", "file": str(data / "advection1d" / "train.h5"), "samples": [0, 4], "carved": True,
        "carved_from": train_url,
        "convention": "PDEBench's single-file convention: test, val, train in sample order; val_fraction=0.1",
    }  # fmt: skip
    assert darcy["test"]["carved"] and darcy["test"]["samples"] == [0, 4]  # the FIRST 10%: single-file style
    warnings = summary["advection1d"]["data_warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("data advection1d: no val file (tried b2://pdebench/data/")
    assert [w.split(" (")[0] for w in summary["darcy2d"]["data_warnings"]] == [
        "data darcy2d: no val file",
        "data darcy2d: no test file",
    ]
    inputs = json.loads((run_dir / "inputs.json").read_text())
    assert (
        inputs["advection1d"]["data"] == adv
        and inputs["darcy2d"]["data_warnings"] == summary["darcy2d"]["data_warnings"]
    )
    md = (run_dir / "report" / "summary.md").read_text()
    assert (
        f"| advection1d | test | `b2://pdebench/{key}` (SHA1 {b2_test['sha1']}, uploaded {b2_test['uploaded']}) |" in md
    )
    assert f"| advection1d | val | carved from the train file `{train_url}` (PDEBench's single-file" in md
    assert "- data advection1d: no val file" in md
    assert "no val file" in caplog.text and "no test file" in caplog.text

    # Re-running transfers nothing: the manifest vouches for the files.
    run_stages(cfg, "data", b2_api=bucket.api)
    assert len(bucket.downloads) == downloads
    # The key reached no file the run wrote.
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".yaml", ".md", ".log", ".jsonl"):
            assert SENTINEL_KEY not in path.read_text(errors="replace"), path
    for path in (run_dir / "inputs.json", run_dir / "report" / "summary.json", run_dir / "report" / "summary.md"):
        assert bucket.key_id not in path.read_text(), path

    # Without credentials (a container that only trains), the files downloaded earlier are used.
    monkeypatch.delenv("B2_APPLICATION_KEY_ID")
    monkeypatch.delenv("B2_APPLICATION_KEY")
    files = stage_data(cfg)
    assert files["advection1d"] == SplitFiles(data / "advection1d" / "train.h5", None, data / "advection1d" / "test.h5")
    assert files["darcy2d"] == SplitFiles(data / "darcy2d" / "train.h5")
    assert "B2 credentials are not set" in caplog.text
    # The data folder's manifest still knows where the files came from, and the run is told it was not checked.
    provenance = files["advection1d"].provenance
    assert provenance.origins["test"] == b2_test
    assert provenance.origins["val"]["origin"] == "carved" and provenance.origins["val"]["carved_from"] == train_url
    assert provenance.warnings[0].startswith("data advection1d: B2 credentials are not set; using the files")


def test_missing_credentials_with_nothing_downloaded_is_a_preflight_error(bucket, tmp_path, monkeypatch):
    monkeypatch.delenv("B2_APPLICATION_KEY")
    cfg = load_config("configs/tiny.yaml", _overrides(tmp_path, "b2://pdebench/data"))
    with pytest.raises(PreflightError, match="B2_APPLICATION_KEY"):
        stage_data(cfg)


def test_dry_run_prints_the_plan_and_fetches_nothing(bucket, tmp_path, capsys):
    cfg = load_config("configs/tiny.yaml", _overrides(tmp_path, "b2://pdebench/data"))
    run_stages(cfg, "data", dry_run=True, b2_api=bucket.api)
    out = capsys.readouterr().out
    assert "b2://pdebench/data/full/advection1d/advection1d_train.h5" in out
    assert "b2://pdebench/data/pdebench/darcy2d_full_v1/darcy2d_train.h5" in out
    assert "total: 3 file(s)" in out
    assert bucket.downloads == [] and not (tmp_path / "data").exists()


def test_a_missing_train_file_lists_every_location_tried(bucket, tmp_path):
    cfg = load_config("configs/tiny.yaml", _overrides(tmp_path, "b2://pdebench/elsewhere"))
    with pytest.raises(DataError) as info:
        run_stages(cfg, "data", b2_api=bucket.api)
    assert info.value.exit_code == 3
    for template in cfg.tasks["advection1d"].templates:
        assert "b2://pdebench/elsewhere/" + template.format(task="advection1d", split="train") in str(info.value)


def test_local_folder_source_with_pdebench_split_names(tmp_path):
    folder = tmp_path / "pdebench"
    generate("advection1d", folder / "adv_Train.hdf5", n_samples=40, resolution=64, coefficient=0.1, seed=1)
    generate("advection1d", folder / "adv_Valid.hdf5", n_samples=6, resolution=64, coefficient=0.1, seed=2)
    generate("darcy2d", folder / "darcy2d" / "train.h5", n_samples=40, resolution=16, coefficient=1.0, seed=3)
    args = ["run", "--config", "configs/tiny.yaml", "--nproc", "1", *folders(tmp_path)]
    args += ["--set", f"tasks.advection1d.source=file://{folder}", "--set", f"tasks.darcy2d.source={folder}"]
    args += ["--set", 'tasks.advection1d.templates=["adv_{Split}.hdf5"]']
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "runs" / "tiny" / "report" / "summary.json").read_text())
    adv = summary["advection1d"]["data"]
    valid = folder / "adv_Valid.hdf5"
    modified = _iso_utc(valid.stat().st_mtime_ns // 10**6)
    assert adv["val"] == {
        "origin": "local", "file": str(valid), "samples": [0, 6], "carved": False, "size": valid.stat().st_size,
        "modified": modified, "xxh3_128": hash_file(valid),
    }  # fmt: skip
    assert adv["test"]["carved"] and adv["test"]["file"] == str(folder / "adv_Train.hdf5")
    assert adv["test"]["carved_from"] == str(folder / "adv_Train.hdf5")
    assert summary["advection1d"]["data_warnings"][0].startswith(f"data advection1d: no test file (tried {folder}/")
    assert summary["darcy2d"]["data"]["train"]["file"] == str(folder / "darcy2d" / "train.h5")
    md = (tmp_path / "runs" / "tiny" / "report" / "summary.md").read_text()
    assert f"| advection1d | val | local file ({valid.stat().st_size} bytes, modified {modified}) | `{valid}` |" in md
    assert not (tmp_path / "data").exists(), "local files are read in place, not copied"
