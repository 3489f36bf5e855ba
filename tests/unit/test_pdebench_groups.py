"""Tests of the PDEBench group-per-seed reader (docs/data-formats.md, 'Grouped layout'), the split conventions
and open_reader."""

from __future__ import annotations

import pickle

import h5py
import numpy as np
import pytest

from train.config import TaskConfig
from train.data.formats import format_of, pdebench
from train.data.formats.pdebench import LAYOUTS, GroupReader, SingleFileReader, pdebench_reader
from train.data.splits import split_ranges
from train.errors import DataError

# pde -> one group's `data` shape [t, *space, channel]
FAMILIES = {"diffreact2d": (5, 8, 6, 2), "shallowwater2d": (4, 6, 8, 1), "diffsorp1d": (6, 16, 1)}


# ------------------------------------------------------------------------------------- file writers
def _samples(n, shape, seed=0):
    """Distinct per-sample offsets so a swapped or misordered group cannot pass."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=shape) + 100 * i).astype(np.float32) for i in range(n)]


def write_groups(path, samples, *, keys=None, order=None, dtype=np.float32):
    """PDEBench's 1B structure: groups '0000'.. each with lzf `data` [t, *space, c], `grid/*` and a `config` attr.

    ``order`` lists the positions in the order the groups are created (default: sorted order).
    """
    keys = keys or [f"{i:04d}" for i in range(len(samples))]
    order = range(len(samples)) if order is None else order
    # track_order: HDF5 would otherwise list links by name, hiding a reader that forgets to sort
    with h5py.File(path, "w", track_order=True) as f:
        for i in order:
            data = samples[i]
            g = f.create_group(keys[i])
            g.create_dataset("data", data=data.astype(dtype), compression="lzf", chunks=True)
            t, *space, _ = data.shape
            for axis, n in zip("xy", space, strict=False):
                g.create_dataset(f"grid/{axis}", data=((np.arange(n) + 0.5) / n).astype(np.float32))
            g.create_dataset("grid/t", data=(np.arange(t) * 0.05).astype(np.float32))
            g.attrs["config"] = f"sim:\n  seed: {int(keys[i])}\n  name: test\n"
    return path


def read_all(reader, samples=None):
    samples = range(reader.n_samples) if samples is None else samples
    blocks = list(reader.iter_blocks(samples))
    assert all(y is None for _, y in blocks)
    return np.concatenate([x for x, _ in blocks]), len(blocks)


# ------------------------------------------------------------------------------------------ layouts
def test_group_layouts():
    assert {p: (LAYOUTS[p].spatial_dims, LAYOUTS[p].channels) for p in FAMILIES} == {
        "diffreact2d": (2, 2),
        "shallowwater2d": (2, 1),
        "diffsorp1d": (1, 1),
    }
    for pde in FAMILIES:
        assert LAYOUTS[pde].style == "groups"
        assert LAYOUTS[pde].autoregressive
        assert format_of(pde).ranges(TaskConfig(pde=pde), 10, True, True)["test"] == range(9, 10)  # the last
    for pde in ("advection1d", "burgers1d", "darcy2d", "cfd1d", "cfd2d"):
        assert LAYOUTS[pde].style == "single"
        assert format_of(pde).ranges(TaskConfig(pde=pde), 10, True, True)["test"] == range(0, 1)  # the first


@pytest.mark.parametrize("pde", sorted(FAMILIES))
def test_each_family_reads_channels_last(tmp_path, pde):
    shape = FAMILIES[pde]
    samples = _samples(3, shape)
    r = GroupReader(write_groups(tmp_path / "g.h5", samples), pde)
    assert r.n_samples == 3
    assert r.grid == shape[1:-1]
    assert r.n_frames == shape[0]
    x, _ = read_all(r)
    assert x.dtype == np.float32
    assert x.shape == (3, *shape)  # (n, t, *space, c)
    np.testing.assert_array_equal(x, np.stack(samples))


def test_groups_read_in_sorted_order(tmp_path):
    samples = _samples(4, FAMILIES["diffsorp1d"])
    path = write_groups(tmp_path / "g.h5", samples, order=[2, 0, 3, 1])  # "0002" written first
    with h5py.File(path, "r") as f:
        assert list(f) == ["0002", "0000", "0003", "0001"]  # the file lists them in creation order
    x, _ = read_all(GroupReader(path, "diffsorp1d"))
    np.testing.assert_array_equal(x, np.stack(samples))


def test_sorted_order_is_by_key_not_by_number(tmp_path):
    # non-padded keys sort as strings, as PDEBench's own loader sorts them
    samples = _samples(3, FAMILIES["diffsorp1d"])
    path = write_groups(tmp_path / "g.h5", samples, keys=["10", "9", "100"])
    x, _ = read_all(GroupReader(path, "diffsorp1d"))
    np.testing.assert_array_equal(x, np.stack([samples[0], samples[2], samples[1]]))  # "10" < "100" < "9"


def test_float64_groups_are_read_as_float32(tmp_path):
    samples = [s.astype(np.float64) for s in _samples(2, FAMILIES["diffsorp1d"])]
    x, _ = read_all(GroupReader(write_groups(tmp_path / "g.h5", samples, dtype=np.float64), "diffsorp1d"))
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x, np.stack(samples).astype(np.float32))


# ---------------------------------------------------------------------------- strides and coordinates
@pytest.mark.parametrize(("pde", "ss", "ts"), [("diffreact2d", 2, 2), ("diffreact2d", 3, 4), ("diffsorp1d", 5, 3)])
def test_strides_equal_numpy_slicing(tmp_path, pde, ss, ts):
    samples = _samples(3, FAMILIES[pde])
    r = GroupReader(write_groups(tmp_path / "g.h5", samples), pde, ss, ts)
    space = (slice(None, None, ss),) * LAYOUTS[pde].spatial_dims
    expected = np.stack([s[(slice(None, None, ts), *space)] for s in samples])
    assert (r.n_frames, *r.grid) == expected.shape[1:-1]
    x, _ = read_all(r)
    assert x.shape == expected.shape
    np.testing.assert_array_equal(x, expected)


def test_spatial_stride_larger_than_grid(tmp_path):
    path = write_groups(tmp_path / "g.h5", _samples(2, (3, 4, 1)))
    with pytest.raises(DataError, match="spatial stride 5 exceeds the grid"):
        GroupReader(path, "diffsorp1d", spatial_stride=5)


@pytest.mark.parametrize(("ss", "ts"), [(1, 1), (2, 2), (3, 4)])
def test_coordinates(tmp_path, ss, ts):
    t, nx, ny = 5, 8, 6
    r = GroupReader(write_groups(tmp_path / "g.h5", _samples(2, (t, nx, ny, 2))), "diffreact2d", ss, ts)
    coords = r.coordinates()
    assert sorted(coords) == ["t", "x", "y"]
    assert len(coords["t"]) == r.n_frames
    np.testing.assert_allclose(coords["t"], (np.arange(t) * 0.05)[::ts], rtol=1e-6)
    np.testing.assert_allclose(coords["x"], ((np.arange(nx) + 0.5) / nx)[::ss], rtol=1e-6)
    np.testing.assert_allclose(coords["y"], ((np.arange(ny) + 0.5) / ny)[::ss], rtol=1e-6)
    assert [len(coords["x"]), len(coords["y"])] == list(r.grid)


def test_coordinates_1d_have_no_y(tmp_path):
    r = GroupReader(write_groups(tmp_path / "g.h5", _samples(2, (6, 16, 1))), "diffsorp1d", 4, 5)
    coords = r.coordinates()
    assert sorted(coords) == ["t", "x"]
    assert len(coords["x"]) == 4
    assert len(coords["t"]) == r.n_frames == 2


# ------------------------------------------------------------------------------------------- blocks
def test_sub_range_equals_the_selected_groups(tmp_path):
    samples = _samples(7, FAMILIES["shallowwater2d"])
    r = GroupReader(write_groups(tmp_path / "g.h5", samples, order=[6, 5, 4, 3, 2, 1, 0]), "shallowwater2d", 2, 2)
    x, _ = read_all(r, range(2, 6))
    np.testing.assert_array_equal(x, np.stack([s[::2, ::2, ::2] for s in samples[2:6]]))
    assert list(r.iter_blocks(range(3, 3))) == []


@pytest.mark.parametrize("per_block", [1, 2, 3, 100])
def test_many_small_blocks_give_the_same_result(tmp_path, monkeypatch, per_block):
    shape = FAMILIES["diffreact2d"]
    samples = _samples(9, shape)
    r = GroupReader(write_groups(tmp_path / "g.h5", samples), "diffreact2d", 2, 1)
    per_sample = 4 * int(np.prod(shape))
    monkeypatch.setattr(pdebench, "READ_BLOCK_BYTES", per_sample * per_block + per_sample // 2)
    assert r.block_size() == per_block
    x, n_blocks = read_all(r, range(1, 8))
    assert n_blocks == -(-7 // per_block)
    assert max(len(b) for b, _ in r.iter_blocks(range(1, 8))) <= per_block
    np.testing.assert_array_equal(x, np.stack([s[:, ::2, ::2] for s in samples[1:8]]))


# ------------------------------------------------------------------------------------------- splits
@pytest.mark.parametrize(
    ("n", "test", "val", "sizes"),
    [
        (1000, 0.1, 0.0, (1000 - 100, 0, 100)),
        (100, 0.1, 0.1, (80, 10, 10)),
        (7, 0.3, 0.3, (3, 2, 2)),
        (3, 0.1, 0.1, (2, 0, 1)),
    ],
)
def test_split_ranges_test_last(n, test, val, sizes):
    r = split_ranges(n, test, val, test_first=False)
    n_train, n_val, n_test = sizes
    assert r["test"] == range(n - n_test, n)  # test is the LAST share
    assert r["val"] == range(n - n_test - n_val, n - n_test)  # val just before it
    assert r["train"] == range(0, n_train)  # train at the front
    assert sorted(i for s in ("train", "val", "test") for i in r[s]) == list(range(n))  # disjoint, covering
    first = split_ranges(n, test, val)  # same sizes as the single-file convention, other positions
    assert [len(first[s]) for s in ("train", "val", "test")] == [n_train, n_val, n_test]
    assert first["test"].start == 0


def test_split_ranges_test_last_too_few():
    with pytest.raises(DataError, match="2 samples are too few"):
        split_ranges(2, 0.5, 0.5, test_first=False)


@pytest.mark.parametrize("test_first", [True, False])
def test_zero_test_fraction_takes_no_sample(test_first):
    # a pre-split test file supplies the test set: training must keep every sample of its own file
    r = split_ranges(10, 0.0, 0.2, test_first=test_first)
    assert len(r["test"]) == 0
    assert len(r["val"]) == 2
    assert len(r["train"]) == 8


def test_pre_split_file_is_read_whole(tmp_path):
    data = np.random.default_rng(3).normal(size=(4, 3, 8)).astype(np.float32)
    path = tmp_path / "1D_CFD_x_Test.hdf5"
    with h5py.File(path, "w") as f:
        f.create_dataset("tensor", data=data)
    r = pdebench_reader(path, "advection1d")
    x = np.concatenate([b for b, _ in r.iter_blocks(range(0, r.n_samples))])
    np.testing.assert_array_equal(x[..., 0], data)


# ---------------------------------------------------------------------------------------- dispatch
def test_open_reader_dispatches_on_style(tmp_path):
    group_path = write_groups(tmp_path / "g.h5", _samples(2, FAMILIES["diffsorp1d"]))
    r = pdebench_reader(group_path, "diffsorp1d", 2, 3)
    assert type(r) is GroupReader
    assert (r.spatial_stride, r.temporal_stride) == (2, 3)
    single_path = tmp_path / "s.hdf5"
    with h5py.File(single_path, "w") as f:
        f.create_dataset("tensor", data=np.zeros((2, 3, 8), np.float32))
    s = pdebench_reader(single_path, "advection1d", 2)
    assert type(s) is SingleFileReader
    assert s.grid == (4,)


def test_readers_refuse_the_other_style(tmp_path):
    path = write_groups(tmp_path / "g.h5", _samples(2, FAMILIES["diffsorp1d"]))
    with pytest.raises(ValueError, match="open_reader"):
        SingleFileReader(path, "diffsorp1d")
    with pytest.raises(ValueError, match="open_reader"):
        GroupReader(path, "advection1d")


# ------------------------------------------------------------------------------------------- errors
def test_no_groups(tmp_path):
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("tensor", data=np.zeros((2, 3, 8), np.float32))  # a single-file file
    with pytest.raises(DataError, match="no sample groups") as e:
        GroupReader(path, "diffsorp1d")
    assert str(path) in str(e.value)
    assert "tensor" in str(e.value)


def test_empty_file(tmp_path):
    path = tmp_path / "g.h5"
    h5py.File(path, "w").close()
    with pytest.raises(DataError, match="no sample groups"):
        GroupReader(path, "diffsorp1d")


def test_group_without_data(tmp_path):
    path = write_groups(tmp_path / "g.h5", _samples(3, FAMILIES["diffsorp1d"]))
    with h5py.File(path, "r+") as f:
        del f["0001"]["data"]
    with pytest.raises(DataError, match="group '0001' has no 'data'") as e:
        GroupReader(path, "diffsorp1d")
    assert str(path) in str(e.value)


def test_data_that_is_not_a_dataset(tmp_path):
    path = write_groups(tmp_path / "g.h5", _samples(2, FAMILIES["diffsorp1d"]))
    with h5py.File(path, "r+") as f:
        del f["0000"]["data"]
        f["0000"].create_group("data")
    with pytest.raises(DataError, match="group '0000' has no 'data' dataset"):
        GroupReader(path, "diffsorp1d")


def test_inconsistent_shapes_name_the_first_offending_group(tmp_path):
    samples = _samples(4, FAMILIES["diffsorp1d"])
    samples[2] = samples[2][:, :8]
    samples[3] = samples[3][:4]
    path = write_groups(tmp_path / "g.h5", samples)
    with pytest.raises(DataError, match="every group must share one shape") as e:
        GroupReader(path, "diffsorp1d")
    msg = str(e.value)
    assert str(path) in msg
    assert "'0002/data'" in msg
    assert "'0003" not in msg
    assert str(samples[2].shape) in msg


@pytest.mark.parametrize(
    ("pde", "shape"),
    [("diffsorp1d", (6, 16)), ("diffsorp1d", (6, 4, 4, 1)), ("diffreact2d", (5, 8, 8)), ("diffreact2d", (5, 8, 8, 1))],
)
def test_wrong_rank_or_channels(tmp_path, pde, shape):
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("0000/data", data=np.zeros(shape, np.float32))
    with pytest.raises(DataError) as e:
        GroupReader(path, pde)
    assert str(path) in str(e.value)
    assert str(shape) in str(e.value)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
def test_integer_dtype(tmp_path, dtype):
    samples = _samples(2, FAMILIES["diffsorp1d"])
    path = write_groups(tmp_path / "g.h5", samples, dtype=dtype)
    with pytest.raises(DataError, match="'0000/data' must be floating-point") as e:
        GroupReader(path, "diffsorp1d")
    assert str(path) in str(e.value)


def test_integer_dtype_in_a_later_group(tmp_path):
    path = write_groups(tmp_path / "g.h5", _samples(3, FAMILIES["diffsorp1d"]))
    with h5py.File(path, "r+") as f:
        del f["0002"]["data"]
        f["0002"].create_dataset("data", data=np.zeros(FAMILIES["diffsorp1d"], np.int16))
    with pytest.raises(DataError, match="'0002/data' must be floating-point"):
        GroupReader(path, "diffsorp1d")


@pytest.mark.parametrize(("bad", "value"), [(0, np.nan), (3, np.inf), (5, -np.inf)])
def test_non_finite_names_index_and_group(tmp_path, monkeypatch, bad, value):
    samples = _samples(6, FAMILIES["diffsorp1d"])
    samples[bad][2, 3, 0] = value
    if bad < 5:
        samples[5][0, 0, 0] = np.nan  # a later bad sample must not be the one reported
    # keys that differ from the positions, written out of order: the message must give both
    keys = [f"{10 + 2 * i:04d}" for i in range(6)]
    path = write_groups(tmp_path / "g.h5", samples, keys=keys, order=[5, 3, 1, 0, 2, 4])
    r = GroupReader(path, "diffsorp1d")  # the up-front check reads no data, so it passes
    monkeypatch.setattr(pdebench, "READ_BLOCK_BYTES", 4 * int(np.prod(FAMILIES["diffsorp1d"])) * 2)
    with pytest.raises(DataError) as e:
        read_all(r)
    msg = str(e.value)
    assert str(path) in msg
    assert f"at sample {bad} (group '{keys[bad]}')" in msg
    if bad > 0:
        x, _ = read_all(r, range(0, bad))
        np.testing.assert_array_equal(x, np.stack(samples[:bad]))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        pdebench_reader(tmp_path / "absent.h5", "diffreact2d")


def test_not_an_hdf5_file(tmp_path):
    path = tmp_path / "garbage.h5"
    path.write_bytes(b"this is not HDF5" * 100)
    with pytest.raises(DataError, match="not a readable HDF5 file") as e:
        GroupReader(path, "diffreact2d")
    assert str(path) in str(e.value)


@pytest.mark.parametrize("keep", [0.2, 0.5, 0.8, 0.95])
def test_truncated_file(tmp_path, keep):
    path = write_groups(tmp_path / "trunc.h5", _samples(20, (8, 64, 1)))
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * keep))
    with pytest.raises(DataError) as e:
        read_all(GroupReader(path, "diffsorp1d"))  # whether the open, the check or the read notices
    assert str(path) in str(e.value)


# ----------------------------------------------------------------------------------------- pickling
def test_reader_pickles_without_handle(tmp_path):
    samples = _samples(4, FAMILIES["diffreact2d"])
    r = GroupReader(write_groups(tmp_path / "g.h5", samples, order=[3, 1, 2, 0]), "diffreact2d", 2, 2)
    before, _ = read_all(r)
    assert r._file is not None
    blob = pickle.dumps(r)
    assert r._file is not None  # pickling does not close the original's handle
    clone = pickle.loads(blob)
    assert clone._file is None
    assert (clone.path, clone.pde, clone.n_samples, clone.grid, clone.n_frames) == (
        r.path,
        "diffreact2d",
        4,
        r.grid,
        r.n_frames,
    )
    after, _ = read_all(clone)
    np.testing.assert_array_equal(after, before)
    np.testing.assert_array_equal(after, np.stack([s[::2, ::2, ::2] for s in samples]))
    clone.close()
    assert clone._file is None
    again, _ = read_all(clone)  # reopens on demand
    np.testing.assert_array_equal(again, before)
    r.close()
    clone.close()
