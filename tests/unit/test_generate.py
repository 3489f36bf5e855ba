"""Tests of the local PDEBench-format generators: layout, determinism, physics, argument checks, atomicity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from train.data.acquire import generate as gen


def _make(tmp_path, pde, name="out.hdf5", **kw):
    args = {"n_samples": 4, "resolution": 32, "coefficient": 0.1, "seed": 0} | kw
    path = tmp_path / name
    params = gen.generate(pde, path, **args)
    return path, params


def _read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}


# ------------------------------------------------------------------------------------------- layout
@pytest.mark.parametrize(("pde", "attr"), [("advection1d", "beta"), ("burgers1d", "Nu")])
def test_layout_1d(tmp_path, pde, attr):
    path, params = _make(tmp_path, pde, n_samples=3, resolution=32, coefficient=0.25)
    with h5py.File(path, "r") as f:
        assert set(f.keys()) == {"tensor", "x-coordinate", "t-coordinate"}
        assert f["tensor"].shape == (3, 201, 32)
        assert f["x-coordinate"].shape == (32,)
        assert f["t-coordinate"].shape == (202,)  # PDEBench's one-extra-entry quirk
        assert f["tensor"].chunks is None  # contiguous, like the published files
        for key in f:
            assert f[key].dtype == np.float32
        assert f.attrs[attr] == 0.25
        x, t = f["x-coordinate"][()], f["t-coordinate"][()]
    np.testing.assert_allclose(x, (np.arange(32) + 0.5) / 32, rtol=1e-6)
    assert x.min() > 0
    assert x.max() < 1
    np.testing.assert_allclose(t[:201], np.arange(201) * 0.01, atol=1e-6)
    assert np.all(np.diff(t) > 0)
    assert params == {
        "pde": pde,
        "n_samples": 3,
        "resolution": 32,
        "coefficient": 0.25,
        "seed": 0,
        "version": gen.VERSION,
    }
    assert gen.generator_params(path) == params


def test_layout_darcy(tmp_path):
    path, params = _make(tmp_path, "darcy2d", n_samples=3, resolution=16, coefficient=1.0)
    with h5py.File(path, "r") as f:
        assert set(f.keys()) == {"nu", "tensor", "x-coordinate", "y-coordinate", "t-coordinate"}
        assert f["nu"].shape == (3, 16, 16)
        assert f["tensor"].shape == (3, 1, 16, 16)
        assert f["t-coordinate"].shape == (10,)
        assert np.all(np.diff(f["t-coordinate"][()]) > 0)
        for key in f:
            assert f[key].dtype == np.float32
        assert f.attrs["beta"] == 1.0
        for key in ("x-coordinate", "y-coordinate"):
            np.testing.assert_allclose(f[key][()], (np.arange(16) + 0.5) / 16, rtol=1e-6)
    assert json.loads(h5py.File(path, "r").attrs["generator"]) == params


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_layout_cfd_is_pdebenchs_with_velocities_within_the_coefficient(tmp_path, dims):
    path, params = _make(tmp_path, f"cfd{dims}d", resolution=8, coefficient=0.5)
    data = _read(path)
    velocities = ["Vx", "Vy", "Vz"][:dims]
    assert sorted(k for k in data if not k.endswith("coordinate")) == sorted(["density", "pressure", *velocities])
    assert data["density"].shape == (4, gen.CFD_FRAMES, *[8] * dims) and data["density"].dtype == np.float32
    assert data["t-coordinate"].shape == (gen.CFD_FRAMES + 1,)
    for v in velocities:
        assert np.abs(data[v]).max() <= 0.5 and np.ptp(data[v], axis=tuple(range(1, dims + 2))).max() == 0
    assert gen.generator_params(path) == params and params["pde"] == f"cfd{dims}d"
    assert gen.pdebench_filename("cfd3d", 1.0) == "3D_CFD_Advected_V1.0_periodic_Train.hdf5"


def test_pdebench_filename():
    assert gen.pdebench_filename("advection1d", 0.1) == "1D_Advection_Sols_beta0.1.hdf5"
    assert gen.pdebench_filename("burgers1d", 0.001) == "1D_Burgers_Sols_Nu0.001.hdf5"
    assert gen.pdebench_filename("darcy2d", 1) == "2D_DarcyFlow_beta1.0_Train.hdf5"
    assert gen.pdebench_filename("darcy2d", 100.0) == "2D_DarcyFlow_beta100.0_Train.hdf5"
    with pytest.raises(ValueError, match="pde"):
        gen.pdebench_filename("heat1d", 0.1)


def test_generated_filename_names_every_setting():
    name = gen.generated_filename("advection1d", n_samples=40, resolution=64, coefficient=0.1, seed=0)
    assert name == "1D_Advection_Sols_beta0.1_n40_r64_s0.hdf5"
    name = gen.generated_filename("darcy2d", n_samples=1000, resolution=64, coefficient=1, seed=7)
    assert name == "2D_DarcyFlow_beta1.0_Train_n1000_r64_s7.hdf5"
    name = gen.generated_filename("burgers1d", n_samples=4, resolution=32, coefficient=1e-3, seed=2)
    assert name == "1D_Burgers_Sols_Nu0.001_n4_r32_s2.hdf5"
    settings = {"n_samples": 40, "resolution": 64, "coefficient": 0.1, "seed": 0}
    names = {gen.generated_filename("advection1d", **(settings | {key: value}))
             for key, value in [("n_samples", 41), ("resolution", 65), ("coefficient", 0.2), ("seed", 1)]}  # fmt: skip
    assert len(names) == 4 and gen.generated_filename("advection1d", **settings) not in names
    with pytest.raises(ValueError, match="pde"):
        gen.generated_filename("heat1d", **settings)


def test_configs_differing_in_n_samples_keep_a_file_each(tmp_path, monkeypatch):
    from tests.helpers import REPO
    from train.config import load_config
    from train.data.acquire.sources import stage_data

    def config(n_samples: int):
        overrides = [f"run.data_dir={tmp_path / 'data'}", f"tasks.advection1d.n_samples={n_samples}"]
        overrides += ["tasks.darcy2d.n_samples=10", "tasks.darcy2d.resolution=8"]
        return load_config(REPO / "configs" / "tiny.yaml", overrides)

    staged = stage_data(config(40))["advection1d"]
    first = staged.train
    assert first == tmp_path / "data" / "advection1d" / "1D_Advection_Sols_beta0.1_n40_r64_s0.hdf5"
    # The provenance the run folder gets: the generator's settings, and val/test carved from that file.
    settings = {"pde": "advection1d", "n_samples": 40, "resolution": 64, "coefficient": 0.1, "seed": 0}
    origins = staged.provenance.origins
    assert origins["train"] == {"origin": "generated", "file": str(first), "generator": settings | {"version": 1}}
    assert origins["test"]["origin"] == "carved" and origins["test"]["carved_from"] == str(first)
    assert (
        origins["test"]["convention"]
        == "PDEBench's single-file convention: test, val, train in sample order; test_fraction=0.1"
    )
    assert staged.provenance.warnings == ()
    before = (first.stat().st_mtime_ns, first.read_bytes())
    second = stage_data(config(20))["advection1d"].train
    assert second == first.with_name("1D_Advection_Sols_beta0.1_n20_r64_s0.hdf5")
    assert gen.generator_params(second)["n_samples"] == 20
    assert (first.stat().st_mtime_ns, first.read_bytes()) == before, "the other config's file was touched"
    assert gen.generator_params(first)["n_samples"] == 40

    def refuse(*args, **kwargs):
        raise AssertionError("regenerated a file that was up to date")

    monkeypatch.setattr(gen, "generate", refuse)
    assert stage_data(config(40))["advection1d"].train == first  # switching back costs nothing
    assert (first.stat().st_mtime_ns, first.read_bytes()) == before


def test_generator_params_absent_or_unreadable(tmp_path):
    assert gen.generator_params(tmp_path / "missing.hdf5") is None
    (tmp_path / "junk.hdf5").write_bytes(b"not an hdf5 file")
    assert gen.generator_params(tmp_path / "junk.hdf5") is None
    with h5py.File(tmp_path / "plain.hdf5", "w") as f:
        f["tensor"] = np.zeros(3)
    assert gen.generator_params(tmp_path / "plain.hdf5") is None


# -------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize(("pde", "res"), [("advection1d", 32), ("burgers1d", 32), ("darcy2d", 16)])
def test_determinism(tmp_path, monkeypatch, pde, res):
    a = _read(_make(tmp_path, pde, "a.hdf5", resolution=res, seed=3)[0])
    b = _read(_make(tmp_path, pde, "b.hdf5", resolution=res, seed=3)[0])
    c = _read(_make(tmp_path, pde, "c.hdf5", resolution=res, seed=4)[0])
    monkeypatch.setattr(gen, "CHUNK_ELEMENTS", 1)  # one sample per chunk
    d = _read(_make(tmp_path, pde, "d.hdf5", resolution=res, seed=3)[0])
    for key in a:
        assert a[key].tobytes() == b[key].tobytes()
        assert a[key].tobytes() == d[key].tobytes(), f"{key} depends on the chunk size"
    # no sample of one seed reappears under another (e.g. seed + index seeding would shift them by one)
    key = "nu" if pde == "darcy2d" else "tensor"  # Darcy's u also moves with the batch-mean threshold
    assert max(np.isclose(x, y).mean() for x in a[key] for y in c[key]) < 0.9


def test_1d_samples_do_not_depend_on_n_samples(tmp_path):
    few = _read(_make(tmp_path, "advection1d", "few.hdf5", n_samples=2)[0])["tensor"]
    many = _read(_make(tmp_path, "advection1d", "many.hdf5", n_samples=5)[0])["tensor"]
    np.testing.assert_array_equal(few, many[:2])


def test_initial_condition_statistics():
    p = gen._ic_params(0, 0, 2000)
    assert set(np.unique(p["k1"])) == {1, 2, 3, 4}
    assert p["a1"].min() >= 0
    assert p["a2"].max() < 1
    assert p["p1"].min() >= 0
    assert p["p2"].max() < 2 * np.pi
    assert 0.07 < p["abs"].mean() < 0.13
    assert 0.07 < p["window"].mean() < 0.13
    x = (np.arange(256) + 0.5) / 256
    u = gen._ic_eval(p, x[None, :])
    assert np.abs(u).max() <= 2
    rows = (p["abs"][:, 0] > 0) & (p["window"][:, 0] == 0)
    assert np.all(u[rows] * p["sign"][rows] >= 0)  # |u| with one sign per sample
    rows = p["window"][:, 0] > 0
    assert np.abs(u[rows][:, [0, -1]]).max() < 1e-5  # the window vanishes at the periodic seam


# ---------------------------------------------------------------------------------------- advection
def test_advection_is_an_exact_shift(tmp_path):
    # beta * dt_save * nx = 0.32 cells per frame: every 25 frames the shift is exactly 8 cells
    path, _ = _make(tmp_path, "advection1d", n_samples=6, resolution=64, coefficient=0.5)
    u = _read(path)["tensor"]
    for frame in (25, 50, 100, 125, 200):
        np.testing.assert_allclose(u[:, frame], np.roll(u[:, 0], 8 * frame // 25, axis=-1), rtol=0, atol=2e-6)


def test_advection_energy_is_constant(tmp_path):
    path, _ = _make(tmp_path, "advection1d", n_samples=20, resolution=128, coefficient=0.1)
    u = _read(path)["tensor"].astype(np.float64)
    energy = (u**2).sum(axis=-1)
    np.testing.assert_allclose(energy, energy[:, :1] * np.ones_like(energy), rtol=1e-4)
    assert not np.allclose(u[:, 37], u[:, 0])  # it moves


# ------------------------------------------------------------------------------------------ Burgers
@pytest.mark.parametrize("nu", [0.0, 0.01, 1.0])  # inviscid shocks ... diffusion-limited time step
def test_burgers_conserves_mass_and_creates_no_extrema(tmp_path, nu):
    path, _ = _make(tmp_path, "burgers1d", n_samples=12, resolution=64, coefficient=nu, seed=1)
    u = _read(path)["tensor"].astype(np.float64)
    assert np.isfinite(u).all()
    mass = u.sum(axis=-1)
    scale = np.abs(u[:, :1]).sum(axis=-1)
    assert np.abs(mass - mass[:, :1]).max(axis=1).max() / scale.min() < 1e-5
    peak = np.abs(u).max(axis=-1)
    assert np.all(np.diff(peak, axis=1) <= 1e-6 * peak[:, :1])
    assert np.all(peak[:, -1] < 0.9 * peak[:, 0])  # it dissipates


def test_burgers_viscosity_is_nu_over_pi_and_frames_land_on_save_times():
    # tiny amplitude: linear heat equation, mode k decays as exp(-(2 pi k)^2 (nu/pi) t) at every saved t
    nx, nu = 64, 0.1
    x = (np.arange(nx) + 0.5) / nx
    t = np.arange(11) * 0.01
    for k in (1, 2):
        u = gen._burgers_evolve(1e-3 * np.sin(2 * np.pi * k * x)[None, :], nu, 11, 0.01)
        amplitude = np.sqrt(2 * np.mean(u[0].astype(np.float64) ** 2, axis=-1)) / 1e-3
        np.testing.assert_allclose(amplitude, np.exp(-((2 * np.pi * k) ** 2) * nu / np.pi * t), rtol=2e-3)


def test_burgers_converges_with_resolution():
    def initial(nx):
        x = (np.arange(nx) + 0.5) / nx
        return (0.5 * np.sin(2 * np.pi * x) + 0.3 * np.cos(4 * np.pi * x) + 0.1)[None, :]

    ref = gen._burgers_evolve(initial(512), 0.05, 6, 0.04).astype(np.float64)
    errors = []
    for nx in (32, 64, 128):
        coarse = gen._burgers_evolve(initial(nx), 0.05, 6, 0.04)[0, -1]
        averaged = ref[0, -1].reshape(nx, 512 // nx).mean(axis=-1)  # cell averages on the coarse grid
        errors.append(np.sqrt(np.mean((coarse - averaged) ** 2)))
    assert errors[0] > 2.5 * errors[1] > 6 * errors[2], errors  # about second order


# -------------------------------------------------------------------------------------------- Darcy
def _darcy_residual(a: np.ndarray, u: np.ndarray, beta: float) -> float:
    """Flux form of -div(a grad u) - beta, written independently of the generator's matrix."""
    n = a.shape[0]
    h = 1.0 / n
    out = np.zeros_like(u)
    for axis in (0, 1):
        a_t, u_t = np.moveaxis(a, axis, 0), np.moveaxis(u, axis, 0)
        face_a = np.concatenate([a_t[:1], 2 * a_t[1:] * a_t[:-1] / (a_t[1:] + a_t[:-1]), a_t[-1:]])
        gaps = np.concatenate([u_t[:1] / (h / 2), np.diff(u_t, axis=0) / h, -u_t[-1:] / (h / 2)])
        flux = face_a * gaps  # a du/dx on the n + 1 faces, walls included
        out -= np.moveaxis(np.diff(flux, axis=0) / h, 0, axis)
    return float(np.linalg.norm(out - beta) / np.linalg.norm(np.full_like(u, beta)))


