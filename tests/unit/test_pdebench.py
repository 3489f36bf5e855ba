"""Tests of the PDEBench single-file reader: splits, layouts, strides, blocks, coordinates, errors, pickling."""

from __future__ import annotations

import pickle

import h5py
import numpy as np
import pytest

from train.data.acquire.generate import generate
from train.data.formats import pdebench
from train.data.formats.pdebench import SingleFileReader
from train.data.splits import split_ranges
from train.errors import DataError

CFD1D_KEYS = ("density", "pressure", "Vx")
CFD2D_KEYS = ("density", "pressure", "Vx", "Vy")


# ------------------------------------------------------------------------------------- file writers
def _rand(rng, shape):
    return rng.normal(size=shape).astype(np.float32)


def write_tensor(path, data, *, t_extra=1, dtype=np.float32):
    """A 1D single-field file: ``tensor`` [s, t, x], coordinates with PDEBench's extra t entry."""
    _, t, nx = data.shape
    with h5py.File(path, "w") as f:
        f.create_dataset("tensor", data=data.astype(dtype))
        f.create_dataset("x-coordinate", data=((np.arange(nx) + 0.5) / nx).astype(np.float32))
        f.create_dataset("t-coordinate", data=(np.arange(t + t_extra) * 0.01).astype(np.float32))
        f.attrs["beta"] = 0.1
    return path


def write_fields(path, fields: dict, coords: dict | None = None):
    """Any set of named fields plus coordinates, exactly as given."""
    with h5py.File(path, "w") as f:
        for key, value in fields.items():
            f.create_dataset(key, data=value)
        for key, value in (coords or {}).items():
            f.create_dataset(key, data=value)
    return path


def write_darcy(path, nu, u):
    n = nu.shape[-1]
    centres = ((np.arange(n) + 0.5) / n).astype(np.float32)
    return write_fields(
        path,
        {"nu": nu, "tensor": u},
        {"x-coordinate": centres, "y-coordinate": centres, "t-coordinate": np.linspace(0, 1, 10, dtype=np.float32)},
    )


def read_all(reader, samples=None):
    samples = range(reader.n_samples) if samples is None else samples
    blocks = list(reader.iter_blocks(samples))
    xs = np.concatenate([b[0] for b in blocks])
    ys = None if blocks[0][1] is None else np.concatenate([b[1] for b in blocks])
    return xs, ys, len(blocks)


# ------------------------------------------------------------------------------------------- splits
@pytest.mark.parametrize(
    ("n", "test", "val", "sizes"),
    [
        (100, 0.1, 0.1, (10, 10, 80)),
        (10000, 0.1, 0.0, (1000, 0, 9000)),
        (50, 0.2, 0.1, (10, 5, 35)),
        (3, 0.1, 0.1, (1, 0, 2)),  # at least one test sample
        (7, 0.3, 0.3, (2, 2, 3)),
    ],
)
def test_split_ranges(n, test, val, sizes):
    r = split_ranges(n, test, val)
    n_test, n_val, n_train = sizes
    assert r["test"] == range(0, n_test)  # test is the FIRST share
    assert r["val"] == range(n_test, n_test + n_val)  # val right after
    assert r["train"] == range(n_test + n_val, n)  # train is the rest
    assert len(r["train"]) == n_train
    covered = [i for s in ("test", "val", "train") for i in r[s]]
    assert covered == list(range(n))


@pytest.mark.parametrize(("n", "test", "val"), [(1, 0.1, 0.0), (2, 0.5, 0.5), (4, 0.5, 0.5), (10, 0.5, 0.5)])
def test_split_too_few_samples(n, test, val):
    with pytest.raises(DataError, match=f"{n} samples are too few"):
        split_ranges(n, test, val)


# ------------------------------------------------------------------------------------------ layouts
def test_advection_like_tensor(tmp_path):
    data = _rand(np.random.default_rng(0), (5, 9, 16))
    path = write_tensor(tmp_path / "adv.hdf5", data)
    r = SingleFileReader(path, "advection1d")
    assert r.n_samples == 5
    assert r.raw_shape == (9, 16)
    assert r.grid == (16,)
    assert r.n_frames == 9
    x, y, _ = read_all(r)
    assert y is None
    assert x.dtype == np.float32
    assert x.shape == (5, 9, 16, 1)
    np.testing.assert_array_equal(x[..., 0], data)


