"""Small, deterministic PDEBench-format datasets generated locally (docs/data-formats.md, 'Generated files').

Equations (all on the unit interval / square, cell-centred grids, coordinates are cell centres):

- ``advection1d``: u_t + beta u_x = 0, periodic. Exact solution u(x, t) = u0((x - beta t) mod 1), evaluated
  analytically from the analytic initial condition.
- ``burgers1d``: u_t + (u^2/2)_x = (nu/pi) u_xx, periodic; the file attr ``Nu`` is nu. Second-order finite
  volume: MUSCL/minmod reconstruction, Rusanov flux, central diffusion flux, SSP-RK2, per-sample time step
  limited by advection and diffusion together, last substep shortened to land on every save time.
- ``cfd1d``, ``cfd2d``, ``cfd3d``: the compressible Euler equations' exact solution of a density pattern carried
  by a uniform flow at uniform pressure (train.data.acquire.generate_cfd); the coefficient is the largest speed
  of a velocity component, the resolution the points per axis, 21 frames over t = 0..1.
- ``euler1d``, ``euler2d``: the compressible Euler equations (gamma 5/3) solved by a finite-volume scheme
  (MUSCL, HLLC, SSP-RK2: train.data.acquire.euler) from smooth or Riemann initial states
  (train.data.acquire.generate_euler); the coefficient is the chance of a Riemann state, 21 frames over t = 0..0.4.
- ``darcy2d``: -div(a grad u) = beta, u = 0 on the boundary; a = 1 where a Gaussian-smoothed white-noise field
  exceeds the batch mean, 0.1 elsewhere. Five-point finite volume with harmonic-mean face coefficients, the
  wall half a cell away; exact steady state by a sparse direct solve (PDEBench stores a late pseudo-time
  relaxation frame instead).

Layout (float32, sample axis first, time before space, contiguous datasets like PDEBench):
1D: ``tensor`` (N, 201, nx), ``x-coordinate`` (nx,), ``t-coordinate`` (202,) -- one entry more than the
time axis, PDEBench's quirk; attr ``beta`` or ``Nu``. Darcy: ``nu`` (N, n, n) = a (input), ``tensor``
(N, 1, n, n) = u (output), ``x-coordinate``/``y-coordinate`` (n,), ``t-coordinate`` (10,); attr ``beta``.
Axis order [s, x, y].
Every file also carries a root attr ``generator`` (JSON of the request) read back by :func:`generator_params`.

Sample i draws its random numbers from ``SeedSequence(seed, spawn_key=(i,))`` only, so output is identical for
any chunk size, and 1D sample i does not depend on n_samples.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from train.atomic import atomic_path
from train.data.acquire.generate_cfd import write_cfd_fields
from train.data.acquire.generate_euler import FRAMES as EULER_FRAMES
from train.data.acquire.generate_euler import write_euler_fields
from train.errors import StopRequested
from train.pdes import GENERATED, LAYOUTS

VERSION = 1
N_FRAMES_1D = 201  # t = 0, 0.01, ..., 2.0
DT_SAVE = 0.01
CFL = 0.4  # of the combined advective + diffusive limit; keeps the MUSCL scheme free of new extrema
WINDOW_WIDTH = 0.02
DARCY_SIGMA = 0.04  # Gaussian smoothing length of the permeability noise, in domain units
CFD_FRAMES = 21  # t = 0, 0.05, ..., 1.0
CHUNK_ELEMENTS = 1 << 24  # float32 elements buffered per chunk (64 MiB) before writing to the file


def _check_pde(pde: str) -> None:
    if pde not in GENERATED:
        raise ValueError(f"pde must be one of {GENERATED}, got {pde!r}")


def _check_coefficient(pde: str, coefficient: float) -> float:
    name = {"burgers1d": "nu", "euler1d": "riemann", "euler2d": "riemann"}.get(pde)
    name = name or ("speed" if pde.startswith("cfd") else "beta")
    try:
        value = float(coefficient)
    except (TypeError, ValueError):
        raise ValueError(f"coefficient ({name}) must be a real number, got {coefficient!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"coefficient ({name}) must be finite, got {coefficient!r}")
    if pde == "burgers1d" and value < 0:
        raise ValueError(f"coefficient (nu) must be >= 0 (negative viscosity is ill-posed), got {value}")
    if pde.startswith("euler") and not 0 <= value <= 1:
        raise ValueError(f"coefficient (riemann) is the chance of a Riemann initial state: 0 to 1, got {value}")
    return value


def pdebench_filename(pde: str, coefficient: float) -> str:
    """PDEBench's file name; the coefficient prints as Python's ``str(float)`` (0.1, 0.001, 1.0)."""
    _check_pde(pde)
    return LAYOUTS[pde].generated_file.format(_check_coefficient(pde, coefficient))


def generated_filename(pde: str, *, n_samples: int, resolution: int, coefficient: float, seed: int) -> str:
    """The name :func:`generate`'s output is stored under: PDEBench's name with ``_n{n_samples}_r{resolution}
    _s{seed}`` before the suffix, e.g. ``1D_Advection_Sols_beta0.1_n40_r64_s0.hdf5``.

    Every setting that decides the bytes is in the name (the coefficient already is in PDEBench's part), so
    configs that generate one family differently each keep their file instead of regenerating one another's.
    """
    stem, _, suffix = pdebench_filename(pde, coefficient).rpartition(".")
    return f"{stem}_n{int(n_samples)}_r{int(resolution)}_s{int(seed)}.{suffix}"


def generator_params(path: str | Path) -> dict | None:
    """The ``generator`` attr of a file written by :func:`generate`; None if absent or unreadable."""
    try:
        with h5py.File(path, "r") as f:
            raw = f.attrs.get("generator")
        if raw is None:
            return None
        params = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
    except (OSError, ValueError, TypeError):
        return None
    return params if isinstance(params, dict) else None


# ----------------------------------------------------------------------------------------------- 1D ICs
def _ic_params(seed: int, start: int, stop: int) -> dict[str, np.ndarray]:
    """Random parameters of samples start..stop-1, shaped (c, 1) to broadcast against x (c, nx)."""
    rows = []
    for i in range(start, stop):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(i,)))
        k = rng.integers(1, 5, size=2)
        amp = rng.uniform(0.0, 1.0, size=2)
        phase = rng.uniform(0.0, 2.0 * np.pi, size=2)
        use_abs, use_window = rng.uniform(size=2) < 0.1
        sign = 1.0 if rng.uniform() < 0.5 else -1.0
        # window edges stay >= 7.5 widths from the periodic seam, so the window is periodic to ~1e-6
        left, right = rng.uniform(0.15, 0.45), rng.uniform(0.55, 0.85)
        rows.append((*k, *amp, *phase, use_abs, use_window, sign, left, right))
    table = np.array(rows, dtype=np.float64).reshape(-1, 11)
    names = ("k1", "k2", "a1", "a2", "p1", "p2", "abs", "window", "sign", "left", "right")
    return {name: table[:, j : j + 1] for j, name in enumerate(names)}


def _ic_eval(p: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Initial condition at positions x in [0, 1) (any shape broadcasting against (c, 1))."""
    u = p["a1"] * np.sin(2 * np.pi * p["k1"] * x + p["p1"])
    u = u + p["a2"] * np.sin(2 * np.pi * p["k2"] * x + p["p2"])
    u = np.where(p["abs"] > 0, p["sign"] * np.abs(u), u)
    window = 0.5 * (np.tanh((x - p["left"]) / WINDOW_WIDTH) - np.tanh((x - p["right"]) / WINDOW_WIDTH))
    return np.where(p["window"] > 0, u * window, u)


def _advection_chunk(p: dict[str, np.ndarray], x: np.ndarray, beta: float) -> np.ndarray:
    out = np.empty((p["k1"].shape[0], N_FRAMES_1D, x.size), dtype=np.float32)
    for k in range(N_FRAMES_1D):
        out[:, k] = _ic_eval(p, np.mod(x - beta * (k * DT_SAVE), 1.0))
    return out


# ------------------------------------------------------------------------------------------ Burgers
def _burgers_rhs(u: np.ndarray, dx: float, diff: float) -> np.ndarray:
    up = np.concatenate([u[:, -2:], u, u[:, :2]], axis=1)  # two periodic ghost cells per side
    d = np.diff(up, axis=1)
    lo, hi = d[:, :-1], d[:, 1:]
    slope = np.where(lo * hi > 0, np.where(np.abs(lo) < np.abs(hi), lo, hi), 0.0)  # minmod
    ul = up[:, 1:-2] + 0.5 * slope[:, :-1]  # faces i-1/2 for i = 0..nx: left and right states
    ur = up[:, 2:-1] - 0.5 * slope[:, 1:]
    speed = np.maximum(np.abs(ul), np.abs(ur))
    flux = 0.25 * (ul * ul + ur * ur) - 0.5 * speed * (ur - ul) - (diff / dx) * d[:, 1:-1]
    return (flux[:, :-1] - flux[:, 1:]) / dx


def _burgers_step(u: np.ndarray, dt: np.ndarray, dx: float, diff: float) -> np.ndarray:
    u1 = u + dt * _burgers_rhs(u, dx, diff)
    return 0.5 * u + 0.5 * (u1 + dt * _burgers_rhs(u1, dx, diff))


def _burgers_evolve(u0: np.ndarray, nu: float, n_frames: int, dt_save: float) -> np.ndarray:
    """Frames (c, n_frames, nx) at t = k*dt_save from cell values u0 (c, nx) on a periodic unit interval.

    Each sample keeps its own clock and time step, so a sample's result never depends on its chunk-mates.
    """
    c, nx = u0.shape
    dx, diff = 1.0 / nx, nu / np.pi
    out = np.empty((c, n_frames, nx), dtype=np.float32)
    u = np.array(u0, dtype=np.float64)
    out[:, 0] = u
    t = np.zeros(c)
    for k in range(1, n_frames):
        t_next = k * dt_save
        while (active := t < t_next).any():
            sub = u if active.all() else u[active]
            speed = np.maximum(np.abs(sub).max(axis=1), 1e-12)
            dt = CFL / (speed / dx + 2.0 * diff / dx**2)
            last = t[active] + dt >= t_next
            dt = np.where(last, t_next - t[active], dt)
            u[active] = _burgers_step(sub, dt[:, None], dx, diff)
            t[active] = np.where(last, t_next, t[active] + dt)
        out[:, k] = u
    return out


# -------------------------------------------------------------------------------------------- Darcy
def _darcy_noise(seed: int, start: int, stop: int, n: int) -> np.ndarray:
    return np.stack(
        [
            np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(i,))).standard_normal((n, n))
            for i in range(start, stop)
        ]
    )