def test_darcy_coefficient_and_solution(tmp_path):
    path, _ = _make(tmp_path, "darcy2d", n_samples=6, resolution=32, coefficient=2.0, seed=5)
    data = _read(path)
    a, u = data["nu"], data["tensor"][:, 0]
    assert set(np.unique(a)) == {np.float32(0.1), np.float32(1.0)}
    fraction = (a == 1).mean(axis=(1, 2))
    assert np.all((fraction > 0.05) & (fraction < 0.95))  # every sample has both phases
    assert u[:, 1:-1, 1:-1].min() > 0
    ring = np.concatenate([u[:, 0], u[:, -1], u[:, :, 0], u[:, :, -1]], axis=1)
    assert np.all(ring.mean(axis=1) < 0.25 * u.max(axis=(1, 2)))
    for ai, ui in zip(a, u, strict=True):
        exact = gen.darcy_solve(ai, 2.0)
        assert _darcy_residual(ai.astype(np.float64), exact, 2.0) < 1e-8
        np.testing.assert_array_equal(ui, exact.astype(np.float32))  # the file's pair is consistent


def test_darcy_threshold_is_the_batch_mean(tmp_path):
    path, _ = _make(tmp_path, "darcy2d", n_samples=20, resolution=32, coefficient=1.0, seed=7)
    field = gen._smooth(gen._darcy_noise(7, 0, 20, 32))
    a = _read(path)["nu"]
    np.testing.assert_array_equal(a, np.where(field > field.mean(), 1.0, 0.1).astype(np.float32))
    assert 0.35 < (a == 1).mean() < 0.65