def test_generated_file_reads_back(tmp_path):
    path = tmp_path / "burgers.hdf5"
    generate("burgers1d", path, n_samples=3, resolution=32, coefficient=0.01, seed=1)
    with h5py.File(path, "r") as f:
        raw = f["tensor"][()]
        t = f["t-coordinate"][()]
    r = SingleFileReader(path, "burgers1d", spatial_stride=2, temporal_stride=20)
    x, _, _ = read_all(r)
    np.testing.assert_array_equal(x[..., 0], raw[:, ::20, ::2])
    assert r.n_frames == len(range(0, 201, 20)) == x.shape[1]
    np.testing.assert_allclose(r.coordinates()["t"], t[:201:20])


def test_darcy_pairs(tmp_path):
    rng = np.random.default_rng(1)
    nu = _rand(rng, (4, 8, 8))
    u = _rand(rng, (4, 1, 8, 8))
    r = SingleFileReader(write_darcy(tmp_path / "darcy.hdf5", nu, u), "darcy2d")
    assert r.n_samples == 4
    assert r.grid == (8, 8)
    assert r.n_frames == 1
    x, y, _ = read_all(r)
    assert x.shape == (4, 8, 8, 1)  # channels last, no time axis
    assert y.shape == (4, 8, 8, 1)  # singleton t axis squeezed
    np.testing.assert_array_equal(x[..., 0], nu)
    np.testing.assert_array_equal(y[..., 0], u[:, 0])


def test_darcy_spatial_stride_and_no_temporal_stride(tmp_path):
    rng = np.random.default_rng(2)
    nu = _rand(rng, (3, 8, 8))
    u = _rand(rng, (3, 1, 8, 8))
    r = SingleFileReader(write_darcy(tmp_path / "darcy.hdf5", nu, u), "darcy2d", spatial_stride=2, temporal_stride=5)
    assert r.temporal_stride == 1  # ignored for a steady problem
    assert r.grid == (4, 4)
    x, y, _ = read_all(r)
    np.testing.assert_array_equal(x[..., 0], nu[:, ::2, ::2])
    np.testing.assert_array_equal(y[..., 0], u[:, 0, ::2, ::2])
    coords = r.coordinates()
    assert "t" not in coords
    centres = (np.arange(8) + 0.5) / 8
    np.testing.assert_allclose(coords["x"], centres[::2], rtol=1e-6)
    np.testing.assert_allclose(coords["y"], centres[::2], rtol=1e-6)


def test_generated_darcy_reads_back(tmp_path):
    path = tmp_path / "darcy.hdf5"
    generate("darcy2d", path, n_samples=3, resolution=16, coefficient=1.0, seed=0)
    with h5py.File(path, "r") as f:
        nu, u = f["nu"][()], f["tensor"][()]
    x, y, _ = read_all(SingleFileReader(path, "darcy2d", spatial_stride=2))
    np.testing.assert_array_equal(x[..., 0], nu[:, ::2, ::2])
    np.testing.assert_array_equal(y[..., 0], u[:, 0, ::2, ::2])


def test_cfd1d_channels_stacked_in_layout_order(tmp_path):
    rng = np.random.default_rng(3)
    # distinct offsets so a swapped channel cannot pass; HDF5 itself lists keys as Vx, density, pressure
    fields = {key: _rand(rng, (4, 6, 12)) + 10 * i for i, key in enumerate(CFD1D_KEYS)}
    path = write_fields(
        tmp_path / "cfd.hdf5",
        fields,
        {"x-coordinate": np.linspace(0, 1, 12, dtype=np.float32), "t-coordinate": np.arange(7, dtype=np.float32)},
    )
    r = SingleFileReader(path, "cfd1d", spatial_stride=3, temporal_stride=2)
    x, y, _ = read_all(r)
    assert y is None
    assert x.shape == (4, 3, 4, 3)
    for c, key in enumerate(CFD1D_KEYS):
        np.testing.assert_array_equal(x[..., c], fields[key][:, ::2, ::3])