def _smooth(noise: np.ndarray) -> np.ndarray:
    """Periodic Gaussian filter (std DARCY_SIGMA domain units) over the last two axes, via FFT."""
    n = noise.shape[-1]
    k = np.fft.fftfreq(n, d=1.0 / n)
    kr = np.fft.rfftfreq(n, d=1.0 / n)
    gain = np.exp(-2.0 * (np.pi * DARCY_SIGMA) ** 2 * (k[:, None] ** 2 + kr[None, :] ** 2))
    return np.fft.irfft2(np.fft.rfft2(noise) * gain, s=(n, n))


def _darcy_matrix(a: np.ndarray):
    """FV operator of -div(a grad .) on the n x n cell grid of (0,1)^2 with u = 0 on the walls (times h^2)."""
    import scipy.sparse as sp  # imported here: a third of a second of every launcher's and rank's start

    n = a.shape[0]
    idx = np.arange(n * n).reshape(n, n)
    cx = 2.0 * a[:-1, :] * a[1:, :] / (a[:-1, :] + a[1:, :])  # harmonic mean: flux continuity across a jump
    cy = 2.0 * a[:, :-1] * a[:, 1:] / (a[:, :-1] + a[:, 1:])
    diag = np.zeros((n, n))
    diag[:-1, :] += cx
    diag[1:, :] += cx
    diag[:, :-1] += cy
    diag[:, 1:] += cy
    # wall faces: gradient over the half cell between the centre and the wall, where u = 0
    diag[0, :] += 2.0 * a[0, :]
    diag[-1, :] += 2.0 * a[-1, :]
    diag[:, 0] += 2.0 * a[:, 0]
    diag[:, -1] += 2.0 * a[:, -1]
    pairs = ((idx[:-1, :], idx[1:, :], cx), (idx[:, :-1], idx[:, 1:], cy))
    rows = np.concatenate([idx.ravel()] + [r for i, j, _ in pairs for r in (i.ravel(), j.ravel())])
    cols = np.concatenate([idx.ravel()] + [r for i, j, _ in pairs for r in (j.ravel(), i.ravel())])
    vals = np.concatenate([diag.ravel()] + [-c.ravel() for _, _, c in pairs for _ in range(2)])
    return sp.csc_matrix((vals, (rows, cols)), shape=(n * n, n * n))


