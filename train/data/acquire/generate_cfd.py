"""Compressible-flow files in PDEBench's CFD layout (1D, 2D or 3D), written block by block.

PDEBench's CFD files hold one dataset per field, each [sample, t, *space] float32: ``density``, ``pressure``
and the velocity components ``Vx`` (1D), ``Vx, Vy`` (2D), ``Vx, Vy, Vz`` (3D); ``x-coordinate`` (and
``y-``, ``z-coordinate``) at the cell centres and ``t-coordinate``, which carries one entry more than the time
axis. The fields written are an exact solution of the compressible Euler equations on the periodic unit box: a
density pattern carried by a uniform flow at uniform pressure, each sample with its own velocity, pressure and
pattern (two plane waves of random direction, wavenumber, amplitude and phase). Sample i draws its numbers from
(seed, i) only, so a file's samples do not depend on the block size or the sample count.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from train.atomic import atomic_path
from train.errors import StopRequested

VELOCITIES = ("Vx", "Vy", "Vz")
BLOCK_BYTES = 64 << 20


def cfd_fields(dims: int) -> tuple[str, ...]:
    return ("density", "pressure", *VELOCITIES[:dims])


def _sample(seed: int, i: int, grid: tuple[int, ...], times: np.ndarray, speed: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, i])
    dims = len(grid)
    velocity = rng.uniform(-1.0, 1.0, dims) * speed
    axes = np.meshgrid(*[(np.arange(n) + 0.5) / n for n in grid], indexing="ij")
    density = np.ones((len(times), *grid), np.float64)
    for _ in range(2):
        k = rng.integers(1, 4, dims) * rng.choice((-1, 1), dims)
        amplitude, phase = rng.uniform(0.05, 0.3), rng.uniform(0.0, 2 * np.pi)
        # rho(x, t) = rho0(x - v t): the wave's phase moves by k.v t
        arg = sum(k[a] * axes[a] for a in range(dims))[None] - (k @ velocity) * times.reshape(-1, *[1] * dims)
        density += amplitude * np.sin(2 * np.pi * arg + phase)
    shape = density.shape
    out = {"density": density, "pressure": np.full(shape, rng.uniform(0.5, 2.0))}
    for a in range(dims):
        out[VELOCITIES[a]] = np.full(shape, velocity[a])
    return {key: value.astype(np.float32) for key, value in out.items()}


def write_cfd_fields(f: h5py.File, n_samples: int, frames: int, grid: tuple[int, ...], seed: int, speed: float = 1.0):
    """The fields and coordinates into an open file; each velocity component drawn from [-speed, speed]."""
    assert 1 <= len(grid) <= 3, grid
    times = np.linspace(0.0, 1.0, frames)
    per_sample = 4 * frames * int(np.prod(grid)) * (2 + len(grid))
    block = max(1, BLOCK_BYTES // per_sample)
    sets = {k: f.create_dataset(k, (n_samples, frames, *grid), "<f4") for k in cfd_fields(len(grid))}
    for axis, n in zip("xyz", grid, strict=False):
        f[f"{axis}-coordinate"] = ((np.arange(n) + 0.5) / n).astype(np.float32)
    f["t-coordinate"] = np.append(times, times[-1] + (times[1] - times[0] if frames > 1 else 1)).astype(np.float32)
    for start in range(0, n_samples, block):
        StopRequested.check()
        stop = min(n_samples, start + block)
        samples = [_sample(seed, i, grid, times, speed) for i in range(start, stop)]
        for key, dataset in sets.items():
            dataset[start:stop] = np.stack([s[key] for s in samples])


def write_cfd(path: str | Path, n_samples: int, frames: int, grid: tuple[int, ...], seed: int = 0) -> Path:
    """Write the file atomically (a temporary name until complete); contiguous datasets, as PDEBench's."""
    path = Path(path)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        write_cfd_fields(f, n_samples, frames, grid, seed)
    return path