def test_cfd2d_channels_and_strides(tmp_path):
    rng = np.random.default_rng(4)
    fields = {key: _rand(rng, (3, 5, 8, 6)) + 10 * i for i, key in enumerate(CFD2D_KEYS)}
    path = write_fields(tmp_path / "cfd2d.hdf5", fields)
    r = SingleFileReader(path, "cfd2d", spatial_stride=2, temporal_stride=2)
    assert r.grid == (4, 3)
    assert r.n_frames == 3
    x, _, _ = read_all(r)
    assert x.shape == (3, 3, 4, 3, 4)
    for c, key in enumerate(CFD2D_KEYS):
        np.testing.assert_array_equal(x[..., c], fields[key][:, ::2, ::2, ::2])
    assert r.coordinates() == {}  # a file without coordinates has none to return


@pytest.mark.parametrize(("ss", "ts"), [(1, 1), (2, 1), (1, 3), (3, 2), (5, 4), (16, 9)])
def test_strides_equal_numpy_slicing(tmp_path, ss, ts):
    data = _rand(np.random.default_rng(5), (4, 9, 16))
    r = SingleFileReader(write_tensor(tmp_path / "a.hdf5", data), "advection1d", ss, ts)
    expected = data[:, ::ts, ::ss]
    assert r.grid == expected.shape[2:]
    assert r.n_frames == expected.shape[1]
    x, _, _ = read_all(r)
    np.testing.assert_array_equal(x[..., 0], expected)
    np.testing.assert_allclose(r.coordinates()["x"], ((np.arange(16) + 0.5) / 16)[::ss], rtol=1e-6)


def test_spatial_stride_larger_than_grid(tmp_path):
    path = write_tensor(tmp_path / "a.hdf5", np.zeros((2, 3, 8), np.float32))
    with pytest.raises(DataError, match="spatial stride 9 exceeds the grid"):
        SingleFileReader(path, "advection1d", spatial_stride=9)


@pytest.mark.parametrize(("t_frames", "ts"), [(6, 1), (6, 3), (7, 3), (6, 5)])
def test_t_coordinate_truncated_then_strided(tmp_path, t_frames, ts):
    data = np.zeros((2, t_frames, 8), np.float32)
    path = write_tensor(tmp_path / "a.hdf5", data)
    # make the spurious extra entry unmistakable
    with h5py.File(path, "r+") as f:
        t = np.arange(t_frames + 1, dtype=np.float32) * 0.5
        t[-1] = 999.0
        f["t-coordinate"][...] = t
    r = SingleFileReader(path, "advection1d", temporal_stride=ts)
    got = r.coordinates()["t"]
    expected = t[:t_frames][::ts]
    assert len(got) == r.n_frames == len(expected)
    np.testing.assert_array_equal(got, expected)
    assert 999.0 not in got


def test_t_coordinate_of_exact_length_is_kept(tmp_path):
    path = write_tensor(tmp_path / "a.hdf5", np.zeros((2, 5, 8), np.float32), t_extra=0)
    r = SingleFileReader(path, "advection1d", temporal_stride=2)
    np.testing.assert_allclose(r.coordinates()["t"], (np.arange(5) * 0.01)[::2], rtol=1e-6)