def test_darcy_poisson_maximum():
    # -lap u = beta on the unit square peaks at 0.07367 beta; the n = 64 cell centres miss the centre by h/2
    u = gen.darcy_solve(np.ones((64, 64)), 3.0)
    assert _darcy_residual(np.ones((64, 64)), u, 3.0) < 1e-8
    np.testing.assert_allclose(u.max(), 0.0736713 * 3.0, rtol=0.02)
    np.testing.assert_allclose(u, u.T, atol=1e-12)


# ------------------------------------------------------------------------------ arguments, atomicity
@pytest.mark.parametrize(
    ("pde", "kw", "word"),
    [
        ("heat1d", {}, "pde"),
        ("advection1d", {"n_samples": 0}, "n_samples"),
        ("advection1d", {"n_samples": 2.0}, "n_samples"),
        ("burgers1d", {"resolution": 4}, "resolution"),
        ("darcy2d", {"resolution": True}, "resolution"),
        ("burgers1d", {"coefficient": -0.01}, "nu"),
        ("advection1d", {"coefficient": float("nan")}, "beta"),
        ("darcy2d", {"coefficient": float("inf")}, "beta"),
        ("darcy2d", {"coefficient": "big"}, "beta"),
        ("advection1d", {"seed": -1}, "seed"),
    ],
)
def test_bad_arguments(tmp_path, pde, kw, word):
    with pytest.raises(ValueError, match=word):
        _make(tmp_path, pde, **kw)
    assert os.listdir(tmp_path) == []


