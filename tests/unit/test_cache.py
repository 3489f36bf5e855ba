"""Tests of the training caches: train-only normalisation, manifest, reuse, invalidation, atomic builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from train.config import TaskConfig
from train.data import checksum
from train.data.acquire.generate import generate
from train.data.acquire.sources import SplitFiles
from train.data.cache import build as cachemod
from train.data.cache import running_stats
from train.data.cache.build import build_cache, cache_key
from train.data.cache.info import MANIFEST, CacheInfo
from train.data.checksum import hash_file
from train.errors import DataError

CFD1D_KEYS = ("density", "pressure", "Vx")


# ------------------------------------------------------------------------------------- file writers
def write_tensor(path, data):
    _, t, nx = data.shape
    with h5py.File(path, "w") as f:
        f.create_dataset("tensor", data=data.astype(np.float32))
        f.create_dataset("x-coordinate", data=((np.arange(nx) + 0.5) / nx).astype(np.float32))
        f.create_dataset("t-coordinate", data=(np.arange(t + 1) * 0.01).astype(np.float32))
    return path


def cache_path(cache_root: Path, name: str, task, source: Path) -> Path:
    """Where build_cache keeps the cache of ``source`` (one training file) under these settings."""
    return cache_root / name / cache_key(task, {"train": [hash_file(source)]})


def write_cfd(path, fields):
    with h5py.File(path, "w") as f:
        for key in CFD1D_KEYS:
            f.create_dataset(key, data=fields[key].astype(np.float32))
    return path


def write_darcy(path, nu, u):
    with h5py.File(path, "w") as f:
        f.create_dataset("nu", data=nu.astype(np.float32))
        f.create_dataset("tensor", data=u.astype(np.float32))
    return path


def advection_data(seed=0, shape=(20, 9, 16)):
    rng = np.random.default_rng(seed)
    return (3.0 * rng.normal(size=shape) + 5.0).astype(np.float32)  # mean and scale far from 0 and 1


def task(pde="advection1d", **kw):
    return TaskConfig(pde=pde, **kw)


def normalised(raw, train):
    """(raw - mean) / std per channel with the statistics of ``train`` (float64 reference)."""
    axes = tuple(range(train.ndim - 1))
    t64 = train.astype(np.float64)
    return (raw.astype(np.float64) - t64.mean(axes)) / t64.std(axes), t64.mean(axes), t64.std(axes)


def assert_train_normalised(info, data):
    """The cache's train split is samples 4.. of ``data`` (20 samples, 10% test and val carved first)."""
    raw = data[..., None]
    ref, _, _ = normalised(raw, raw[4:])
    np.testing.assert_allclose(info.array("train"), ref[4:], rtol=1e-5, atol=1e-5)


def snapshot(folder):
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.iterdir())}


def leftovers(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.name.endswith(".tmp"))


