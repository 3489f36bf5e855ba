"""Compressible-flow files in PDEBench's CFD layout solved by a finite-volume scheme (train.data.acquire.euler):
``euler1d`` and ``euler2d``, the Euler equations with gamma = 5/3 (PDEBench's CFD) on the periodic unit interval
or square, 21 frames over t = 0..0.4.

Each sample starts either smooth or as a Riemann problem, the ``coefficient`` being the chance of the latter:

- **smooth** (acoustic): one or two Gaussian pulses of density on a uniform background, pressure isentropic with
  it (p = p0 (rho / rho0)^gamma), a uniform flow plus a sine perturbation of each velocity component: sound waves
  that steepen as they travel;
- **Riemann**: piecewise-constant states with random density (0.2-2), pressure (0.2-2) and velocity
  (-0.5-0.5 per component) on each side of a random interface (1D; on a periodic interval, two interfaces), or
  in the four quadrants around a random point (2D): shocks, contact discontinuities and rarefactions.

The fields ``density``, ``pressure``, ``Vx`` (and ``Vy``) are [sample, t, *space] float32, with PDEBench's
coordinates (cell centres; ``t-coordinate`` one entry longer than the time axis). Sample i draws its numbers from
(seed, i) only, so a file's samples do not depend on the block size or the sample count.
"""

from __future__ import annotations

import h5py
import numpy as np

from train.data.acquire.euler import evolve
from train.data.acquire.generate_cfd import cfd_fields
from train.errors import StopRequested

GAMMA = 5.0 / 3.0
FRAMES = 21
T_END = 0.4
BLOCK = 16
"""Samples solved together (vectorised): a block's memory is a few MB at the generated sizes."""


def _smooth(rng: np.random.Generator, grid: tuple[int, ...]) -> np.ndarray:
    dims = len(grid)
    axes = np.meshgrid(*[(np.arange(n) + 0.5) / n for n in grid], indexing="ij")
    rho0, p0 = rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5)
    rho = np.full(grid, rho0)
    for _ in range(rng.integers(1, 3)):
        centre, width, amplitude = rng.uniform(0, 1, dims), rng.uniform(0.05, 0.15), rng.uniform(0.1, 0.5)
        # the nearest periodic image of the centre
        r2 = sum(((axes[a] - centre[a] + 0.5) % 1.0 - 0.5) ** 2 for a in range(dims))
        rho = rho + amplitude * rho0 * np.exp(-r2 / (2 * width**2))
    pressure = p0 * (rho / rho0) ** GAMMA
    velocity = []
    for a in range(dims):
        k, phase = rng.integers(1, 3), rng.uniform(0, 2 * np.pi)
        velocity.append(rng.uniform(-0.3, 0.3) + rng.uniform(0, 0.2) * np.sin(2 * np.pi * k * axes[a] + phase))
    return np.stack([rho, *velocity, pressure])


def _riemann(rng: np.random.Generator, grid: tuple[int, ...]) -> np.ndarray:
    dims = len(grid)
    axes = np.meshgrid(*[(np.arange(n) + 0.5) / n for n in grid], indexing="ij")
    corner = rng.uniform(0.25, 0.75, dims)
    region = sum((axes[a] > corner[a]).astype(int) << a for a in range(dims))  # 2 sides (1D) or 4 quadrants (2D)
    states = rng.uniform([0.2, *[-0.5] * dims, 0.2], [2.0, *[0.5] * dims, 2.0], (2**dims, 2 + dims))
    return np.moveaxis(states[region], -1, 0)


def write_euler_fields(f: h5py.File, n_samples: int, grid: tuple[int, ...], seed: int, riemann: float) -> None:
    """The fields and coordinates of ``n_samples`` solved samples into an open file; ``riemann``: the chance of a
    Riemann initial state (else smooth)."""
    assert len(grid) in (1, 2), grid
    dims = len(grid)
    times = np.linspace(0.0, T_END, FRAMES)
    names = cfd_fields(dims)  # density, pressure, Vx[, Vy]
    sets = {k: f.create_dataset(k, (n_samples, FRAMES, *grid), "<f4") for k in names}
    for axis, n in zip("xy", grid, strict=False):
        f[f"{axis}-coordinate"] = ((np.arange(n) + 0.5) / n).astype(np.float32)
    f["t-coordinate"] = np.append(times, times[-1] + times[1] - times[0]).astype(np.float32)
    f.attrs["gamma"] = GAMMA
    for start in range(0, n_samples, BLOCK):
        StopRequested.check()
        stop = min(start + BLOCK, n_samples)
        states = []
        for i in range(start, stop):
            rng = np.random.default_rng([seed, i])
            states.append(_riemann(rng, grid) if rng.uniform() < riemann else _smooth(rng, grid))
        frames = evolve(np.stack(states), times, GAMMA, "periodic")  # (b, t, rho, velocity..., p)
        sets["density"][start:stop] = frames[:, :, 0]
        sets["pressure"][start:stop] = frames[:, :, -1]
        for a in range(dims):
            sets[names[2 + a]][start:stop] = frames[:, :, 1 + a]