def test_success_leaves_no_temporary_file(tmp_path):
    _make(tmp_path, "advection1d", "final.hdf5")
    assert os.listdir(tmp_path) == ["final.hdf5"]


def test_failure_mid_write_leaves_no_file(tmp_path, monkeypatch):
    real = gen._burgers_evolve
    calls = []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("disk on fire")
        return real(*args, **kw)

    monkeypatch.setattr(gen, "CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(gen, "_burgers_evolve", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        _make(tmp_path, "burgers1d", "final.hdf5", n_samples=3)
    assert len(calls) == 2  # it failed after writing one chunk
    assert os.listdir(tmp_path) == []

    (tmp_path / "final.hdf5").write_bytes(b"previous")
    calls.clear()
    with pytest.raises(RuntimeError):
        _make(tmp_path, "burgers1d", "final.hdf5", n_samples=3)
    assert os.listdir(tmp_path) == ["final.hdf5"]
    assert (tmp_path / "final.hdf5").read_bytes() == b"previous"


_STAGE_SCRIPT = """
import logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
from tests.helpers import REPO
from train.config import load_config
from train.data.acquire.sources import stage_data
overrides = [f"run.data_dir={sys.argv[1]}", "tasks.advection1d.n_samples=3000", "tasks.darcy2d.n_samples=10"]
cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.01)
path = stage_data(cfg)["advection1d"].train
print("IDENTITY", path.stat().st_ino, path.stat().st_mtime_ns)
"""


def test_concurrent_stages_generate_once(tmp_path):
    """Launchers sharing a data folder (a SLURM job array's tasks, several launchers on a node) generate each
    file once: a second generator replacing the file would change it under the first one's cache."""
    from tests.helpers import REPO

    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STAGE_SCRIPT, str(tmp_path / "data"), str(go)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    time.sleep(3)  # every process is waiting for the start
    go.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    logs = "".join(err for _, err in outputs)
    assert logs.count("data advection1d: generating") == 1, logs
    assert logs.count("data advection1d: up to date") == 2, logs
    assert len({line for out, _ in outputs for line in out.splitlines() if line.startswith("IDENTITY")}) == 1