# ---------------------------------------------------------------------------------- normalisation
@pytest.mark.parametrize(("ss", "ts"), [(1, 1), (2, 3)])
def test_autoregressive_cache_normalised_with_train_stats(tmp_path, ss, ts):
    data = advection_data()
    src = write_tensor(tmp_path / "adv.hdf5", data)
    t = task(spatial_stride=ss, temporal_stride=ts, test_fraction=0.1, val_fraction=0.2)
    info = build_cache("adv", t, src, tmp_path / "cache")

    raw = data[:, ::ts, ::ss][..., None]
    test, val, train = raw[0:2], raw[2:6], raw[6:]  # 20 samples: test 2 FIRST, val 4 next, train 14
    ref, mean, std = normalised(raw, train)
    # the same statistics from train only must differ from all-sample ones, or the test proves nothing
    assert not np.allclose(mean, raw.astype(np.float64).mean((0, 1, 2)), rtol=1e-3)

    np.testing.assert_allclose(info.input_mean, mean, rtol=1e-6)
    np.testing.assert_allclose(info.input_std, std, rtol=1e-6)
    np.testing.assert_allclose(info.target_mean, mean, rtol=1e-6)
    np.testing.assert_allclose(info.target_std, std, rtol=1e-6)
    for split, part, lo, hi in (("test", test, 0, 2), ("val", val, 2, 6), ("train", train, 6, 20)):
        arr = info.array(split)
        assert arr.in_place == (ss == ts == 1)  # read whole from plain storage: mapped where it lies, no copy
        assert arr.dtype == np.float32
        assert arr.shape == part.shape
        np.testing.assert_allclose(arr, ref[lo:hi], rtol=1e-5, atol=1e-5)
    train_arr = np.asarray(info.array("train"), dtype=np.float64)
    np.testing.assert_allclose(train_arr.mean((0, 1, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(train_arr.std((0, 1, 2)), 1, atol=1e-5)


def test_manifest_fields(tmp_path):
    data = advection_data(shape=(20, 9, 16))
    src = write_tensor(tmp_path / "adv.hdf5", data)
    info = build_cache("adv", task(spatial_stride=4, temporal_stride=2), src, tmp_path / "cache")
    assert info.path == cache_path(tmp_path / "cache", "adv", task(spatial_stride=4, temporal_stride=2), src)
    assert info.path.parent == tmp_path / "cache" / "adv"
    assert info.pde == "advection1d"
    assert info.autoregressive is True
    assert info.grid == (4,)
    assert info.n_frames == 5
    assert (info.in_channels, info.out_channels) == (1, 1)
    assert info.sizes == {"train": 16, "val": 2, "test": 2}
    meta = json.loads((info.path / MANIFEST).read_text())
    assert meta["grid"] == [4]
    assert meta["n_frames"] == 5
    assert meta["sizes"] == {"train": 16, "val": 2, "test": 2}
    assert meta["source"] == {"train": {"path": str(src.resolve()), "xxh3_128": checksum.hash_file(src)}}
    assert meta["splits"] == {
        "test": {"file": str(src), "samples": [0, 2], "carved": True},
        "val": {"file": str(src), "samples": [2, 4], "carved": True},
        "train": {"file": str(src), "samples": [4, 20], "carved": False},
    }
    np.testing.assert_allclose(meta["coordinates"]["x"], ((np.arange(16) + 0.5) / 16)[::4], rtol=1e-6)
    np.testing.assert_allclose(meta["coordinates"]["t"], (np.arange(9) * 0.01)[::2], rtol=1e-5)
    assert sorted(p.name for p in info.path.iterdir()) == [MANIFEST, "test.npy", "train.npy", "val.npy"]


def test_multichannel_cache_per_channel_stats(tmp_path):
    rng = np.random.default_rng(1)
    fields = {
        key: (rng.normal(size=(10, 5, 8)) * (i + 1) + 100 * i).astype(np.float32) for i, key in enumerate(CFD1D_KEYS)
    }
    src = write_cfd(tmp_path / "cfd.hdf5", fields)
    info = build_cache("cfd", task("cfd1d", val_fraction=0.0, test_fraction=0.2), src, tmp_path / "cache")
    raw = np.stack([fields[k] for k in CFD1D_KEYS], axis=-1)
    ref, mean, std = normalised(raw, raw[2:])
    assert (info.in_channels, info.out_channels) == (3, 3)
    assert info.grid == (8,)
    assert info.n_frames == 5
    np.testing.assert_allclose(info.input_mean, mean, rtol=1e-6)
    np.testing.assert_allclose(info.input_std, std, rtol=1e-6)
    np.testing.assert_allclose(info.array("train"), ref[2:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(info.array("test"), ref[:2], rtol=1e-4, atol=1e-4)


def test_darcy_cache_inputs_and_targets_normalised_separately(tmp_path):
    rng = np.random.default_rng(2)
    nu = np.where(rng.uniform(size=(20, 8, 8)) > 0.5, 1.0, 0.1).astype(np.float32)
    u = (rng.normal(size=(20, 1, 8, 8)) * 0.01 + 0.05).astype(np.float32)
    src = write_darcy(tmp_path / "darcy.hdf5", nu, u)
    info = build_cache("darcy", task("darcy2d", spatial_stride=2), src, tmp_path / "cache")
    assert info.autoregressive is False
    assert info.grid == (4, 4)
    assert info.n_frames == 1
    assert info.sizes == {"train": 16, "val": 2, "test": 2}
    x_raw = nu[:, ::2, ::2, None]
    y_raw = u[:, 0, ::2, ::2, None]
    x_ref, x_mean, x_std = normalised(x_raw, x_raw[4:])
    y_ref, y_mean, y_std = normalised(y_raw, y_raw[4:])
    np.testing.assert_allclose(info.input_mean, x_mean, rtol=1e-6)
    np.testing.assert_allclose(info.input_std, x_std, rtol=1e-6)
    np.testing.assert_allclose(info.target_mean, y_mean, rtol=1e-5)
    np.testing.assert_allclose(info.target_std, y_std, rtol=1e-5)
    for split, lo, hi in (("test", 0, 2), ("val", 2, 4), ("train", 4, 20)):
        np.testing.assert_allclose(info.array(split, "x"), x_ref[lo:hi], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(info.array(split, "y"), y_ref[lo:hi], rtol=1e-4, atol=1e-4)
    names = sorted(p.name for p in info.path.iterdir())
    assert names == [MANIFEST, *sorted(f"{s}_{p}.npy" for s in ("train", "val", "test") for p in "xy")]


def test_generated_darcy_cache(tmp_path):
    src = tmp_path / "darcy.hdf5"
    generate("darcy2d", src, n_samples=10, resolution=16, coefficient=1.0, seed=0)
    info = build_cache("darcy", task("darcy2d", test_fraction=0.2, val_fraction=0.1), src, tmp_path / "cache")
    with h5py.File(src, "r") as f:
        y_raw = f["tensor"][()][:, 0, :, :, None]
    y_ref, _, _ = normalised(y_raw, y_raw[3:])
    np.testing.assert_allclose(info.array("val", "y"), y_ref[2:3], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(info.array("train", "y"), y_ref[3:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_a_cache_gets_the_modes_of_the_umask_so_a_shared_cache_serves_every_user(tmp_path, umask):
    src = tmp_path / "adv.hdf5"
    write_tensor(src, advection_data())
    old = os.umask(umask)
    try:
        info = build_cache("adv", task("advection1d", initial_step=2), src, tmp_path / "cache")
    finally:
        os.umask(old)
    paths = [tmp_path / "cache", *(tmp_path / "cache").rglob("*")]
    assert info.path in paths and len(paths) > 6
    wrong = {
        str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
        for p in paths
        if p.stat().st_mode & 0o777 != (0o777 if p.is_dir() else 0o666) & ~umask
    }
    assert not wrong, f"not the umask's modes (a folder owner-only keeps other users out): {wrong}"


def test_constant_channel_does_not_divide_by_zero(tmp_path):
    data = np.full((10, 4, 8), 2.5, np.float32)
    info = build_cache("c", task(), write_tensor(tmp_path / "c.hdf5", data), tmp_path / "cache")
    assert info.input_std == (1.0,)
    np.testing.assert_allclose(info.input_mean, (2.5,))
    np.testing.assert_array_equal(info.array("train"), 0.0)


def test_constant_channel_of_any_value_gets_unit_std(tmp_path):
    data = np.full((21, 9, 15), 1000.1, np.float32)  # 21 samples: test 2, val 2, train 17
    data[2:4] = 1000.2  # validation differs from the training constant by 0.1
    info = build_cache("c", task(), write_tensor(tmp_path / "c.hdf5", data), tmp_path / "cache")
    assert info.sizes == {"test": 2, "val": 2, "train": 17}
    np.testing.assert_allclose(info.input_mean, (np.float32(1000.1),), rtol=1e-7)
    assert info.input_std == (1.0,)
    np.testing.assert_allclose(info.array("val"), 0.1, rtol=1e-2)


def test_small_read_blocks_give_the_same_cache(tmp_path, monkeypatch):
    data = advection_data(seed=3)
    src = write_tensor(tmp_path / "adv.hdf5", data)
    whole = build_cache("adv", task(), src, tmp_path / "a")
    from train.data.formats import pdebench

    monkeypatch.setattr(pdebench, "READ_BLOCK_BYTES", 1)  # one sample per block, in reading and normalising
    small = build_cache("adv", task(), src, tmp_path / "b")
    for split in ("train", "val", "test"):
        np.testing.assert_allclose(small.array(split), whole.array(split), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(small.input_mean, whole.input_mean, rtol=1e-9)


# -------------------------------------------------------------------------------------------- reuse
def test_second_build_is_a_no_op(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    first = build_cache("adv", task(), src, tmp_path / "cache")
    before = snapshot(first.path)
    inode = first.path.stat().st_ino
    second = build_cache("adv", task(), src, tmp_path / "cache")
    assert second == first
    assert snapshot(second.path) == before
    assert second.path.stat().st_ino == inode
    assert [p.name for p in (tmp_path / "cache" / "adv").iterdir()] == [first.path.name]


@pytest.mark.parametrize(
    "change",
    [
        {"spatial_stride": 2},
        {"temporal_stride": 2},
        {"test_fraction": 0.2},
        {"val_fraction": 0.0},
        {"pde": "burgers1d"},
    ],
)
def test_preprocessing_setting_changes_the_folder(tmp_path, change):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    a = build_cache("adv", task(), src, tmp_path / "cache")
    b = build_cache("adv", task(**{"pde": "advection1d", **change}), src, tmp_path / "cache")
    assert a.path != b.path
    assert a.path.parent == b.path.parent
    assert CacheInfo.load(a.path) == a  # the other cache stays intact


def test_settings_that_do_not_change_contents_share_the_folder(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    a = build_cache("adv", task(), src, tmp_path / "cache")
    b = build_cache("adv", task(batch_size=3, initial_step=2, patch_size=4, loss_weight=2.0), src, tmp_path / "cache")
    assert a.path == b.path


def test_rewritten_source_gives_a_new_cache(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data(seed=0))
    old = build_cache("adv", task(), src, tmp_path / "cache")
    old_mtime = src.stat().st_mtime_ns
    new_data = advection_data(seed=1)
    write_tensor(src, new_data)  # same size, different content
    os.utime(src, ns=(old_mtime, old_mtime))  # and the old timestamps: only the content tells them apart
    new = build_cache("adv", task(), src, tmp_path / "cache")
    assert new.path != old.path
    assert_train_normalised(new, new_data)


def test_source_rewritten_during_the_build_is_a_data_error(tmp_path, monkeypatch):
    """Another process rewriting a mapped source while its cache is built: an error naming the file, and no cache
    left that describes bytes the file no longer holds."""
    src = write_tensor(tmp_path / "adv.hdf5", advection_data(seed=0))
    write = cachemod._write

    def write_then_rewrite(folder, *args):
        write(folder, *args)
        write_tensor(src, advection_data(seed=1))

    monkeypatch.setattr(cachemod, "_write", write_then_rewrite)
    with pytest.raises(DataError, match=r"source changed while its cache was being built \(.*adv\.hdf5 \(was rewri"):
        build_cache("adv", task(), src, tmp_path / "cache")
    assert list((tmp_path / "cache" / "adv").iterdir()) == []


def test_same_bytes_under_a_new_name_and_time_reuse_the_cache(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    first = build_cache("adv", task(), src, tmp_path / "cache")
    moved = tmp_path / "elsewhere" / "copy.h5"
    moved.parent.mkdir()
    moved.write_bytes(src.read_bytes())  # a re-download: new inode, mtime and ctime, same bytes
    src.unlink()
    again = build_cache("adv", task(), moved, tmp_path / "cache")
    assert again.path == first.path
    assert again.array("train").fields[0].file == str(moved.resolve())  # mapped where the bytes are now
    assert np.isfinite(np.asarray(again.array("train"))).all()
    assert [p.name for p in (tmp_path / "cache" / "adv").iterdir()] == [first.path.name]


def test_unchanged_source_is_not_read_again(tmp_path, monkeypatch):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    reads = []
    real = checksum.hash_file
    monkeypatch.setattr(checksum, "hash_file", lambda path: reads.append(path) or real(path))
    first = build_cache("adv", task(), src, tmp_path / "cache")
    assert len(reads) == 1
    again = build_cache("adv", task(), src, tmp_path / "cache")
    assert again == first and len(reads) == 1  # the remembered checksum, not a second read
    later = src.stat().st_mtime_ns + 10**9
    os.utime(src, ns=(later, later))  # touched: hashed again (same bytes, so the same cache)
    touched = build_cache("adv", task(), src, tmp_path / "cache")
    assert touched.path == first.path and len(reads) == 2
    np.testing.assert_array_equal(np.asarray(touched.array("train")), np.asarray(first.array("train")))


def test_checksum_memo_survives_a_corrupt_file(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    first = build_cache("adv", task(), src, tmp_path / "cache")
    (tmp_path / "cache" / cachemod.CHECKSUMS).write_text("{not json")
    assert build_cache("adv", task(), src, tmp_path / "cache") == first


def test_checksum_is_of_the_content(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 10_000_000)
    b.write_bytes(b"x" * 9_999_999 + b"y")
    assert checksum.hash_file(a) != checksum.hash_file(b)
    b.write_bytes(b"x" * 10_000_000)
    assert checksum.hash_file(a) == checksum.hash_file(b)


_BUILD_SCRIPT = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
from train.config import TaskConfig
from train.data.cache.build import build_cache
info = build_cache("adv", TaskConfig(pde="advection1d"), Path(sys.argv[1]), Path(sys.argv[2]))
print("PATH", info.path)
"""


def test_concurrent_builders_build_once(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data(shape=(400, 9, 256)))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD_SCRIPT, str(src), str(tmp_path / "cache")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    paths = {line for out, _ in outputs for line in out.splitlines() if line.startswith("PATH")}
    assert len(paths) == 1
    logs = "".join(err for _, err in outputs)
    assert logs.count(": built ") == 1, logs
    assert logs.count("up to date") == 2, logs
    assert [p.name for p in (tmp_path / "cache" / "adv").iterdir()] == [Path(paths.pop().split()[1]).name]


def test_killed_build_leftovers_are_removed_by_the_next_build(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    leftover = tmp_path / "cache" / "adv" / ".0123456789abcdef.xyz.tmp"
    leftover.mkdir(parents=True)
    (leftover / "train.npy").write_bytes(b"partial")
    build_cache("adv", task(), src, tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


# ------------------------------------------------------------------------------------ window index
def test_window_index_for_the_tasks_initial_step(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data(shape=(20, 9, 16)))
    info = build_cache("adv", task(initial_step=3), src, tmp_path / "cache")
    index = np.load(info.path / cachemod.window_index_name("train", 3))
    assert index.dtype == np.int32 and index.shape == (16 * 6, 2)
    assert index[:7].tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [1, 0]]
    assert index[-1].tolist() == [15, 5]
    for split, n in info.sizes.items():
        assert len(np.load(info.path / cachemod.window_index_name(split, 3))) == n * 6
    # another initial_step adds its own index to the same arrays
    again = build_cache("adv", task(initial_step=5), src, tmp_path / "cache")
    assert again.path == info.path
    assert len(np.load(info.path / cachemod.window_index_name("train", 5))) == 16 * 4


def test_no_window_index_when_nothing_is_left_to_predict(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data(shape=(20, 9, 16)))
    info = build_cache("adv", task(initial_step=9), src, tmp_path / "cache")  # the pipeline reports this
    assert not list(info.path.glob("*_windows_*"))


def test_source_of_other_size_gives_a_new_cache(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data(shape=(20, 9, 16)))
    old = build_cache("adv", task(), src, tmp_path / "cache")
    write_tensor(src, advection_data(shape=(30, 9, 16)))
    new = build_cache("adv", task(), src, tmp_path / "cache")
    assert new.path != old.path
    assert new.sizes == {"train": 24, "val": 3, "test": 3}


def test_folder_without_manifest_is_rebuilt(tmp_path):
    data = advection_data()
    src = write_tensor(tmp_path / "adv.hdf5", data)
    final = cache_path(tmp_path / "cache", "adv", task(), src)
    final.mkdir(parents=True)
    (final / "train.npy").write_bytes(b"half written")
    (final / "junk").write_text("x")
    info = build_cache("adv", task(), src, tmp_path / "cache")
    assert info.path == final
    assert (final / MANIFEST).is_file()
    assert not (final / "junk").exists()
    assert_train_normalised(info, data)


def test_manifest_of_other_format_is_rebuilt(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    info = build_cache("adv", task(), src, tmp_path / "cache")
    meta = json.loads((info.path / MANIFEST).read_text())
    (info.path / MANIFEST).write_text(json.dumps({**meta, "format": -1}))
    assert CacheInfo.load(info.path) is None
    again = build_cache("adv", task(), src, tmp_path / "cache")
    assert again == info
    assert json.loads((info.path / MANIFEST).read_text())["format"] == cachemod.CACHE_FORMAT


def test_a_cache_of_an_older_format_is_replaced_with_a_log_line_saying_why(tmp_path, caplog, monkeypatch):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    old = build_cache("adv", task(), src, tmp_path / "cache")
    monkeypatch.setattr(cachemod, "CACHE_FORMAT", cachemod.CACHE_FORMAT + 1)  # a newer version of the package
    caplog.set_level("INFO", "train.data.cache.build")
    new = build_cache("adv", task(), src, tmp_path / "cache")
    assert new.path != old.path and json.loads((new.path / MANIFEST).read_text())["format"] == cachemod.CACHE_FORMAT
    assert f"the cache format changed ({cachemod.CACHE_FORMAT - 1} -> {cachemod.CACHE_FORMAT})" in caplog.text
    assert str(old.path) in caplog.text


# -------------------------------------------------------------------------------------------- failures
def _boom(*args, **kwargs):
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("target", "strides"),
    [
        ((cachemod, "write_json_atomic"), {}),  # after every array is placed
        ((running_stats.RunningStats, "result"), {}),  # after reading, before the manifest
        ((cachemod.in_place, "scan"), {}),  # mapping in place
        ((cachemod.np.lib.format, "open_memmap"), {"temporal_stride": 2}),  # the first array copied
    ],
)
def test_failed_build_leaves_nothing(tmp_path, monkeypatch, target, strides):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    root = tmp_path / "cache"
    monkeypatch.setattr(*target, _boom)
    with pytest.raises(RuntimeError, match="boom"):
        build_cache("adv", task(**strides), src, root)
    assert not cache_path(root, "adv", task(**strides), src).exists()
    assert list((root / "adv").iterdir()) == []  # no temporary folder either
    monkeypatch.undo()
    info = build_cache("adv", task(**strides), src, root)  # and a later build succeeds
    assert info.sizes["train"] == 16


def test_bad_source_leaves_nothing(tmp_path):
    data = advection_data()
    data[12, 3, 5] = np.nan  # a training sample
    src = write_tensor(tmp_path / "adv.hdf5", data)
    root = tmp_path / "cache"
    with pytest.raises(DataError, match="at sample 12"):
        build_cache("adv", task(), src, root)
    assert list((root / "adv").iterdir()) == []
    assert leftovers(root) == []


def test_missing_source_creates_nothing(tmp_path):
    # the pipeline checks the path first; here the source check fails before any folder is made
    with pytest.raises((DataError, OSError)):
        build_cache("adv", task(), tmp_path / "absent.hdf5", tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------------------ empty val
def test_val_fraction_zero_gives_empty_val(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data(shape=(20, 9, 16)))
    info = build_cache("adv", task(val_fraction=0.0, spatial_stride=2, temporal_stride=4), src, tmp_path / "cache")
    assert info.sizes == {"train": 18, "val": 0, "test": 2}
    val = info.array("val")
    assert val.shape == (0, 3, 8, 1)
    assert val.dtype == np.float32
    assert info.array("train").shape == (18, 3, 8, 1)


def test_val_fraction_zero_darcy(tmp_path):
    rng = np.random.default_rng(4)
    src = write_darcy(tmp_path / "d.hdf5", rng.normal(size=(10, 8, 8)), rng.normal(size=(10, 1, 8, 8)))
    info = build_cache("d", task("darcy2d", val_fraction=0.0, spatial_stride=2), src, tmp_path / "cache")
    assert info.sizes["val"] == 0
    assert info.array("val", "x").shape == (0, 4, 4, 1)
    assert info.array("val", "y").shape == (0, 4, 4, 1)
    assert info.array("train", "x").shape == (9, 4, 4, 1)


# ------------------------------------------------------------------------------- per-split source files
def test_pre_split_files_are_used_whole_and_nothing_is_carved(tmp_path):
    train = advection_data(seed=1, shape=(12, 9, 16))
    val = advection_data(seed=2, shape=(3, 9, 16))
    test = advection_data(seed=3, shape=(5, 9, 16))
    files = SplitFiles(
        train=write_tensor(tmp_path / "x_Train.hdf5", train),
        val=write_tensor(tmp_path / "x_Valid.hdf5", val),
        test=write_tensor(tmp_path / "x_Test.hdf5", test),
    )
    info = build_cache("adv", task(), files, tmp_path / "cache")
    assert info.sizes == {"train": 12, "val": 3, "test": 5}
    assert not any(d["carved"] for d in info.splits.values())
    mean, std = train.astype(np.float64).mean(), train.astype(np.float64).std()
    np.testing.assert_allclose(info.array("test")[..., 0], (test - mean) / std, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(info.array("val")[..., 0], (val - mean) / std, rtol=1e-4, atol=1e-5)


def test_only_the_missing_split_is_carved(tmp_path):
    train = advection_data(seed=1, shape=(20, 9, 16))
    test = advection_data(seed=3, shape=(4, 9, 16))
    files = SplitFiles(train=write_tensor(tmp_path / "train.h5", train), test=write_tensor(tmp_path / "test.h5", test))
    info = build_cache("adv", task(val_fraction=0.1), files, tmp_path / "cache")
    # val: the first 10% of the train file (single-file convention); the rest trains; test is its own file.
    assert info.sizes == {"train": 18, "val": 2, "test": 4}
    assert info.splits["val"] == {"file": str(files.train), "samples": [0, 2], "carved": True}
    assert info.splits["test"]["carved"] is False


def test_group_per_seed_files_carve_the_last_groups_for_test(tmp_path):
    rng = np.random.default_rng(5)
    data = rng.normal(size=(10, 6, 8, 1)).astype(np.float32)  # 10 groups of (t, x, c)
    path = tmp_path / "1D_diff-sorp_NA_NA.h5"
    with h5py.File(path, "w") as f:
        for i, sample in enumerate(data):
            group = f.create_group(f"{i:04d}")
            group.create_dataset("data", data=sample)
            group.create_dataset("grid/x", data=(np.arange(8) + 0.5) / 8)
            group.create_dataset("grid/t", data=np.arange(6) * 0.1)
    info = build_cache("sorp", task("diffsorp1d", initial_step=2), path, tmp_path / "cache")
    assert info.sizes == {"train": 8, "val": 1, "test": 1}
    assert info.splits["test"]["samples"] == [9, 10] and info.splits["val"]["samples"] == [8, 9]
    train = data[:8].astype(np.float64)
    expected_test = (data[9:] - train.mean()) / train.std()
    np.testing.assert_allclose(info.array("test"), expected_test, rtol=1e-4, atol=1e-5)


def test_split_files_that_disagree_in_grid_are_refused(tmp_path):
    files = SplitFiles(
        train=write_tensor(tmp_path / "train.h5", advection_data(shape=(10, 9, 16))),
        test=write_tensor(tmp_path / "test.h5", advection_data(shape=(3, 9, 32))),
    )
    with pytest.raises(DataError, match=r"test\.h5.*differs from the train file"):
        build_cache("adv", task(), files, tmp_path / "cache")
    assert not (tmp_path / "cache" / "adv").exists() or not any((tmp_path / "cache" / "adv").iterdir())
