"""A small smoke-and-buoyancy Navier-Stokes dataset in PDEArena's exact HDF5 layout (an offline demo and test data).

PDEArena's NavierStokes2D set is smoke rising in an incompressible 2D flow: the smoke density u is advected by
the velocity (vx, vy), which the buoyancy force (0, buo_y * u) pushes upwards. PDEArena simulates it with
phiflow in a closed 32 x 32 box at 128^2; this generator solves the same equations on a periodic box [0, 32)^2
at ``resolution``^2, in vorticity form:

    u_t + v.grad(u) = 0        w_t + v.grad(w) = nu lap(w) + buo_y du/dx
    lap(psi) = -w,   vx = dpsi/dy,   vy = -dpsi/dx

(the curl of the buoyancy force drives the vorticity; its uniform part is balanced by pressure on a periodic
box). Each step, in phiflow's order: semi-Lagrangian advection of the smoke and the vorticity (departure points
traced with the midpoint velocity, the total smoke restored after interpolation), the buoyancy term, then
viscosity integrated exactly in Fourier space; the velocity comes from a spectral Poisson solve, so it is
divergence-free. The settings are PDEArena's standard set (pdedatagen/configs/
navierstokes2dsmoke.yaml with sample_rate 4): viscosity 0.01, buoyancy 0.5, steps of 1.5, the first 8 steps not
recorded, then a frame every 4th step, 14 frames. The smoke starts as |smooth noise| at rest. Arrays are
indexed [x, y] as PDEArena's; ``t``, ``x``, ``y`` hold the times and grid points actually simulated.

Sample i (over all splits) draws its smoke from ``default_rng([seed, i])`` only; the first 80% of the samples
are the train file, then 10% valid and 10% test (at least one each).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from train.atomic import atomic_path
from train.data.formats.pdearena import SPLIT_WORDS, file_name
from train.errors import StopRequested

LENGTH = 32.0  # PDEArena's Lx = Ly
VISCOSITY = 0.01
BUOYANCY = 0.5
STEP_DT = 1.5  # PDEArena's (tmax - tmin) / nt = (102 - 18) / 56
SKIP_STEPS = 8
SAMPLE_RATE = 4
BLOCK_BYTES = 64 << 20


def _wavenumbers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """kx (n, 1) and ky (1, n//2+1) of rfft2 over arrays indexed [x, y]."""
    kx = 2 * np.pi * np.fft.fftfreq(n, LENGTH / n)[:, None]
    ky = 2 * np.pi * np.fft.rfftfreq(n, LENGTH / n)[None, :]
    return kx, ky


def _initial_smoke(rng: np.random.Generator, n: int) -> np.ndarray:
    """|smooth Gaussian noise| scaled to a peak of 1, correlated over a tenth of the box (as phiflow's Noise)."""
    kx, ky = _wavenumbers(n)
    k2 = kx**2 + ky**2
    spectrum = np.exp(-k2 * (LENGTH / 10) ** 2 / 2) * (k2 > 0)
    field = np.abs(np.fft.irfft2(np.fft.rfft2(rng.standard_normal((n, n))) * spectrum, s=(n, n)))
    # Densities in [0, 1] keep speeds to a few units per time unit, a few grid points per step at 32^2.
    return field / max(field.max(), 1e-12)


def _interpolate(fields: np.ndarray, px: np.ndarray, py: np.ndarray) -> np.ndarray:
    """Bilinear interpolation of fields (k, b, n, n) at periodic grid positions px, py (b, n, n), in points."""
    k, b, n, _ = fields.shape
    x0, y0 = np.floor(px).astype(np.int64), np.floor(py).astype(np.int64)
    fx, fy = px - x0, py - y0
    x0, y0 = x0 % n, y0 % n
    x1, y1 = (x0 + 1) % n, (y0 + 1) % n
    flat = fields.reshape(k, b, n * n)

    def at(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.take_along_axis(flat, np.broadcast_to((x * n + y).reshape(1, b, -1), flat.shape), axis=2).reshape(
            k, b, n, n
        )

    return (1 - fx) * ((1 - fy) * at(x0, y0) + fy * at(x0, y1)) + fx * ((1 - fy) * at(x1, y0) + fy * at(x1, y1))


def _advect(fields: np.ndarray, vx: np.ndarray, vy: np.ndarray, dt: float) -> np.ndarray:
    """Semi-Lagrangian advection of fields (k, b, n, n), as phiflow's advect.semi_lagrangian: each point takes
    the value found a step upstream, bilinearly interpolated on the periodic grid; stable at any step and bounded
    by the old values. The departure point is traced back with the velocity at the midpoint of the path."""
    n = vx.shape[-1]
    steps = dt * n / LENGTH  # grid points per unit of velocity
    grid = np.arange(n, dtype=np.float64)
    hx, hy = grid[:, None] - 0.5 * steps * vx, grid[None, :] - 0.5 * steps * vy
    mid = _interpolate(np.stack([vx, vy]), hx, hy)
    return _interpolate(fields, grid[:, None] - steps * mid[0], grid[None, :] - steps * mid[1])


def simulate(smoke: np.ndarray, n_frames: int, sample_rate: int = SAMPLE_RATE) -> dict[str, np.ndarray]:
    """Evolve smoke densities (b, n, n) from rest; returns ``u``, ``vx``, ``vy`` (b, n_frames, n, n) float64, a
    frame every ``sample_rate`` steps."""
    b, n, _ = smoke.shape
    kx, ky = _wavenumbers(n)
    k2 = kx**2 + ky**2
    inv_k2 = np.where(k2 > 0, 1.0 / np.where(k2 > 0, k2, 1.0), 0.0)
    decay = np.exp(-VISCOSITY * k2 * STEP_DT)
    spatial = lambda f_hat: np.fft.irfft2(f_hat, s=(n, n))  # noqa: E731

    def velocity(w_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        psi_hat = w_hat * inv_k2  # lap(psi) = -w
        return spatial(1j * ky * psi_hat), spatial(-1j * kx * psi_hat)

    out = {key: np.empty((b, n_frames, n, n)) for key in ("u", "vx", "vy")}
    w_hat = np.zeros((b, n, n // 2 + 1), complex)
    recorded = _recorded_steps(n_frames, sample_rate)
    mass = smoke.sum(axis=(1, 2), keepdims=True)
    for step in range(1, max(recorded) + 1):
        # phiflow's order: advect the smoke, push with its buoyancy, advect and diffuse the flow.
        vx, vy = velocity(w_hat)
        smoke, w = _advect(np.stack([smoke, spatial(w_hat)]), vx, vy, STEP_DT)
        # The flow is divergence-free, so the total smoke is constant; interpolation at long steps loses a few
        # percent per trajectory, which a uniform rescaling puts back.
        smoke *= mass / np.maximum(smoke.sum(axis=(1, 2), keepdims=True), 1e-300)
        w_hat = (np.fft.rfft2(w) + STEP_DT * BUOYANCY * 1j * kx * np.fft.rfft2(smoke)) * decay
        if step in recorded:
            frame = recorded[step]
            vx, vy = velocity(w_hat)
            out["u"][:, frame], out["vx"][:, frame], out["vy"][:, frame] = smoke, vx, vy
    return out


def _recorded_steps(n_frames: int, sample_rate: int = SAMPLE_RATE) -> dict[int, int]:
    """Step (counted from 1) -> the frame recorded after it. PDEArena keeps its list of states after each step
    minus the first SKIP_STEPS, every sample_rate-th: the states after steps SKIP_STEPS + 1 + sample_rate * k."""
    return {SKIP_STEPS + 1 + sample_rate * k: k for k in range(n_frames)}


def frame_times(n_frames: int, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The simulated time of each recorded frame."""
    return np.array(sorted(_recorded_steps(n_frames, sample_rate))) * STEP_DT


def split_counts(n_samples: int) -> dict[str, int]:
    """Samples per split: 10% valid and test (at least one each), the rest train."""
    if n_samples < 3:
        raise ValueError(f"n_samples must be at least 3 (one per split), got {n_samples}")
    held = max(1, round(0.1 * n_samples))
    return {"train": n_samples - 2 * held, "val": held, "test": held}


def _write(path: Path, word: str, first: int, count: int, n: int, n_frames: int, seed: int, sample_rate: int) -> None:
    """One split's file, block by block, in PDEArena's layout (as train.data.formats.pdearena.write_pdearena)."""
    block = max(1, BLOCK_BYTES // (8 * 3 * n_frames * n * n))
    grid = np.arange(n) * (LENGTH / n)
    with atomic_path(path, needed=8 * count * n_frames * n * n * 3) as tmp, h5py.File(tmp, "w") as f:
        group = f.create_group(word)
        shape = (count, n_frames, n, n)
        fields = {key: group.create_dataset(key, shape, dtype=np.float64) for key in ("u", "vx", "vy")}
        group["t"] = np.tile(frame_times(n_frames, sample_rate), (count, 1))
        group["x"] = np.tile(grid, (count, 1))
        group["y"] = np.tile(grid, (count, 1))
        group["dt"] = np.full(count, STEP_DT * sample_rate)  # PDEArena's dt: the time between frames
        group["dx"] = np.full(count, LENGTH / n)
        group["dy"] = np.full(count, LENGTH / n)
        group["buo_y"] = np.full(count, BUOYANCY)
        for start in range(0, count, block):
            StopRequested.check()
            stop = min(count, start + block)
            smoke = np.stack([_initial_smoke(np.random.default_rng([seed, first + i]), n) for i in range(start, stop)])
            for key, value in simulate(smoke, n_frames, sample_rate).items():
                fields[key][start:stop] = value


def generate_pdearena(
    folder: Path, n_samples: int, resolution: int, seed: int, n_frames: int = 14, sample_rate: int = SAMPLE_RATE
) -> list[Path]:
    """Write a train, a valid and a test file named as PDEArena names them into ``folder``; returns their paths
    in that order. Each file is written atomically. ``sample_rate``: solver steps between recorded frames
    (PDEArena's standard set: 4, 6 time units; 1 records every step)."""
    checks = (
        ("resolution", resolution, 4),
        ("seed", seed, 0),
        ("n_frames", n_frames, 1),
        ("sample_rate", sample_rate, 1),
    )
    for name, value, low in checks:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    counts, paths, first = split_counts(n_samples), [], 0
    for split, count in counts.items():
        # PDEArena's generator appends the sample count to the train file's name only.
        path = Path(folder) / file_name(split, seed, BUOYANCY, count if split == "train" else None)
        _write(path, SPLIT_WORDS[split], first, count, resolution, n_frames, seed, sample_rate)
        paths.append(path)
        first += count
    return paths