def darcy_solve(a: np.ndarray, beta: float) -> np.ndarray:
    """Solution u (n, n), float64, of -div(a grad u) = beta on (0,1)^2 with u = 0 on the boundary."""
    import scipy.sparse.linalg as spla

    a = np.asarray(a, dtype=np.float64)
    n = a.shape[0]
    # the operator is symmetric positive definite: a symmetric ordering and no pivoting keep fill-in low
    lu = spla.splu(_darcy_matrix(a), permc_spec="MMD_AT_PLUS_A", diag_pivot_thresh=0.0)
    return lu.solve(np.full(n * n, float(beta) / n**2)).reshape(n, n)


# ----------------------------------------------------------------------------------------- generate
def _chunk(per_sample: int) -> int:
    return int(np.clip(CHUNK_ELEMENTS // per_sample, 1, 256))


def _write_1d(f: h5py.File, pde: str, n: int, nx: int, coef: float, seed: int) -> None:
    x = (np.arange(nx) + 0.5) / nx
    f.create_dataset("x-coordinate", data=x.astype(np.float32))
    f.create_dataset("t-coordinate", data=(np.arange(N_FRAMES_1D + 1) * DT_SAVE).astype(np.float32))
    f.attrs["beta" if pde == "advection1d" else "Nu"] = coef
    tensor = f.create_dataset("tensor", shape=(n, N_FRAMES_1D, nx), dtype=np.float32)
    step = _chunk(N_FRAMES_1D * nx)
    for start in range(0, n, step):
        StopRequested.check()
        stop = min(start + step, n)
        p = _ic_params(seed, start, stop)
        if pde == "advection1d":
            tensor[start:stop] = _advection_chunk(p, x[None, :], coef)
        else:
            tensor[start:stop] = _burgers_evolve(_ic_eval(p, x[None, :]), coef, N_FRAMES_1D, DT_SAVE)


def _write_darcy(f: h5py.File, n: int, res: int, beta: float, seed: int) -> None:
    centres = ((np.arange(res) + 0.5) / res).astype(np.float32)
    f.create_dataset("x-coordinate", data=centres)
    f.create_dataset("y-coordinate", data=centres)
    f.create_dataset("t-coordinate", data=np.linspace(0.0, 1.0, 10, dtype=np.float32))
    f.attrs["beta"] = beta
    nu = f.create_dataset("nu", shape=(n, res, res), dtype=np.float32)
    tensor = f.create_dataset("tensor", shape=(n, 1, res, res), dtype=np.float32)
    step = _chunk(res * res)
    # Batch mean without holding the batch: the filter keeps the zero mode, so each smoothed field has its
    # raw noise's mean, and regenerating the noise costs far less than the solves.
    chunks = [(start, min(start + step, n)) for start in range(0, n, step)]
    threshold = np.concatenate([_darcy_noise(seed, s, e, res).mean(axis=(1, 2)) for s, e in chunks]).mean()
    for start, stop in chunks:
        StopRequested.check()
        # solve with the float32 values the file stores, so that (nu, tensor) is exactly one consistent pair
        a = np.where(_smooth(_darcy_noise(seed, start, stop, res)) > threshold, 1.0, 0.1).astype(np.float32)
        nu[start:stop] = a
        tensor[start:stop, 0] = np.stack([darcy_solve(ai, beta) for ai in a])


def file_bytes(pde: str, n_samples: int, resolution: int) -> int:
    """The bytes of the arrays a generated file holds (float32): what the disk must have room for."""
    if pde.startswith(("cfd", "euler")):
        dims, frames = LAYOUTS[pde].spatial_dims, CFD_FRAMES if pde.startswith("cfd") else EULER_FRAMES
        return 4 * int(n_samples) * frames * resolution**dims * (2 + dims)
    per_sample = 2 * resolution**2 if pde == "darcy2d" else N_FRAMES_1D * resolution
    return 4 * int(n_samples) * per_sample


def generate(
    pde: str, path: str | Path, *, n_samples: int, resolution: int, coefficient: float, seed: int
) -> dict[str, Any]:
    """Write a PDEBench-format file atomically at ``path``; returns the ``generator`` attr as a dict.

    ``resolution`` is nx (1D) or n (2D, n x n); ``coefficient`` is beta (advection, Darcy) or nu (Burgers).
    """
    _check_pde(pde)
    for name, value, low in (("n_samples", n_samples, 1), ("resolution", resolution, 8), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    coef = _check_coefficient(pde, coefficient)
    params = {
        "pde": pde,
        "n_samples": int(n_samples),
        "resolution": int(resolution),
        "coefficient": coef,
        "seed": int(seed),
        "version": VERSION,
    }
    with atomic_path(path, needed=file_bytes(pde, n_samples, resolution)) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["generator"] = json.dumps(params, sort_keys=True)
        if pde == "darcy2d":
            _write_darcy(f, params["n_samples"], params["resolution"], coef, params["seed"])
        elif pde.startswith("cfd"):
            grid = (params["resolution"],) * LAYOUTS[pde].spatial_dims
            write_cfd_fields(f, params["n_samples"], CFD_FRAMES, grid, params["seed"], coef)
        elif pde.startswith("euler"):
            grid = (params["resolution"],) * LAYOUTS[pde].spatial_dims
            write_euler_fields(f, params["n_samples"], grid, params["seed"], coef)
        else:
            _write_1d(f, pde, params["n_samples"], params["resolution"], coef, params["seed"])
    return params
