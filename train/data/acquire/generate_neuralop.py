"""Small datasets in neuraloperator's ``.pt`` layout (docs/neuralop-pt.md), for demos and tests.

Each call writes ``{name}_train_{res}.pt`` and ``{name}_test_{res}.pt`` with the keys, dtypes and axes of the
published files:

- ``darcy``: ``x`` bool (N, r, r), a piecewise-constant coefficient (a thresholded Gaussian random field; True
  is a = 12, False a = 3), ``y`` float32 (N, r, r), the solution of -div(a grad u) = 1 with u = 0 on the
  boundary (``train.data.acquire.generate.darcy_solve``). Both are stored column-major, strides (1, N, N*r), as
  some published files are.
- ``burgers``: ``x`` float64 (N, r), ``y`` float64 (N, r + 1, r) = u at t = 0, 1/r, ..., 1 with ``y[:, 0] ==
  x``, ``visc`` [[0.01]]: u_t + u u_x = 0.01 u_xx on the periodic unit interval (generate.py's finite-volume
  solver).
- ``nsforcing``: ``x``, ``y`` float32 (N, r, r): vorticity at t = 0 (a Gaussian random field) and t = 1 under
  nu = 1e-3 and the forcing 0.1 (sin 2pi(x+y) + cos 2pi(x+y)), by a pseudo-spectral Crank-Nicolson solver
  with 2/3 dealiasing, as the FNO paper's ``ns_2d.py``.

Sample i of a split draws its numbers from ``SeedSequence(seed, spawn_key=(split, i))`` only, so a sample does
not depend on the sample count or the block it is computed in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from train.data.acquire.generate import _burgers_evolve, darcy_solve
from train.data.formats.neuralop_pt import NAMES, write_pt
from train.errors import StopRequested

DARCY_VALUES = (3.0, 12.0)  # coefficient where the field is below / above zero (the FNO paper's 3 and 12)
BURGERS_VISC = 0.01
NS_VISC = 1e-3
NS_TIME = 1.0
BLOCK = 64  # samples solved together


def _rng(seed: int, split: int, i: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(split, i)))


def _wavenumbers(res: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer wavenumbers (res, res // 2 + 1) of rfft2 along the first and second axis."""
    k = np.fft.fftfreq(res, d=1.0 / res)
    kr = np.fft.rfftfreq(res, d=1.0 / res)
    return np.broadcast_arrays(k[:, None], kr[None, :])


def _grf(noise: np.ndarray, alpha: float, tau: float) -> np.ndarray:
    """Gaussian random fields with covariance sigma^2 (-Laplacian + tau^2)^-alpha on the periodic unit square,
    from white noise (n, r, r); sigma = tau^(alpha - 1) and a zero mean, as the FNO paper's GaussianRF."""
    res = noise.shape[-1]
    k1, k2 = _wavenumbers(res)
    sqrt_eig = tau ** (alpha - 1) * (4 * np.pi**2 * (k1**2 + k2**2) + tau**2) ** (-alpha / 2)
    sqrt_eig[0, 0] = 0.0
    # rfft2 of unit white noise has variance res^2 per mode; res * sqrt_eig turns that into res^2 * sqrt_eig.
    return np.fft.irfft2(np.fft.rfft2(noise) * res * sqrt_eig, s=(res, res))


def _darcy(seed: int, split: int, start: int, stop: int, res: int) -> dict[str, np.ndarray]:
    noise = np.stack([_rng(seed, split, i).standard_normal((res, res)) for i in range(start, stop)])
    x = _grf(noise, alpha=2.0, tau=3.0) > 0
    a = np.where(x, DARCY_VALUES[1], DARCY_VALUES[0])
    y = np.stack([darcy_solve(ai, 1.0) for ai in a]).astype(np.float32)
    return {"x": x, "y": y}


def _burgers(seed: int, split: int, start: int, stop: int, res: int) -> dict[str, np.ndarray]:
    grid = np.arange(res) / res
    u0 = np.zeros((stop - start, res))
    for row, i in enumerate(range(start, stop)):
        rng = _rng(seed, split, i)
        for k in range(1, 5):
            u0[row] += rng.normal(0.0, 0.5 / k) * np.sin(2 * np.pi * k * grid + rng.uniform(0, 2 * np.pi))
    # The solver keeps float32 frames: a float32-exact x is what makes y[:, 0] == x hold exactly.
    x = u0.astype(np.float32).astype(np.float64)
    # generate.py's solver diffuses with nu / pi (PDEBench's convention): scale to a viscosity of BURGERS_VISC.
    y = _burgers_evolve(x, BURGERS_VISC * np.pi, res + 1, 1.0 / res).astype(np.float64)
    return {"x": x, "y": y}


