"""The FNO paper's .mat files: both containers read back as written, each family's shapes and strides, the FNO
scripts' own reading convention, every bad file, pickling, locating the files, and the demo generator."""

from __future__ import annotations

import pickle

import h5py
import numpy as np
import pytest
import scipy.io

from train.config import TaskConfig
from train.data.acquire.generate_fno import burgers_solve, darcy_vertex_solve, generate_fno
from train.data.formats import fno_mat
from train.data.formats.fno_mat import FnoMatReader, locate_fno_mat, open_fno_mat, write_mat
from train.errors import DataError
from train.pdes import LAYOUTS
from train.stores.local import LocalStore

RNG = np.random.default_rng(0)


def _rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def _task(pde, **settings):
    return TaskConfig(pde=pde, **settings)


def read_all(reader, samples=None):
    """Every block of ``samples`` joined: {"": ...} or {"x": ..., "y": ...}."""
    blocks = list(reader.parts(range(reader.n_samples) if samples is None else samples))
    return {part: np.concatenate([b[part] for b in blocks]) for part in blocks[0]}


def fno_reference(path, key):
    """The FNO scripts' MatReader: scipy.io.loadmat, else h5py with every axis reversed; float32."""
    try:
        data = scipy.io.loadmat(path)[key]
    except Exception:  # MatReader falls back to h5py on any error, as a v7.3 file gives
        with h5py.File(path, "r") as f:
            data = f[key][()]
        data = np.transpose(data, axes=range(data.ndim - 1, -1, -1))
    return data.astype(np.float32)


# ----------------------------------------------------------------------------------------- containers
@pytest.mark.parametrize("version", ["5", "7.3"])
def test_write_mat_reads_back_as_written(tmp_path, version):
    arrays = {"a": _rand(4, 6, 5, dtype=np.float64), "u": _rand(4, 6, 5, 3), "t": np.arange(3, dtype=np.float32)}
    path = write_mat(tmp_path / "x.mat", arrays, version)
    assert [p.name for p in tmp_path.iterdir()] == ["x.mat"]  # no temporary left beside it
    assert np.array_equal(fno_reference(path, "a"), arrays["a"].astype(np.float32))
    assert np.array_equal(fno_reference(path, "u"), arrays["u"])
    assert fno_reference(path, "t").shape == (1, 3)  # MATLAB has no 1-D arrays: a row, as savemat's
    assert fno_mat.mat_version(path) == version


def test_v73_layout_is_matlabs(tmp_path):
    path = write_mat(tmp_path / "x.mat", {"u": _rand(2, 4, 4, 3), "a": _rand(2, 4, 4, dtype=np.float64)}, "7.3")
    head = path.read_bytes()[:512]
    assert head.startswith(b"MATLAB 7.3 MAT-file") and head[126:128] == b"IM"
    with h5py.File(path, "r") as f:
        assert f.userblock_size == 512
        assert f["u"].shape == (3, 4, 4, 2) and f["a"].shape == (4, 4, 2)
        assert f["u"].attrs["MATLAB_class"] == b"single" and f["a"].attrs["MATLAB_class"] == b"double"
    with pytest.raises(NotImplementedError):  # scipy refuses v7.3, which sends the FNO scripts to h5py
        scipy.io.loadmat(path)


def test_plain_hdf5_without_user_block_is_read_as_v73(tmp_path):
    u = _rand(3, 8, 8, 4)
    with h5py.File(tmp_path / "plain.mat", "w") as f:
        f["u"] = np.transpose(u)
    reader = open_fno_mat([tmp_path / "plain.mat"], _task("fno_ns"))
    assert reader.version == "7.3"
    assert np.array_equal(read_all(reader)[""][..., 0], np.moveaxis(u, -1, 1))


