"""Caches that map PDEBench datasets where they lie in the source file, and the normalising reads over them."""

from __future__ import annotations

import os
import pickle
import threading

import h5py
import numpy as np
import pytest

from tests.unit.test_cache import CFD1D_KEYS, advection_data, normalised, task, write_cfd, write_darcy, write_tensor
from train.data.cache import in_place
from train.data.cache.build import build_cache
from train.data.cache.info import CacheInfo
from train.errors import DataError


def _sizes(folder):
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_whole_plain_dataset_is_mapped_and_never_copied(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data(shape=(40, 9, 512)))
    info = build_cache("adv", task(), src, tmp_path / "cache")
    assert _sizes(info.path) < 0.05 * src.stat().st_size  # a manifest and window indexes, no data
    assert {p.suffix for p in info.path.iterdir()} <= {".json", ".npy"}
    assert not any(p.name in ("train.npy", "val.npy", "test.npy") for p in info.path.iterdir())
    copied = build_cache("adv", task(temporal_stride=2), src, tmp_path / "cache")  # a strided subset: a copy
    assert not copied.array("train").in_place
    np.testing.assert_array_equal(copied.array("train").raw()[:, 1], info.array("train").raw()[:, 2])


@pytest.mark.parametrize("layout", ["chunked", "compressed", "float64", "big-endian"])
def test_storage_that_is_not_a_plain_float32_array_is_copied(tmp_path, layout):
    data = advection_data()
    src = tmp_path / "adv.hdf5"
    options = {
        "chunked": {"chunks": (1, 9, 16)},
        "compressed": {"compression": "gzip"},
        "float64": {"dtype": np.float64},
        "big-endian": {"dtype": ">f4"},
    }[layout]
    with h5py.File(src, "w") as f:
        f.create_dataset("tensor", data=data, **options)
    info = build_cache("adv", task(), src, tmp_path / "cache")
    assert not info.array("train").in_place
    ref, _, _ = normalised(data[..., None].astype(np.float64), data[4:, ..., None].astype(np.float32))
    np.testing.assert_allclose(np.asarray(info.array("train")), ref[4:], rtol=1e-5, atol=1e-5)


def test_in_place_and_copied_caches_read_the_same_normalised_values(tmp_path):
    """Several fields (CFD's channels) and Darcy's pairs, mapped in place, read exactly as a copy would."""
    rng = np.random.default_rng(3)
    fields = {k: (rng.normal(size=(12, 5, 8)) * (i + 1) + 10 * i).astype(np.float32) for i, k in enumerate(CFD1D_KEYS)}
    cfd = write_cfd(tmp_path / "cfd.hdf5", fields)
    mapped = build_cache("cfd", task("cfd1d", test_fraction=0.25), cfd, tmp_path / "cache")
    chunked = tmp_path / "cfd_chunked.hdf5"
    with h5py.File(chunked, "w") as f:
        for key in CFD1D_KEYS:
            f.create_dataset(key, data=fields[key], chunks=(2, 5, 8))
    copied = build_cache("cfd", task("cfd1d", test_fraction=0.25), chunked, tmp_path / "cache")
    assert mapped.array("train").in_place and not copied.array("train").in_place
    assert (mapped.input_mean, mapped.input_std) == (copied.input_mean, copied.input_std)
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(np.asarray(mapped.array(split)), np.asarray(copied.array(split)))

    nu, u = rng.normal(size=(10, 6, 6)), rng.normal(size=(10, 1, 6, 6)) * 2 + 1
    darcy = build_cache("darcy", task("darcy2d"), write_darcy(tmp_path / "darcy.hdf5", nu, u), tmp_path / "cache")
    assert darcy.array("train", "y").in_place and darcy.array("train", "y").shape == (8, 6, 6, 1)
    ref, _, _ = normalised(u[:, 0, ..., None], u[2:, 0, ..., None])
    np.testing.assert_allclose(np.asarray(darcy.array("train", "y")), ref[2:], rtol=1e-5, atol=1e-5)


def test_indexing_reads_what_it_selects(tmp_path):
    data = advection_data(shape=(20, 9, 16))
    info = build_cache("adv", task(), write_tensor(tmp_path / "adv.hdf5", data), tmp_path / "cache")
    array = info.array("train")  # samples 4..20 of the file
    whole = np.asarray(array)
    assert whole.shape == (16, 9, 16, 1) and len(array) == 16
    rows, frames = np.array([[3], [0], [15]]), np.array([[0, 2, 4]])
    np.testing.assert_array_equal(array[rows, frames], whole[rows, frames])
    for index in (5, -1, slice(2, 9, 3), slice(None, None, -2), np.array([1, 1, 0]), (slice(1, 4), 2), (..., 0)):
        np.testing.assert_array_equal(array[index], whole[index])
    np.testing.assert_array_equal(array.raw(0)[..., 0], data[4])  # physical values, from the right sample
    for bad in (16, -17, np.array([0, 16])):
        with pytest.raises(IndexError):
            array[bad]
    out = array[0]
    out += 1  # a read is the caller's own array, never a view of the map
    np.testing.assert_array_equal(array[0], whole[0])
    clone = pickle.loads(pickle.dumps(array))
    assert clone._maps is None and len(pickle.dumps(array)) < 1000
    np.testing.assert_array_equal(np.asarray(clone), whole)


def test_non_finite_values_are_refused_naming_the_key_and_sample(tmp_path):
    data = advection_data()
    data[13, 4, 7] = np.nan
    src = write_tensor(tmp_path / "adv.hdf5", data)
    with pytest.raises(DataError, match=r"adv.hdf5: non-finite values \(NaN/Inf\) in 'tensor' at sample 13"):
        build_cache("adv", task(), src, tmp_path / "cache")
    assert not any((tmp_path / "cache" / "adv").iterdir())


def test_a_mapped_file_changed_under_the_cache_is_not_read(tmp_path):
    src = write_tensor(tmp_path / "adv.hdf5", advection_data())
    info = build_cache("adv", task(), src, tmp_path / "cache")
    assert CacheInfo.load(info.path) is not None
    with h5py.File(src, "r+") as f:
        f["tensor"][0, 0, 0] = 99.0  # the bytes the cache describes are gone
    later = os.stat(src).st_mtime_ns + 10**9
    os.utime(src, ns=(later, later))
    assert CacheInfo.load(info.path) is None  # a rank never maps bytes its cache did not describe
    rebuilt = build_cache("adv", task(), src, tmp_path / "cache")
    assert rebuilt.path != info.path  # new content, new key
    assert rebuilt.array("test")[0, 0, 0, 0] == pytest.approx((99.0 - rebuilt.input_mean[0]) / rebuilt.input_std[0])


def test_the_scan_stops_its_reader_on_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(in_place, "SCAN_BLOCK_BYTES", 4 * 9 * 16)  # one sample per block: many blocks
    data = advection_data(shape=(200, 9, 16))
    data[10, 0, 0] = np.inf
    src = write_tensor(tmp_path / "adv.hdf5", data)
    with pytest.raises(DataError, match="at sample 10"):
        build_cache("adv", task(), src, tmp_path / "cache")
    assert "cache-scan" not in [t.name for t in threading.enumerate()]  # no reader left running
