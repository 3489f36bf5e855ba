"""Downloads: real b2sdk code paths against its in-process RawSimulator, real files, atomic and verified."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from b2sdk.v2 import UploadSourceBytes

import train.stores.local
from tests.b2sim import SENTINEL_KEY, Account
from train.data.acquire import download
from train.data.acquire.download import _fetch, _stat, describe, fetch_all
from train.errors import DataError, PreflightError
from train.stores import open_store
from train.stores.base import CHUNK, RemoteFile, check_name
from train.stores.local import LocalStore


def fetch(store, name: str, dest: Path, *, retries: int = 2, progress=None):
    """One file through the same path fetch_all takes for each of its jobs."""
    return _fetch(store, _stat(store, name), Path(dest), retries, progress)


def sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def b2(monkeypatch) -> Account:
    monkeypatch.setattr(download, "RETRY_DELAY_S", 0.0)
    return Account(monkeypatch)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != download.MANIFEST) if folder.exists() else []


def test_b2_download_is_verified_and_recorded(b2, tmp_path):
    data = os.urandom(300)  # under the simulator's 400-byte large-file threshold: a simple upload
    version = b2.bucket.upload_bytes(data, "data/full/adv/adv_train.h5")
    assert version.content_sha1 == sha1(data)
    dest = tmp_path / "data" / "adv" / "train.h5"

    result = fetch(b2.store(), "full/adv/adv_train.h5", dest)

    assert dest.read_bytes() == data
    assert (result.dest, result.bytes_transferred, result.skipped, result.sha1) == (dest, 300, False, sha1(data))
    manifest = json.loads((dest.parent / ".manifest.json").read_text())
    source = "b2://pdebench/data/full/adv/adv_train.h5"
    uploaded = version.upload_timestamp
    entry = {"size": 300, "sha1": sha1(data), "verified": True, "source": source, "version": version.id_}
    sha256 = hashlib.sha256(data).hexdigest()
    entry |= {"sha256": sha256, "mtime_ns": dest.stat().st_mtime_ns}
    assert manifest == {"train.h5": {**entry, "uploaded": uploaded}} and result.sha256 == sha256
    # What the run's provenance is made of: B2's own record of the object, the simulator's clock included.
    assert result.remote == RemoteFile("full/adv/adv_train.h5", 300, sha1(data), version.id_, uploaded)
    assert isinstance(uploaded, int) and uploaded > 0 and result.warnings == []
    assert leftovers(dest.parent) == ["train.h5"]
    assert len(b2.downloads) == 1


def test_rerun_is_a_noop_that_neither_downloads_nor_rehashes(b2, tmp_path, monkeypatch):
    data = os.urandom(5000)
    b2.bucket.upload_bytes(data, "data/x.h5")
    dest = tmp_path / "x.h5"
    fetch(b2.store(), "x.h5", dest)
    assert len(b2.downloads) >= 1
    before = list(b2.downloads)

    def no_hashing(path):
        raise AssertionError(f"{path} re-hashed on a no-op")

    monkeypatch.setattr(download, "_sha1_file", no_hashing)
    result = fetch(b2.store(), "x.h5", dest)

    assert (result.bytes_transferred, result.skipped, result.sha1) == (0, True, sha1(data))
    assert b2.downloads == before


def test_local_file_of_another_size_or_a_changed_remote_is_fetched_again(b2, tmp_path):
    b2.bucket.upload_bytes(b"a" * 100, "data/x.h5")
    dest = tmp_path / "x.h5"
    fetch(b2.store(), "x.h5", dest)
    dest.write_bytes(b"a" * 50)  # truncated behind the manifest's back

    assert fetch(b2.store(), "x.h5", dest).skipped is False
    assert dest.read_bytes() == b"a" * 100

    b2.bucket.upload_bytes(b"b" * 100, "data/x.h5")  # a new version, same size
    result = fetch(b2.store(), "x.h5", dest)
    assert (result.skipped, result.sha1, dest.read_bytes()) == (False, sha1(b"b" * 100), b"b" * 100)
    assert len(b2.downloads) == 3


def test_corrupt_content_is_retried_then_refused(b2, tmp_path):
    good = os.urandom(300)
    b2.bucket.upload_bytes(good, "data/x.h5")
    bad = bytes([good[0] ^ 0xFF]) + good[1:]
    b2.stored("data/x.h5").data_bytes = bad  # B2 serves bytes that disagree with content_sha1
    dest = tmp_path / "x.h5"

    with pytest.raises(DataError) as err:
        fetch(b2.store(), "x.h5", dest, retries=2)

    assert len(b2.downloads) == 3
    message = str(err.value)
    assert "b2://pdebench/data/x.h5" in message and sha1(good) in message and sha1(bad) in message
    assert not dest.exists() and leftovers(tmp_path) == []


def test_a_retry_that_succeeds_keeps_its_warning_for_the_run(b2, tmp_path, monkeypatch):
    good = os.urandom(300)
    b2.bucket.upload_bytes(good, "data/x.h5")
    stored = b2.stored("data/x.h5")
    bad = bytes([good[0] ^ 0xFF]) + good[1:]
    stored.data_bytes = bad
    counting = b2.sim.download_file_from_url

    def healed_after_the_first(*args, **kwargs):
        if b2.downloads:
            stored.data_bytes = good
        return counting(*args, **kwargs)

    monkeypatch.setattr(b2.sim, "download_file_from_url", healed_after_the_first)
    result = fetch(b2.store(), "x.h5", tmp_path / "x.h5")

    assert (tmp_path / "x.h5").read_bytes() == good and len(b2.downloads) == 2
    expected = f"b2://pdebench/data/x.h5: SHA1 mismatch: expected {sha1(good)}, got {sha1(bad)}; trying again (1/2)"
    assert result.warnings == [expected]


def test_wrong_large_file_sha1_is_caught_although_b2sdk_does_not_check_it(b2, tmp_path):
    parts = [os.urandom(300), os.urandom(300), os.urandom(50)]
    wrong = sha1(b"something else")
    version = b2.bucket.concatenate(
        [UploadSourceBytes(p) for p in parts], "data/big.h5", file_info={"large_file_sha1": wrong}
    )
    assert version.content_sha1 == "none"
    dest = tmp_path / "big.h5"
    dest.write_bytes(b"previous good file")

    with pytest.raises(DataError) as err:
        fetch(b2.store(), "big.h5", dest, retries=1)

    assert len(b2.downloads) == 2
    assert wrong in str(err.value) and sha1(b"".join(parts)) in str(err.value) and "big.h5" in str(err.value)
    assert dest.read_bytes() == b"previous good file"  # the old file stays; nothing corrupt replaces it
    assert leftovers(tmp_path) == ["big.h5"]


def test_multipart_uploads_are_verified_through_large_file_sha1(b2, tmp_path):
    parts = [os.urandom(300), os.urandom(300), os.urandom(77)]
    data = b"".join(parts)
    # As the b2 CLI does: the whole file's SHA1 in file_info, since B2 has none for a multipart file.
    version = b2.bucket.concatenate(
        [UploadSourceBytes(p) for p in parts], "data/big.h5", file_info={"large_file_sha1": sha1(data)}
    )
    assert version.content_sha1 == "none"
    store = b2.store()
    remote = store.stat("big.h5")
    assert (remote.size, remote.sha1) == (len(data), sha1(data))

    result = fetch(store, "big.h5", tmp_path / "big.h5")

    assert (tmp_path / "big.h5").read_bytes() == data and result.sha1 == sha1(data)
    # b2sdk's own large uploads (over the simulator's 400-byte threshold) set large_file_sha1 themselves.
    auto = b2.bucket.upload_bytes(os.urandom(2000), "data/auto.h5")
    assert auto.content_sha1 == "none" and store.stat("auto.h5").sha1 == auto.file_info["large_file_sha1"]


def test_unknown_sha1_is_recorded_with_a_warning(b2, tmp_path, caplog):
    data = os.urandom(650)
    b2.bucket.concatenate([UploadSourceBytes(data[:300]), UploadSourceBytes(data[300:])], "data/u.h5")
    assert b2.store().stat("u.h5").sha1 is None

    with caplog.at_level(logging.WARNING, logger="train.data.acquire.download"):
        result = fetch(b2.store(), "u.h5", tmp_path / "u.h5")

    assert result.sha1 == sha1(data) and "unverified" in caplog.text
    # The run keeps the warning too, and the manifest says the SHA1 was never checked.
    assert result.warnings == [
        f"b2://pdebench/data/u.h5: the store has no SHA1 for this file; recorded {sha1(data)} unverified"
    ]
    assert json.loads((tmp_path / download.MANIFEST).read_text())["u.h5"]["verified"] is False
    assert fetch(b2.store(), "u.h5", tmp_path / "u.h5").skipped  # same source and size: up to date


class HalfwayStore(LocalStore):
    """Writes half of the file, then the run is interrupted."""

    def download(self, name, dest, progress=None):
        data = self.path(name).read_bytes()
        dest.write_bytes(data[: len(data) // 2])
        raise KeyboardInterrupt


def test_interrupted_download_leaves_no_file(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.h5").write_bytes(os.urandom(4096))
    out = tmp_path / "out"
    out.mkdir()

    with pytest.raises(KeyboardInterrupt):
        fetch(HalfwayStore(tmp_path / "src"), "x.h5", out / "x.h5")

    assert leftovers(out) == []


def test_interrupted_b2_download_leaves_no_file(b2, tmp_path):
    b2.bucket.upload_bytes(os.urandom(5000), "data/x.h5")
    seen = []

    def interrupt(n):
        seen.append(n)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch(b2.store(), "x.h5", tmp_path / "x.h5", progress=interrupt)

    assert seen and leftovers(tmp_path) == []


class SlowStore(LocalStore):
    def download(self, name, dest, progress=None):
        def slowly(n):
            time.sleep(0.01)
            progress(n)

        return super().download(name, dest, slowly)


def test_ctrl_c_stops_a_batch_promptly_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(train.stores.local, "CHUNK", 1024)  # the local store copies in chunks
    for i in range(3):
        (tmp_path / f"x{i}.h5").write_bytes(os.urandom(300 * 1024))  # 3 s per file at 10 ms a chunk
    out = tmp_path / "out"
    jobs = [(SlowStore(tmp_path), f"x{i}.h5", out / f"x{i}.h5") for i in range(3)]
    # Python's own Ctrl-C handler, whatever started the tests (a shell's background job inherits SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()

    try:
        with pytest.raises(KeyboardInterrupt):
            fetch_all(jobs, workers=2, lock_dir=out, show_progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)

    assert time.monotonic() - start < 2
    assert leftovers(out) == [".download.lock"] and not (out / download.MANIFEST).exists()


def test_missing_bucket_names_it(b2, tmp_path):
    store = open_store("b2://no-such-bucket/x", b2.api)
    with pytest.raises(DataError) as err:
        store.stat("a.h5")
    assert "b2://no-such-bucket" in str(err.value) and err.value.exit_code == 3


def test_rejected_key_is_a_preflight_error_that_does_not_show_it(b2, monkeypatch):
    wrong = "K005wrong-" + SENTINEL_KEY
    monkeypatch.setenv("B2_APPLICATION_KEY", wrong)
    with pytest.raises(PreflightError) as err:
        b2.store().stat("a.h5")
    assert err.value.exit_code == 4 and "B2_APPLICATION_KEY_ID" in str(err.value)
    assert wrong not in str(err.value) and b2.key_id not in str(err.value)


@pytest.mark.parametrize(
    "unset", [["B2_APPLICATION_KEY_ID"], ["B2_APPLICATION_KEY"], ["B2_APPLICATION_KEY_ID", "B2_APPLICATION_KEY"]]
)
def test_missing_credentials_name_the_variables(b2, monkeypatch, unset):
    for var in unset:
        monkeypatch.delenv(var)
    with pytest.raises(PreflightError) as err:
        b2.store().stat("a.h5")
    assert all(var in str(err.value) for var in unset)
    assert SENTINEL_KEY not in str(err.value)


def test_the_key_never_appears_in_logs_exceptions_or_files(b2, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)  # b2sdk's own debug logging included
    b2.bucket.upload_bytes(os.urandom(300), "data/ok.h5")
    b2.bucket.upload_bytes(os.urandom(300), "data/bad.h5")
    b2.stored("data/bad.h5").data_bytes = b"Y" * 300
    errors = []
    attempts = [
        lambda: fetch(b2.store(), "ok.h5", tmp_path / "d" / "ok.h5"),
        lambda: fetch(b2.store(), "bad.h5", tmp_path / "d" / "bad.h5"),
        lambda: fetch(b2.store(), "missing.h5", tmp_path / "d" / "missing.h5"),
        lambda: open_store("b2://nope", b2.api).stat("x"),
        lambda: describe([(b2.store(), "ok.h5", tmp_path / "d" / "ok.h5")]),
    ]
    for attempt in attempts:
        try:
            attempt()
        except Exception as e:
            errors.append(e)
    monkeypatch.setenv("B2_APPLICATION_KEY", SENTINEL_KEY + "x")
    try:
        b2.store().stat("ok.h5")
    except Exception as e:
        errors.append(e)

    assert [type(e) for e in errors] == [DataError, DataError, DataError, PreflightError]
    texts = [caplog.text, *(f"{e!s} {e!r} {e.__context__!r} {e.__cause__!r}" for e in errors)]
    assert all(SENTINEL_KEY not in text for text in texts)
    assert all(SENTINEL_KEY.encode() not in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert "b2sdk" in caplog.text  # the capture did see b2sdk's debug lines


@pytest.mark.parametrize("name", ["../x.h5", "a/../../x.h5", "/etc/passwd", "a\\b.h5", "a//b.h5", "", "a/", "./a"])
def test_unsafe_names_are_refused(name, tmp_path):
    with pytest.raises(DataError) as err:
        check_name(name)
    assert repr(name) in str(err.value)
    with pytest.raises(DataError):
        fetch(LocalStore(tmp_path), name, tmp_path / "out.h5")


def test_safe_names_pass():
    assert check_name("full/adv/adv_train.h5") == "full/adv/adv_train.h5"
    assert check_name("a..b.h5") == "a..b.h5"


def test_local_folder_and_file_url_stores(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    data = os.urandom(3 * CHUNK + 5)
    (src / "sub" / "x.h5").write_bytes(data)
    monkeypatch.chdir(tmp_path)
    for source in (str(src), f"file://{src}", "src"):
        store = open_store(source)
        assert isinstance(store, LocalStore) and store.url == str(src)
        remote = store.stat("sub/x.h5")
        assert (remote.size, remote.sha1, store.stat("sub/missing.h5")) == (len(data), None, None)
    dest = tmp_path / "out" / "x.h5"
    result = fetch(store, "sub/x.h5", dest)
    assert dest.read_bytes() == data and result.sha1 == sha1(data) and result.bytes_transferred == len(data)
    assert fetch(store, "sub/x.h5", dest).skipped
    with pytest.raises(DataError, match="nowhere"):
        open_store(str(tmp_path / "nowhere"))


class CorruptingStore(LocalStore):
    """A copy that loses a byte on the way to the disk, unknown to the reader."""

    def download(self, name, dest, progress=None):
        digest = super().download(name, dest, progress)
        with open(dest, "r+b") as f:
            f.write(b"\0")
        return digest


def test_local_copies_are_verified_against_the_source(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"\1" * 1000)
    with pytest.raises(DataError, match="SHA1 mismatch"):
        fetch(CorruptingStore(tmp_path), "x.h5", tmp_path / "out" / "x.h5", retries=1)
    assert leftovers(tmp_path / "out") == []


class LyingStore(LocalStore):
    """Announces one byte more than it delivers, and no SHA1: only the size can tell."""

    def stat(self, name):
        remote = super().stat(name)
        return remote and RemoteFile(name, remote.size + 1, None)

    def download(self, name, dest, progress=None):
        super().download(name, dest, progress)


def test_short_files_are_refused(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"\1" * 1000)
    with pytest.raises(DataError, match="got 1000 bytes, expected 1001"):
        fetch(LyingStore(tmp_path), "x.h5", tmp_path / "out" / "x.h5", retries=0)
    assert leftovers(tmp_path / "out") == []


def test_a_crash_between_rename_and_record_leaves_no_stale_entry(b2, tmp_path, monkeypatch):
    old, new = b"o" * 300, b"n" * 300
    b2.bucket.upload_bytes(old, "data/x.h5")
    fetch(b2.store(), "x.h5", tmp_path / "x.h5")
    b2.bucket.upload_bytes(new, "data/x.h5")
    real = download._record

    def crash_after_rename(dest, entry):
        if entry is not None:
            raise KeyboardInterrupt  # the new file is in place, its record not yet written
        real(dest, entry)

    monkeypatch.setattr(download, "_record", crash_after_rename)
    with pytest.raises(KeyboardInterrupt):
        fetch(b2.store(), "x.h5", tmp_path / "x.h5")
    monkeypatch.setattr(download, "_record", real)
    assert (tmp_path / "x.h5").read_bytes() == new
    b2.bucket.upload_bytes(old, "data/x.h5")  # back to the old content: the old record must not vouch for it

    result = fetch(b2.store(), "x.h5", tmp_path / "x.h5")
    assert not result.skipped and (tmp_path / "x.h5").read_bytes() == old


def test_a_replaced_remote_without_sha1_is_fetched_again(b2, tmp_path):
    for data in (b"a" * 700, b"b" * 700):  # multipart without large_file_sha1, same size
        b2.bucket.concatenate([UploadSourceBytes(data[:400]), UploadSourceBytes(data[400:])], "data/u.h5")
        result = fetch(b2.store(), "u.h5", tmp_path / "u.h5")
        assert not result.skipped and (tmp_path / "u.h5").read_bytes() == data
    assert fetch(b2.store(), "u.h5", tmp_path / "u.h5").skipped


def test_same_file_is_a_noop(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"data")
    result = fetch(LocalStore(tmp_path), "x.h5", tmp_path / "x.h5")
    assert (result.skipped, result.bytes_transferred, result.sha1) == (True, 0, sha1(b"data"))
    assert (tmp_path / "x.h5").read_bytes() == b"data" and not (tmp_path / download.MANIFEST).exists()


def make_jobs(b2, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    contents, jobs = {}, []
    for i in range(5):
        data = os.urandom(200 + 300 * i)
        if i % 2:
            (src / f"f{i}.h5").write_bytes(data)
            jobs.append((LocalStore(src), f"f{i}.h5", tmp_path / "data" / f"t{i}" / "train.h5"))
        else:
            b2.bucket.upload_bytes(data, f"data/f{i}.h5")
            jobs.append((b2.store(), f"f{i}.h5", tmp_path / "data" / f"t{i}" / "train.h5"))
        contents[i] = data
    return jobs, contents


def test_fetch_all_in_parallel_returns_results_in_job_order(b2, tmp_path):
    jobs, contents = make_jobs(b2, tmp_path)
    results = fetch_all(jobs, workers=3, lock_dir=tmp_path / "data", show_progress=False)
    assert [r.dest for r in results] == [dest for _, _, dest in jobs]
    assert [r.skipped for r in results] == [False] * 5
    assert [r.sha1 for r in results] == [sha1(contents[i]) for i in range(5)]
    assert all(dest.read_bytes() == contents[i] for i, (_, _, dest) in enumerate(jobs))
    assert sum(r.bytes_transferred for r in results) == sum(map(len, contents.values()))


def test_concurrent_and_repeated_batches_download_once(b2, tmp_path, monkeypatch):
    jobs, _ = make_jobs(b2, tmp_path)
    real, in_flight, overlap = download._fetch, [], []

    def watched(*args):
        in_flight.append(args[2])
        try:
            return real(*args)
        finally:
            overlap.append(len(in_flight))
            in_flight.remove(args[2])

    monkeypatch.setattr(download, "_fetch", watched)
    batches = [[], []]

    def launch(i):
        batches[i] = fetch_all(jobs, workers=2, lock_dir=tmp_path / "data", show_progress=False)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted([all(r.skipped for r in b) for b in batches]) == [False, True]  # the second found it all done
    assert len(b2.downloads) == 3 and max(overlap) <= 2
    again = fetch_all(jobs, lock_dir=tmp_path / "data", show_progress=False)
    assert all(r.skipped and r.bytes_transferred == 0 for r in again) and len(b2.downloads) == 3


def test_fetch_all_removes_temporary_files_a_killed_run_left(b2, tmp_path):
    jobs, _ = make_jobs(b2, tmp_path)
    dest = jobs[0][2]
    dest.parent.mkdir(parents=True)
    (dest.parent / f".{dest.name}.k1ll3d.tmp").write_bytes(b"partial")
    fetch_all(jobs, lock_dir=tmp_path / "data", show_progress=False)
    assert leftovers(dest.parent) == [dest.name]
    assert fetch_all([], lock_dir=tmp_path / "data", show_progress=False) == []


def test_fetch_all_raises_a_failed_job_after_the_others_finish(b2, tmp_path):
    jobs, contents = make_jobs(b2, tmp_path)
    b2.stored("data/f2.h5").data_bytes = b"Z" * len(contents[2])
    with pytest.raises(DataError, match=r"f2\.h5"):
        fetch_all(jobs, workers=1, lock_dir=tmp_path / "data", show_progress=False)
    finished = [dest.exists() for _, _, dest in jobs]
    assert finished[2] is False and finished[:2] == [True, True]
    with pytest.raises(DataError, match=r"missing\.h5 not found"):
        fetch_all([*jobs, (b2.store(), "missing.h5", tmp_path / "m.h5")], lock_dir=tmp_path, show_progress=False)


def test_describe_lists_sizes_and_a_total_without_downloading(b2, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    b2.bucket.upload_bytes(os.urandom(300), "data/full/x/x_train.h5")
    b2.bucket.upload_bytes(os.urandom(2500), "data/full/x/x_test.h5")
    store = b2.store()
    jobs = [(store, "full/x/x_train.h5", Path("data/x/train.h5")), (store, "full/x/x_test.h5", Path("data/x/test.h5"))]
    lines = describe(jobs)
    assert lines == [
        "b2://pdebench/data/full/x/x_train.h5 -> data/x/train.h5 (300 B)",
        "b2://pdebench/data/full/x/x_test.h5 -> data/x/test.h5 (2.4 KiB)",
        "total: 2 file(s), 2.7 KiB to download",
    ]
    assert b2.downloads == [] and not Path("data/x").exists()

    fetch(store, "full/x/x_train.h5", tmp_path / "train.h5")
    lines = describe([(store, "full/x/x_train.h5", tmp_path / "train.h5"), (store, "nothing.h5", tmp_path / "n.h5")])
    assert lines[0].endswith("(300 B, up to date)") and lines[1].endswith("(NOT FOUND)")
    assert lines[2] == "total: 0 file(s), 0 B to download, 1 up to date"