# ------------------------------------------------------------------------------------ families, strides
@pytest.mark.parametrize("version", ["5", "7.3"])
def test_burgers_pairs_strided(tmp_path, version):
    a, u = _rand(5, 64), _rand(5, 64)
    path = write_mat(tmp_path / "b.mat", {"a": a, "u": u}, version)
    reader = open_fno_mat([path], _task("fno_burgers"))  # the reference stride, 8
    assert (reader.n_samples, reader.grid, reader.n_frames, reader.spatial_stride) == (5, (8,), 1, 8)
    out = read_all(reader, range(1, 4))
    assert np.array_equal(out["x"], a[1:4, ::8, None]) and np.array_equal(out["y"], u[1:4, ::8, None])
    assert reader.coordinates() == {} and reader.describe() == {"channels": ["a"]}


@pytest.mark.parametrize("version", ["5", "7.3"])
def test_darcy_421_to_85_at_the_reference_stride(tmp_path, version):
    coeff = np.where(_rand(2, 421, 421) > 0, 12.0, 3.0)
    sol = _rand(2, 421, 421, dtype=np.float64)
    path = write_mat(tmp_path / "d.mat", {"coeff": coeff, "sol": sol}, version)
    reader = open_fno_mat([path], _task("fno_darcy"))
    assert reader.grid == (85, 85)
    out = read_all(reader)
    r, s = 5, int((421 - 1) / 5 + 1)  # fourier_2d.py's sub-sampling
    assert np.array_equal(out["x"][..., 0], fno_reference(path, "coeff")[:, ::r, ::r][:, :s, :s])
    assert np.array_equal(out["y"][..., 0], fno_reference(path, "sol")[:, ::r, ::r][:, :s, :s])


@pytest.mark.parametrize("version", ["5", "7.3"])
def test_ns_trajectories_time_before_space(tmp_path, version):
    u = _rand(3, 10, 10, 7)
    path = write_mat(tmp_path / "ns.mat", {"a": u[..., 0], "u": u, "t": np.arange(1, 8.0)}, version)
    reader = open_fno_mat([path], _task("fno_ns", spatial_stride=3, temporal_stride=2))
    assert (reader.grid, reader.n_frames) == ((4, 4), 4)
    assert np.array_equal(read_all(reader)[""][..., 0], np.moveaxis(u[:, ::3, ::3, ::2], -1, 1))
    assert reader.coordinates() == {"t": [1.0, 3.0, 5.0, 7.0]}


def test_blocks_are_bounded_and_join_to_the_whole(tmp_path, monkeypatch):
    u = _rand(9, 8, 8, 5)
    reader = open_fno_mat([write_mat(tmp_path / "ns.mat", {"u": u}, "7.3")], _task("fno_ns"))
    monkeypatch.setattr(fno_mat, "READ_BLOCK_BYTES", 2 * 4 * 8 * 8 * 5)  # two samples a block
    blocks = list(reader.parts(range(1, 8)))
    assert [len(b[""]) for b in blocks] == [2, 2, 2, 1]
    assert np.array_equal(np.concatenate([b[""] for b in blocks])[..., 0], np.moveaxis(u[1:8], -1, 1))


# --------------------------------------------------------------------------- the FNO scripts' convention
@pytest.mark.parametrize("version", ["5", "7.3"])
def test_same_arrays_as_the_fno_scripts_on_written_files(tmp_path, version):
    burgers = write_mat(tmp_path / "b.mat", {"a": _rand(6, 32, dtype=np.float64), "u": _rand(6, 32)}, version)
    reader = open_fno_mat([burgers], _task("fno_burgers", spatial_stride=4))
    out = read_all(reader, range(4))
    assert np.array_equal(out["x"][..., 0], fno_reference(burgers, "a")[:4, ::4])  # fourier_1d.py
    assert np.array_equal(out["y"][..., 0], fno_reference(burgers, "u")[:4, ::4])
    ns = write_mat(tmp_path / "ns.mat", {"u": _rand(5, 8, 8, 12)}, version)
    reader = open_fno_mat([ns], _task("fno_ns"))
    # fourier_2d_time.py: u[:ntrain, ::sub, ::sub, :T_in] in, the next T out; here with time moved forward
    want = fno_reference(ns, "u")[-2:, ::1, ::1, :]
    assert np.array_equal(read_all(reader, range(3, 5))[""][..., 0], np.moveaxis(want, -1, 1))


