"""Downloads from a web server (a real one on 127.0.0.1): resumed after a dropped connection, error pages and
wrong sizes refused with nothing under the final name, SHA-256 recorded at the first download and checked on
reuse; a Well dataset, a PDEBench folder and a PDEBench file served this way go through the data stage."""

from __future__ import annotations

import json
import os

import pytest

from tests.http_server import FileServer
from tests.well_files import write_dataset
from train.config import validate
from train.data.acquire import download
from train.data.acquire.sources import stage_data
from train.errors import DataError
from train.stores.https import HttpsStore


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setattr(download, "RETRY_DELAY_S", 0.0)
    root = tmp_path / "www"
    (root / "files").mkdir(parents=True)
    (root / "files" / "a.bin").write_bytes(os.urandom(3 << 20))
    with FileServer(root) as server:
        yield server


def _fetch(server: FileServer, dest):
    store = HttpsStore(server.url + "/files")
    return download.fetch_all([(store, "a.bin", dest)], lock_dir=dest.parent, show_progress=False)[0]


def test_a_dropped_connection_resumes_where_it_stopped(served, tmp_path):
    served.faults["files/a.bin"] = "drop"
    dest = tmp_path / "out" / "a.bin"
    dest.parent.mkdir()
    result = _fetch(served, dest)
    assert dest.read_bytes() == (served.root / "files" / "a.bin").read_bytes()
    assert served.requests["files/a.bin"] == 2  # the first, dropped half-way, and one Range request for the rest
    assert result.bytes_transferred == 3 << 20  # the half already received was not fetched again
    entry = download.read_manifest(dest.parent)["a.bin"]
    import hashlib

    assert entry["sha256"] == result.sha256 == hashlib.sha256(dest.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("503", "answered 503"),
        ("html", "an HTML page, not the file"),
        ("lie", f"got {3 << 20} bytes, expected {(3 << 20) + 100}"),
    ],
)
def test_anything_but_the_file_is_refused_and_nothing_is_left(served, tmp_path, fault, message):
    served.faults["files/a.bin"] = fault
    dest = tmp_path / "out" / "a.bin"
    dest.parent.mkdir()
    with pytest.raises(DataError, match=message):
        _fetch(served, dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == [".download.lock"]  # no file, no temporary


def test_the_sha256_recorded_at_download_is_checked_on_reuse(served, tmp_path):
    dest = tmp_path / "out" / "a.bin"
    dest.parent.mkdir()
    _fetch(served, dest)
    assert _fetch(served, dest).skipped and served.requests["files/a.bin"] == 1
    data = bytearray(dest.read_bytes())
    data[100] ^= 0xFF  # same size, other bytes: only the checksum can tell
    dest.write_bytes(bytes(data))
    assert not _fetch(served, dest).skipped and served.requests["files/a.bin"] == 2
    assert dest.read_bytes() == (served.root / "files" / "a.bin").read_bytes()


def test_a_well_dataset_over_https_goes_through_the_data_stage(served, tmp_path):
    write_dataset(served.root / "datasets" / "rich")
    (served.root / "datasets" / "rich" / "stats.yaml").write_text("mean: {}\nstd: {}\n")
    cfg = validate(
        {
            "tasks": {"rich": {"pde": "well", "well": {"base_path": served.url + "/datasets", "dataset": "rich"}}},
            "run": {"data_dir": str(tmp_path / "data")},
        },
        "test",
    )
    files = stage_data(cfg)["rich"]
    local = tmp_path / "data" / "rich"
    assert files.paths("train") == [local / "data" / "train" / "rich_0.hdf5", local / "data" / "train" / "rich_1.hdf5"]
    assert files.stats_file == local / "stats.yaml" and files.stats_file.is_file()
    origin = files.provenance.origins["test"]
    assert origin["origin"] == "https" and origin["url"] == served.url + "/datasets/rich/data/test"
    assert [f["sha256"] for f in origin["files"]] == [
        json.loads((local / "data" / "test" / ".manifest.json").read_text())["rich_0.hdf5"]["sha256"]
    ]
    before = sum(served.requests.values())
    stage_data(cfg)  # up to date: only the index pages are read again
    assert sum(served.requests.values()) - before == 3


def test_a_store_this_machine_cannot_reach_is_exit_4_not_a_data_error(served, tmp_path):
    """A DNS failure or an outage of the store ended with exit 3 ("data error"): it is this machine's network or
    the store's outage, and the same command succeeds once it answers."""
    from tests.helpers import free_port

    nowhere = f"http://127.0.0.1:{free_port()}/datasets"  # nothing listens there: the connection is refused
    well = {"pde": "well", "well": {"base_path": nowhere, "dataset": "rich"}}
    cfg = validate({"tasks": {"rich": well}, "run": {"data_dir": str(tmp_path / "data")}}, "test")
    with pytest.raises(DataError) as refused:
        stage_data(cfg)
    assert refused.value.exit_code == 4 and "Connection refused" in str(refused.value)
    assert "could not be reached, which is this machine's network" in str(refused.value)
    served.faults["files/a.bin"] = "503"  # an outage: the server answers, but never with the file
    dest = tmp_path / "out" / "a.bin"
    dest.parent.mkdir()
    with pytest.raises(DataError, match=r"answered 503 .*after \d attempts.*could not be reached") as outage:
        _fetch(served, dest)
    assert outage.value.exit_code == 4


def _pdebench_file(path):
    from train.data.acquire.generate import generate

    generate("advection1d", path, n_samples=12, resolution=16, coefficient=0.1, seed=0)


def test_a_pdebench_folder_over_https_is_searched_and_downloaded(served, tmp_path):
    """A task whose source is a web folder: each split found with the templates, downloaded with its SHA-256,
    the missing val file carved."""
    for split in ("train", "test"):
        _pdebench_file(served.root / "pdebench" / f"adv_{split}.h5")
    source = served.url + "/pdebench"
    cfg = validate(
        {
            "tasks": {"adv": {"pde": "advection1d", "source": source, "templates": ["{task}_{split}.h5"]}},
            "run": {"data_dir": str(tmp_path / "data")},
        },
        "test",
    )
    files = stage_data(cfg)["adv"]
    local = tmp_path / "data" / "adv"
    assert (files.train, files.val, files.test) == (local / "train.h5", None, local / "test.h5")
    assert files.test.read_bytes() == (served.root / "pdebench" / "adv_test.h5").read_bytes()
    origins = files.provenance.origins
    assert origins["train"]["origin"] == "https" and origins["train"]["url"] == f"{source}/adv_train.h5"
    assert origins["val"]["origin"] == "carved"


def test_a_pdebench_file_over_https_is_downloaded(served, tmp_path):
    _pdebench_file(served.root / "pdebench" / "one.hdf5")
    url = served.url + "/pdebench/one.hdf5"
    cfg = validate(
        {"tasks": {"adv": {"pde": "advection1d", "source": url}}, "run": {"data_dir": str(tmp_path / "data")}}, "test"
    )
    files = stage_data(cfg)["adv"]
    assert files.train == tmp_path / "data" / "adv" / "train.h5" and files.val is None and files.test is None
    assert files.provenance.origins["train"]["url"] == url