# ------------------------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("per_block", [1, 2, 3, 100])
def test_iter_blocks_concatenate_to_the_range(tmp_path, monkeypatch, per_block):
    data = _rand(np.random.default_rng(6), (11, 5, 8))
    r = SingleFileReader(write_tensor(tmp_path / "a.hdf5", data), "advection1d", 2, 2)
    per_sample = 4 * 5 * 8
    monkeypatch.setattr(pdebench, "READ_BLOCK_BYTES", per_sample * per_block + per_sample // 2)
    assert r.block_size() == per_block
    samples = range(2, 9)
    x, _, n_blocks = read_all(r, samples)
    assert n_blocks == -(-len(samples) // per_block)
    np.testing.assert_array_equal(x[..., 0], data[2:9, ::2, ::2])
    block_sizes = [len(b) for b, _ in r.iter_blocks(samples)]
    assert max(block_sizes) <= per_block
    assert sum(block_sizes) == len(samples)


def test_iter_blocks_darcy_small_blocks(tmp_path, monkeypatch):
    rng = np.random.default_rng(7)
    nu, u = _rand(rng, (7, 4, 4)), _rand(rng, (7, 1, 4, 4))
    r = SingleFileReader(write_darcy(tmp_path / "d.hdf5", nu, u), "darcy2d")
    monkeypatch.setattr(pdebench, "READ_BLOCK_BYTES", 1)
    assert r.block_size() == 1
    x, y, n_blocks = read_all(r, range(1, 7))
    assert n_blocks == 6
    np.testing.assert_array_equal(x[..., 0], nu[1:7])
    np.testing.assert_array_equal(y[..., 0], u[1:7, 0])


def test_block_size_counts_every_field(tmp_path):
    fields = {key: np.zeros((2, 4, 8), np.float32) for key in CFD1D_KEYS}
    r = SingleFileReader(write_fields(tmp_path / "c.hdf5", fields), "cfd1d")
    assert r.block_size() == pdebench.READ_BLOCK_BYTES // (4 * 4 * 8 * 3)


def test_iter_blocks_empty_range(tmp_path):
    r = SingleFileReader(write_tensor(tmp_path / "a.hdf5", np.zeros((3, 4, 8), np.float32)), "advection1d")
    assert list(r.iter_blocks(range(2, 2))) == []


# ------------------------------------------------------------------------------------------- errors
def test_missing_file(tmp_path):
    path = tmp_path / "absent.hdf5"
    with pytest.raises(DataError, match="not found") as e:
        SingleFileReader(path, "advection1d")
    assert str(path) in str(e.value)
    assert e.value.exit_code == 3


def test_not_an_hdf5_file(tmp_path):
    path = tmp_path / "garbage.hdf5"
    path.write_bytes(b"this is not HDF5" * 100)
    with pytest.raises(DataError, match="not a readable HDF5 file") as e:
        SingleFileReader(path, "advection1d")
    assert str(path) in str(e.value)


def test_truncated_hdf5_file(tmp_path):
    path = write_tensor(tmp_path / "trunc.hdf5", np.ones((20, 10, 64), np.float32))
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(DataError) as e:
        reader = SingleFileReader(path, "advection1d")
        read_all(reader)  # whether the open or the read notices, it must be a DataError
    assert str(path) in str(e.value)


def test_missing_key(tmp_path):
    path = write_fields(tmp_path / "c.hdf5", {"density": np.zeros((2, 3, 8), np.float32)})
    with pytest.raises(DataError) as e:
        SingleFileReader(path, "cfd1d")
    msg = str(e.value)
    assert str(path) in msg
    assert "key 'pressure' not found" in msg
    assert "density" in msg  # lists what the file has


def test_darcy_missing_nu(tmp_path):
    path = write_fields(tmp_path / "d.hdf5", {"tensor": np.zeros((2, 1, 4, 4), np.float32)})
    with pytest.raises(DataError, match="key 'nu' not found") as e:
        SingleFileReader(path, "darcy2d")
    assert str(path) in str(e.value)


@pytest.mark.parametrize("shape", [(2, 8), (2, 3, 8, 8), (8,)])
def test_wrong_rank(tmp_path, shape):
    path = write_fields(tmp_path / "a.hdf5", {"tensor": np.zeros(shape, np.float32)})
    with pytest.raises(DataError) as e:
        SingleFileReader(path, "advection1d")
    assert str(path) in str(e.value)
    assert "'tensor'" in str(e.value)
    assert str(shape) in str(e.value)


def test_fields_of_different_shapes(tmp_path):
    fields = {key: np.zeros((2, 3, 8), np.float32) for key in CFD1D_KEYS}
    fields["Vx"] = np.zeros((2, 3, 6), np.float32)
    path = write_fields(tmp_path / "c.hdf5", fields)
    with pytest.raises(DataError, match="share one shape") as e:
        SingleFileReader(path, "cfd1d")
    assert str(path) in str(e.value)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, bool])
def test_integer_dtype(tmp_path, dtype):
    path = write_fields(tmp_path / "a.hdf5", {"tensor": np.zeros((2, 3, 8), dtype)})
    with pytest.raises(DataError, match="floating-point") as e:
        SingleFileReader(path, "advection1d")
    assert str(path) in str(e.value)
    assert "'tensor'" in str(e.value)


