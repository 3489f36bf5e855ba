"""s3:// sources read from a real S3-compatible server (moto's, over HTTP on 127.0.0.1, through boto3): files found
by the task's templates, downloaded and verified against their sha1 metadata where they have it, their origin
recorded; a missing bucket, bad bytes and missing credentials each end with the project's error."""

from __future__ import annotations

import hashlib
import socket

import pytest

from train.config import validate
from train.data.acquire import download
from train.data.acquire.generate import generate
from train.data.acquire.sources import stage_data
from train.errors import DataError, PreflightError
from train.stores.base import Transient

boto3 = pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto's server (a dev dependency) is not installed")


@pytest.fixture
def s3(monkeypatch):
    """A client of a fresh S3-compatible server on 127.0.0.1, the environment pointing boto3 at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    environ = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(download, "RETRY_DELAY_S", 0.0)
    yield boto3.client("s3")
    server.stop()


def _config(tmp_path, source: str):
    task = {"pde": "advection1d", "source": source, "templates": ["adv_{Split}.hdf5"]}
    return validate({"tasks": {"adv": task}, "run": {"data_dir": str(tmp_path / "data")}}, "test")


def test_an_s3_source_is_downloaded_verified_by_its_sha1_metadata_and_recorded(s3, tmp_path):
    s3.create_bucket(Bucket="sims")
    train, test = tmp_path / "adv_Train.hdf5", tmp_path / "adv_Test.hdf5"
    generate("advection1d", train, n_samples=20, resolution=32, coefficient=0.1, seed=1)
    generate("advection1d", test, n_samples=4, resolution=32, coefficient=0.1, seed=2)
    sha1 = hashlib.sha1(train.read_bytes()).hexdigest()
    s3.upload_file(str(train), "sims", "pdebench/adv_Train.hdf5", ExtraArgs={"Metadata": {"sha1": sha1}})
    s3.upload_file(str(test), "sims", "pdebench/adv_Test.hdf5")
    files = stage_data(_config(tmp_path, "s3://sims/pdebench"))["adv"]
    assert files.train.read_bytes() == train.read_bytes() and files.test.read_bytes() == test.read_bytes()
    origins = files.provenance.origins
    assert origins["train"]["origin"] == "s3" and origins["train"]["url"] == "s3://sims/pdebench/adv_Train.hdf5"
    assert (origins["train"]["bucket"], origins["train"]["key"]) == ("sims", "pdebench/adv_Train.hdf5")
    assert origins["train"]["sha1"] == sha1 and origins["train"]["sha1_verified"] is True
    assert origins["test"]["sha1_verified"] is False  # no sha1 metadata: checked by its size only
    assert origins["val"]["origin"] == "carved"


def test_bytes_that_do_not_match_their_sha1_are_refused_and_nothing_is_kept(s3, tmp_path):
    s3.create_bucket(Bucket="sims")
    train = tmp_path / "adv_Train.hdf5"
    generate("advection1d", train, n_samples=20, resolution=32, coefficient=0.1, seed=1)
    s3.upload_file(str(train), "sims", "adv_Train.hdf5", ExtraArgs={"Metadata": {"sha1": "0" * 40}})
    with pytest.raises(DataError, match="SHA1") as error:
        stage_data(_config(tmp_path, "s3://sims"))
    assert error.value.exit_code == 3 and not list((tmp_path / "data").rglob("*.h5"))


def test_a_missing_bucket_is_exit_3_and_missing_credentials_exit_4(s3, tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"s3://nowhere: no such bucket") as error:
        stage_data(_config(tmp_path, "s3://nowhere/pdebench"))
    assert error.value.exit_code == 3
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(PreflightError, match="no S3 credentials: set AWS_ACCESS_KEY_ID") as error:
        stage_data(_config(tmp_path, "s3://sims/pdebench"))
    assert error.value.exit_code == 4


def test_an_endpoint_that_does_not_answer_is_exit_4_naming_the_location(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_DEFAULT_REGION", "x")):
        monkeypatch.setenv(name, value)
    with pytest.raises(Transient, match=r"s3://sims/pdebench/adv_Train\.hdf5: EndpointConnectionError") as error:
        stage_data(_config(tmp_path, "s3://sims/pdebench"))
    assert error.value.exit_code == 4
