"""The Euler equations' finite-volume solver (train.data.acquire.euler) against the exact solution of Sod's shock
tube, its conservation of mass, momentum and energy on a periodic domain, and the generated files' layout."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from train.data.acquire.euler import conservative, evolve, sod_exact
from train.data.acquire.generate import generate

SOD_LEFT, SOD_RIGHT = (1.0, 0.0, 1.0), (0.125, 0.0, 0.1)


def _sod(nx: int) -> tuple[np.ndarray, np.ndarray]:
    x = (np.arange(nx) + 0.5) / nx
    w0 = np.zeros((1, 3, nx))
    for v in range(3):
        w0[0, v] = np.where(x < 0.5, SOD_LEFT[v], SOD_RIGHT[v])
    solved = evolve(w0, np.array([0.0, 0.2]), 1.4, boundary="outflow")[0, -1]
    return solved, sod_exact(x, 0.2, SOD_LEFT, SOD_RIGHT, 1.4)


def test_the_solver_converges_to_the_exact_sod_solution():
    """Sod's shock tube (gamma 1.4, t = 0.2): the L1 error of density at 200 cells within 0.004 (measured 0.0026),
    and it shrinks with the grid (a shock, a contact and a rarefaction: first order at the discontinuities)."""
    errors = {}
    for nx in (100, 200, 400):
        solved, exact = _sod(nx)
        errors[nx] = np.abs(solved - exact).mean(axis=1)  # rho, u, p
    assert errors[200][0] <= 0.004 and errors[200][2] <= 0.003 and errors[200][1] <= 0.008, errors[200]
    assert errors[400][0] < 0.7 * errors[200][0] < 0.7 * 0.7 * errors[100][0], errors


def test_the_exact_solution_is_sods():
    """The star region of Sod's problem (Toro's table 4.2, gamma 1.4): p* = 0.30313, u* = 0.92745."""
    x = np.array([0.7, 0.8])  # between the contact (0.685) and the shock (0.85) at t = 0.2
    rho, u, p = sod_exact(x, 0.2, SOD_LEFT, SOD_RIGHT, 1.4)
    assert p == pytest.approx([0.30313, 0.30313], abs=1e-5) and u == pytest.approx([0.92745] * 2, abs=1e-5)
    assert rho == pytest.approx([0.26557] * 2, abs=1e-5)


@pytest.mark.parametrize("dims", [1, 2])
def test_mass_momentum_and_energy_are_conserved_on_a_periodic_domain(dims):
    rng = np.random.default_rng(0)
    grid = (64,) if dims == 1 else (24, 24)
    axes = np.meshgrid(*[(np.arange(n) + 0.5) / n for n in grid], indexing="ij")
    w0 = np.empty((2, 2 + dims, *grid))
    w0[:, 0] = 1 + 0.8 * (axes[0] < 0.4) + 0.1 * rng.uniform(size=(2, *grid))  # a jump and noise
    w0[:, 1 : 1 + dims] = rng.uniform(-0.5, 0.5, (2, dims, *grid))
    w0[:, -1] = 1 + 0.5 * (axes[-1] > 0.6)
    before = conservative(w0, 5 / 3).reshape(2, 2 + dims, -1).sum(-1)
    after = conservative(evolve(w0, np.array([0.0, 0.1, 0.2]), 5 / 3)[:, -1], 5 / 3).reshape(2, 2 + dims, -1).sum(-1)
    assert np.abs(after - before).max() <= 1e-12 * np.abs(before).max()


def test_generated_euler_files_are_pdebench_cfd_files_with_shocks(tmp_path):
    generate("euler1d", tmp_path / "e.hdf5", n_samples=3, resolution=64, coefficient=1.0, seed=0)
    with h5py.File(tmp_path / "e.hdf5") as f:
        assert {k: f[k].shape for k in f} == {
            "density": (3, 21, 64), "pressure": (3, 21, 64), "Vx": (3, 21, 64), "x-coordinate": (64,),
            "t-coordinate": (22,),
        }  # fmt: skip
        density = f["density"][...]
    assert (density > 0).all() and np.isfinite(density).all()
    jumps = np.abs(np.diff(density[:, -1], axis=-1)).max(axis=-1)
    assert (jumps > 0.05).all(), jumps  # discontinuities survive: Riemann states, not smooth ones
    with pytest.raises(ValueError, match="chance of a Riemann initial state: 0 to 1"):
        generate("euler1d", tmp_path / "x.hdf5", n_samples=1, resolution=16, coefficient=2.0, seed=0)