def test_group_instead_of_dataset(tmp_path):
    path = tmp_path / "g.hdf5"
    with h5py.File(path, "w") as f:
        f.create_group("tensor")
    with pytest.raises(DataError, match="'tensor'"):
        SingleFileReader(path, "advection1d")


def test_float64_file_is_read_as_float32(tmp_path):
    data = np.random.default_rng(8).normal(size=(2, 3, 8))
    r = SingleFileReader(write_tensor(tmp_path / "a.hdf5", data, dtype=np.float64), "advection1d")
    x, _, _ = read_all(r)
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x[..., 0], data.astype(np.float32))


@pytest.mark.parametrize(("bad_sample", "value"), [(0, np.nan), (5, np.nan), (6, np.inf), (9, -np.inf)])
def test_non_finite_values_name_the_first_bad_sample(tmp_path, monkeypatch, bad_sample, value):
    data = _rand(np.random.default_rng(9), (10, 4, 8))
    data[bad_sample, 2, 4] = value
    if bad_sample < 9:
        data[9, 1, 1] = np.nan  # a later bad sample must not be the one reported
    r = SingleFileReader(write_tensor(tmp_path / "a.hdf5", data), "advection1d")
    monkeypatch.setattr(pdebench, "READ_BLOCK_BYTES", 4 * 4 * 8 * 3)  # 3 samples per block
    with pytest.raises(DataError) as e:
        read_all(r)
    msg = str(e.value)
    assert f"at sample {bad_sample}" in msg
    assert str(tmp_path / "a.hdf5") in msg
    assert "tensor" in msg
    # samples before the bad one read fine
    if bad_sample > 0:
        x, _, _ = read_all(r, range(0, bad_sample))
        np.testing.assert_array_equal(x[..., 0], data[:bad_sample])


def test_nan_in_darcy_input(tmp_path):
    rng = np.random.default_rng(10)
    nu, u = _rand(rng, (5, 4, 4)), _rand(rng, (5, 1, 4, 4))
    nu[3, 1, 2] = np.nan
    r = SingleFileReader(write_darcy(tmp_path / "d.hdf5", nu, u), "darcy2d")
    with pytest.raises(DataError, match=r"\['nu'\] at sample 3"):
        read_all(r)


@pytest.mark.parametrize(
    ("nu_shape", "u_shape"),
    [((3, 4, 4), (3, 4, 4)), ((3, 4, 4), (3, 1, 4, 5)), ((3, 4, 4), (2, 1, 4, 4)), ((3, 4), (3, 1, 4))],
)
def test_darcy_shape_mismatch(tmp_path, nu_shape, u_shape):
    path = write_fields(
        tmp_path / "d.hdf5", {"nu": np.zeros(nu_shape, np.float32), "tensor": np.zeros(u_shape, np.float32)}
    )
    with pytest.raises(DataError) as e:
        SingleFileReader(path, "darcy2d")
    msg = str(e.value)
    assert str(path) in msg
    assert str(nu_shape) in msg
    assert str(u_shape) in msg


# ----------------------------------------------------------------------------------------- pickling
def test_reader_pickles_without_handle(tmp_path):
    data = _rand(np.random.default_rng(11), (6, 5, 8))
    r = SingleFileReader(write_tensor(tmp_path / "a.hdf5", data), "advection1d", 2, 2)
    before, _, _ = read_all(r)
    assert r._file is not None  # open after use
    blob = pickle.dumps(r)
    assert r._file is not None  # pickling does not close the original's handle
    clone = pickle.loads(blob)
    assert clone._file is None
    assert (clone.path, clone.pde, clone.spatial_stride, clone.temporal_stride) == (r.path, "advection1d", 2, 2)
    after, _, _ = read_all(clone)
    np.testing.assert_array_equal(after, before)
    np.testing.assert_array_equal(after[..., 0], data[:, ::2, ::2])
    assert clone._file is not None
    clone.close()
    assert clone._file is None
    again, _, _ = read_all(clone)  # reopens on demand
    np.testing.assert_array_equal(again, before)
    r.close()
    clone.close()