def _ns_evolve(w0: np.ndarray, visc: float, time: float) -> np.ndarray:
    """Vorticity (n, r, r) at ``time`` from w0 under the forcing, periodic unit square (``ns_2d.py``'s scheme)."""
    res = w0.shape[-1]
    k1, k2 = _wavenumbers(res)
    lap = 4 * np.pi**2 * (k1**2 + k2**2)
    lap_inv = lap.copy()
    lap_inv[0, 0] = 1.0
    dealias = (np.abs(k1) <= res / 3) & (k2 <= res / 3)
    grid = np.arange(res) / res
    xx, yy = np.meshgrid(grid, grid, indexing="ij")
    f_h = np.fft.rfft2(0.1 * (np.sin(2 * np.pi * (xx + yy)) + np.cos(2 * np.pi * (xx + yy))))
    steps = int(np.ceil(time / min(1e-3, 0.25 / res)))
    dt = time / steps
    w_h = np.fft.rfft2(w0)
    for _ in range(steps):
        psi_h = w_h / lap_inv
        u = np.fft.irfft2(2j * np.pi * k2 * psi_h, s=(res, res))  # velocity (psi_y, -psi_x)
        v = np.fft.irfft2(-2j * np.pi * k1 * psi_h, s=(res, res))
        w_x = np.fft.irfft2(2j * np.pi * k1 * w_h, s=(res, res))
        w_y = np.fft.irfft2(2j * np.pi * k2 * w_h, s=(res, res))
        nonlinear = np.fft.rfft2(u * w_x + v * w_y) * dealias
        w_h = (dt * (f_h - nonlinear) + (1 - 0.5 * dt * visc * lap) * w_h) / (1 + 0.5 * dt * visc * lap)
    return np.fft.irfft2(w_h, s=(res, res))


def _ns(seed: int, split: int, start: int, stop: int, res: int) -> dict[str, np.ndarray]:
    noise = np.stack([_rng(seed, split, i).standard_normal((res, res)) for i in range(start, stop)])
    w0 = _grf(noise, alpha=2.5, tau=7.0)
    return {"x": w0.astype(np.float32), "y": _ns_evolve(w0, NS_VISC, NS_TIME).astype(np.float32)}


SOLVERS = {"neuralop_darcy": _darcy, "neuralop_burgers": _burgers, "neuralop_ns": _ns}


def _split(pde: str, n: int, res: int, seed: int, split: int) -> dict[str, torch.Tensor]:
    blocks = []
    for start in range(0, n, BLOCK):
        StopRequested.check()
        blocks.append(SOLVERS[pde](seed, split, start, min(start + BLOCK, n), res))
    out = {key: np.concatenate([b[key] for b in blocks]) for key in blocks[0]}
    if pde == "neuralop_darcy":
        # Column-major, strides (1, N, N*r): the layout some published Darcy files have.
        return {key: torch.from_numpy(np.asfortranarray(value)) for key, value in out.items()}
    tensors = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in out.items()}
    if pde == "neuralop_burgers":
        tensors["visc"] = torch.tensor([[BURGERS_VISC]], dtype=torch.float64)
    return tensors


def generate_neuralop(
    folder: Path, pde: str, n_samples: int, resolution: int, seed: int, n_test: int | None = None
) -> list[Path]:
    """Write ``{name}_train_{res}.pt`` (``n_samples``) and ``{name}_test_{res}.pt`` (``n_test``; None: a fifth
    of ``n_samples``, at least 1) under ``folder``; returns both paths, train first."""
    if pde not in NAMES:
        raise ValueError(f"pde must be one of {sorted(NAMES)}, got {pde!r}")
    n_test = max(1, n_samples // 5) if n_test is None else n_test
    for key, value, low in (("n_samples", n_samples, 1), ("n_test", n_test, 1), ("resolution", resolution, 8)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
    paths = []
    for split, (name, n) in enumerate((("train", n_samples), ("test", n_test))):
        path = Path(folder) / f"{NAMES[pde]}_{name}_{resolution}.pt"
        paths.append(write_pt(path, _split(pde, int(n), int(resolution), int(seed), split)))
    return paths