def fno_slice(pde, array, r):
    """The FNO scripts' sub-sampling of a field read by fno_reference; Navier-Stokes with time moved forward."""
    if pde == "fno_burgers":
        return array[:, ::r]  # fourier_1d.py
    if pde == "fno_darcy":
        s = int((array.shape[1] - 1) / r + 1)
        return array[:, ::r, ::r][:, :s, :s]  # fourier_2d.py
    return np.moveaxis(array[:, ::r, ::r], -1, 1)  # fourier_2d_time.py, sub = 1


@pytest.mark.parametrize(("pde", "resolution"), [("fno_burgers", 64), ("fno_darcy", 26), ("fno_ns", 16)])
def test_same_arrays_as_the_fno_scripts_on_generated_files(tmp_path, pde, resolution):
    paths = generate_fno(tmp_path, pde, 6, resolution, seed=1, n_frames=4)
    task = _task(pde)
    for path in paths:
        out = read_all(open_fno_mat([path], task))
        layout = LAYOUTS[pde]
        parts = {"": layout.targets[0]} if layout.autoregressive else {"x": layout.inputs[0], "y": layout.targets[0]}
        for part, key in parts.items():
            assert np.array_equal(out[part][..., 0], fno_slice(pde, fno_reference(path, key), task.spatial_stride))


# ------------------------------------------------------------------------------------------- bad files
def _burgers(path, version="5", a=None, u=None):
    return write_mat(path, {"a": _rand(5, 16) if a is None else a, "u": _rand(5, 16) if u is None else u}, version)


def _cut(path, fraction):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def _corrupt_compressed(path):
    scipy.io.savemat(path, {"a": _rand(5, 16, dtype=np.float64), "u": _rand(5, 16, dtype=np.float64)},
                     do_compression=True)  # fmt: skip
    data = bytearray(path.read_bytes())
    data[200:216] = b"\xff" * 16
    path.write_bytes(bytes(data))
    return path


def _group(path):
    with h5py.File(path, "w") as f:
        f.create_group("u").create_dataset("data", data=_rand(4, 4))
    return path


BAD = {  # name -> (family, writer of the bad file, the key the message names, what it says)
    "missing": ("fno_burgers", lambda p: p, "a", "not found"),
    "not a mat file": ("fno_burgers", lambda p: p.write_text("x,y\n" * 100) and p, "a", "not a MATLAB file"),
    "cut in the header": ("fno_burgers", lambda p: _cut(_burgers(p), 0.05), "u", "not a MATLAB file"),
    "truncated v5": ("fno_burgers", lambda p: _cut(_burgers(p), 0.6), "u", "truncated MATLAB v5"),
    "truncated v7.3": ("fno_burgers", lambda p: _cut(_burgers(p, "7.3"), 0.6), "u", "truncated or damaged"),
    "damaged v5": ("fno_burgers", _corrupt_compressed, "a", "damaged MATLAB v5"),
    "missing key v5": ("fno_burgers", lambda p: write_mat(p, {"a": _rand(5, 16)}), "u", "keys: ['a']"),
    "missing key v7.3": ("fno_ns", lambda p: write_mat(p, {"a": _rand(2, 8, 8)}, "7.3"), "u", "keys: ['a']"),
    "v7.3 group": ("fno_ns", _group, "u", "a v7.3 file without the expected layout"),
    "v7.3 axes": ("fno_ns", lambda p: write_mat(p, {"u": _rand(2, 8, 8)}, "7.3"), "u", "without the expected layout"),
    "v5 axes": ("fno_darcy", lambda p: write_mat(p, {"coeff": _rand(2, 8), "sol": _rand(2, 8)}), "coeff",
                "grid not matching"),
    "sample counts": ("fno_burgers", lambda p: _burgers(p, u=_rand(4, 16)), "u", "holds 5 samples"),
    "grids": ("fno_darcy", lambda p: write_mat(p, {"coeff": _rand(2, 9, 9), "sol": _rand(2, 9, 8)}), "sol",
              "share one grid"),
    "stride": ("fno_burgers", lambda p: _burgers(p, a=_rand(5, 6), u=_rand(5, 6)), "a", "spatial_stride 8"),
    "char array": ("fno_burgers", lambda p: write_mat(p, {"a": _rand(2, 8), "u": np.array("text")}), "u",
                   "not a numeric array"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_file_names_the_file_and_the_key(tmp_path, case):
    pde, write, key, says = BAD[case]
    path = write(tmp_path / "bad.mat")
    with pytest.raises(DataError) as info:
        read_all(open_fno_mat([path], _task(pde)))
    message = str(info.value)
    assert str(path) in message and f"'{key}'" in message and says in message, message
    assert info.value.exit_code == 3


@pytest.mark.parametrize("version", ["5", "7.3"])
def test_non_finite_values_name_the_sample(tmp_path, version):
    u = _rand(4, 8, 8, 3)
    u[2, 1, 1, 1] = np.nan
    reader = open_fno_mat([write_mat(tmp_path / "ns.mat", {"u": u}, version)], _task("fno_ns"))
    assert read_all(reader, range(2))[""].shape == (2, 3, 8, 8, 1)
    with pytest.raises(DataError, match=r"ns\.mat: non-finite values \(NaN/Inf\) in 'u' at sample 2"):
        read_all(reader)


def test_a_split_is_one_file(tmp_path):
    path = _burgers(tmp_path / "b.mat")
    with pytest.raises(DataError, match=r"a fno_burgers split is one \.mat file, got 2"):
        open_fno_mat([path, path], _task("fno_burgers"))


# ----------------------------------------------------------------------------------- pickling, locating
@pytest.mark.parametrize("version", ["5", "7.3"])
def test_reader_pickles_before_and_after_reading(tmp_path, version):
    u = _rand(4, 8, 8, 3)
    reader = open_fno_mat([write_mat(tmp_path / "ns.mat", {"u": u}, version)], _task("fno_ns", spatial_stride=2))
    copy = pickle.loads(pickle.dumps(reader))
    want = np.moveaxis(u[:, ::2, ::2], -1, 1)[..., None]
    assert np.array_equal(read_all(copy)[""], want)
    assert np.array_equal(read_all(reader)[""], want)  # handles now open, v5 arrays loaded
    state = reader.__getstate__()
    assert state["_file"] is None and state["_arrays"] is None
    again = pickle.loads(pickle.dumps(reader))
    assert isinstance(again, FnoMatReader) and np.array_equal(read_all(again)[""], want)
    for r in (reader, copy, again):
        r.close()
    assert np.array_equal(read_all(reader)[""], want)  # reopened after close


def test_locate_finds_the_published_names(tmp_path):
    store = LocalStore(tmp_path)
    darcy = _task("fno_darcy")
    assert locate_fno_mat(store, darcy, "train") == []
    generate_fno(tmp_path, "fno_darcy", 2, 9, seed=0)
    assert locate_fno_mat(store, darcy, "train") == ["piececonst_r421_N1024_smooth1.mat"]
    assert locate_fno_mat(store, darcy, "test") == ["piececonst_r421_N1024_smooth2.mat"]
    assert locate_fno_mat(store, darcy, "val") == []
    burgers = _task("fno_burgers")
    generate_fno(tmp_path, "fno_burgers", 2, 16, seed=0)
    assert locate_fno_mat(store, burgers, "train") == ["burgers_data_R10.mat"]
    assert locate_fno_mat(store, burgers, "test") == []  # carved from the train file's last samples
    custom = _task("fno_burgers", files={"train_file": "sub/mine.mat"})
    assert locate_fno_mat(store, custom, "train") == []


# ------------------------------------------------------------------------------------------ the generator
def test_generated_files_have_the_published_layouts(tmp_path):
    (burgers,) = generate_fno(tmp_path, "fno_burgers", 3, 32, seed=0)
    data = scipy.io.loadmat(burgers)
    assert data["a"].shape == data["u"].shape == (3, 32) and data["u"].dtype == np.float64
    train, test = generate_fno(tmp_path, "fno_darcy", 3, 17, seed=0)
    for path in (train, test):
        data = scipy.io.loadmat(path)
        coeff, sol = data["coeff"], data["sol"]
        assert coeff.shape == sol.shape == (3, 17, 17) and sol.dtype == np.float64
        assert set(np.unique(coeff)) <= {3.0, 12.0}
        edges = np.concatenate([sol[:, 0], sol[:, -1], sol[:, :, 0], sol[:, :, -1]])
        assert not edges.any() and (sol[:, 1:-1, 1:-1] > 0).all()
    assert not np.array_equal(scipy.io.loadmat(train)["coeff"], scipy.io.loadmat(test)["coeff"])
    (ns,) = generate_fno(tmp_path, "fno_ns", 2, 16, seed=0)  # T = 20 by default
    assert ns.read_bytes().startswith(b"MATLAB 7.3 MAT-file")
    with h5py.File(ns, "r") as f:
        assert f["u"].shape == (20, 16, 16, 2) and f["a"].shape == (16, 16, 2) and f["t"].shape == (20, 1)
        assert {f[k].attrs["MATLAB_class"] for k in f} == {b"single"}
    reader = open_fno_mat([ns], _task("fno_ns"))
    assert reader.coordinates()["t"] == list(map(float, range(1, 21)))


def test_generated_samples_do_not_depend_on_how_many(tmp_path):
    for pde, res in (("fno_burgers", 32), ("fno_darcy", 12), ("fno_ns", 16)):
        few = generate_fno(tmp_path / "few", pde, 2, res, seed=3, n_frames=2)
        many = generate_fno(tmp_path / "many", pde, 4, res, seed=3, n_frames=2)
        for a, b in zip(few, many, strict=True):
            for key in LAYOUTS[pde].inputs + LAYOUTS[pde].targets:
                np.testing.assert_allclose(fno_reference(a, key), fno_reference(b, key)[:2], rtol=0, atol=1e-6)


def test_solvers_against_known_answers():
    # -lap u = 1 on the unit square, u = 0 on its boundary: max u = 0.0736713...
    assert darcy_vertex_solve(np.full((65, 65), 3.0)).max() * 3 == pytest.approx(0.0736713, rel=1e-3)
    # a smooth solution is resolved at 64 points: doubling the grid changes nothing
    coarse, fine = (np.sin(2 * np.pi * np.arange(s) / s)[None] + 0.5 for s in (64, 128))
    u64, u128 = burgers_solve(coarse), burgers_solve(fine)
    np.testing.assert_allclose(u64, u128[:, ::2], atol=1e-6)
    assert u64.mean() == pytest.approx(0.5) and np.abs(u64).max() < np.abs(coarse).max()  # conserved, damped


def test_generator_refuses_bad_requests(tmp_path):
    with pytest.raises(ValueError, match="pde must be one of"):
        generate_fno(tmp_path, "darcy2d", 2, 16, seed=0)
    with pytest.raises(ValueError, match="n_samples must be an integer >= 1"):
        generate_fno(tmp_path, "fno_ns", 0, 16, seed=0)
    assert list(tmp_path.iterdir()) == []
