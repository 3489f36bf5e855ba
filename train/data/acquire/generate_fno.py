"""Small datasets of the FNO paper's three problems, written under the paper's file names in its exact layouts
(docs/fno-mat.md), so a task with ``pde: fno_*`` runs without the published files.

- ``fno_burgers``: u_t + (u^2/2)_x = nu u_xx, nu = 0.1, periodic [0, 1); the initial condition a is drawn from
  the paper's Gaussian random field N(0, 625 (-Laplacian + 25 I)^-2) and u is the solution at T = 1.
  Pseudo-spectral with the 2/3 dealiasing rule and an integrating-factor RK4 step, so the time step is limited by
  advection only. MATLAB v5, float64, keys ``a`` and ``u`` (N, s).
- ``fno_darcy``: -div(a grad u) = 1 on (0, 1)^2, u = 0 on the boundary; a = 12 where a Neumann Gaussian random
  field ((-Laplacian + 9 I)^-2, the paper's GRF.m drawn with a DCT) is >= 0, else 3. Five-point finite
  differences on the s x s vertex grid (boundary points included, as the paper's 421 grid), harmonic-mean face
  coefficients, a sparse direct solve. A train and a test file (smooth1, smooth2), v5, float64, keys ``coeff``,
  ``sol`` (N, s, s).
- ``fno_ns``: the vorticity form w_t + u.grad w = nu lap w + f on the periodic unit square, nu = 1e-3, f = 0.1
  (sin 2pi(x+y) + cos 2pi(x+y)); w0 drawn as the paper's ns_2d.py does (GaussianRF alpha 2.5, tau 7). The same
  scheme as ns_2d.py (pseudo-spectral, Crank-Nicolson on the viscous term, explicit on the rest, 2/3
  dealiasing), run on the s x s grid itself with a step of 1/max(50, s) instead of 1e-4 at 256^2 (its error at
  s = 64 is below 1e-3 of the field). Recorded at t = 1..T; MATLAB v7.3, float32, keys ``a`` (N, s, s), ``u``
  (N, s, s, T), ``t`` (1, T).

Every file holds ``n_samples`` samples. Sample i of file j draws its random numbers from
``SeedSequence(seed, spawn_key=(j, i))`` only, so a sample does not depend on how many are generated.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from train.data.formats.fno_mat import write_mat
from train.errors import StopRequested
from train.pdes import LAYOUTS

FAMILIES = ("fno_burgers", "fno_darcy", "fno_ns")
BURGERS_NU = 0.1
BURGERS_MODES = 256  # Fourier modes drawn per initial condition: the same function at every resolution
BURGERS_CFL = 0.5
DARCY_ALPHA, DARCY_TAU = 2.0, 3.0
DARCY_HIGH, DARCY_LOW = 12.0, 3.0
NS_NU = 1e-3
NS_ALPHA, NS_TAU = 2.5, 7.0
NS_BATCH = 64  # samples stepped together: bounds the solver's memory


def _rng(seed: int, file: int, sample: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(file, sample)))


# ------------------------------------------------------------------------------------------------ Burgers
def burgers_initial(seed: int, file: int, samples: range, s: int) -> np.ndarray:
    """Initial conditions (n, s) from N(0, 625 (-Laplacian + 25 I)^-2) on the periodic unit interval."""
    k = np.arange(BURGERS_MODES + 1)
    root = 25.0 / ((2 * np.pi * k) ** 2 + 25.0)  # square root of the covariance's eigenvalues
    coef = np.zeros((len(samples), s // 2 + 1), np.complex128)
    keep = min(BURGERS_MODES, s // 2 - 1)  # the Nyquist mode has no sine partner: left out
    for row, i in enumerate(samples):
        xi = _rng(seed, file, i).standard_normal((2, BURGERS_MODES + 1))
        # irfft's (1/s)(c0 + 2 Re sum c_k e^{ikx}) gives sqrt(lambda_k) (xi cos + eta sin) sqrt(2) per mode
        coef[row, : keep + 1] = s * root[: keep + 1] * (xi[0, : keep + 1] - 1j * xi[1, : keep + 1]) / math.sqrt(2)
        coef[row, 0] = s * root[0] * xi[0, 0]
    return np.fft.irfft(coef, n=s)


def burgers_solve(u0: np.ndarray, t_end: float = 1.0, nu: float = BURGERS_NU) -> np.ndarray:
    """Solutions (n, s) at ``t_end`` of viscous Burgers from u0 (n, s); each sample takes its own step count."""
    s = u0.shape[1]
    k = 2 * np.pi * np.fft.rfftfreq(s, d=1.0 / s)
    dealias = np.abs(np.fft.rfftfreq(s, d=1.0 / s)) <= s / 3
    # viscosity keeps max|u| from growing, so the initial maximum bounds the advective step
    umax = np.maximum(np.abs(u0).max(axis=1), 1e-6)
    steps = np.ceil(t_end * umax * s / BURGERS_CFL).astype(int)
    dt = (t_end / steps)[:, None]
    e, e2 = np.exp(-nu * k**2 * dt), np.exp(-nu * k**2 * dt / 2)

    def nonlinear(v: np.ndarray) -> np.ndarray:
        return -0.5j * k * dealias * np.fft.rfft(np.fft.irfft(v, n=s) ** 2)

    v = np.fft.rfft(u0)
    for step in range(int(steps.max())):
        if step % 500 == 0:
            StopRequested.check()
        a = nonlinear(v)
        b = nonlinear(e2 * (v + dt / 2 * a))
        c = nonlinear(e2 * v + dt / 2 * b)
        d = nonlinear(e * v + dt * e2 * c)
        new = e * v + dt / 6 * (e * a + 2 * e2 * (b + c) + d)
        v = np.where((step < steps)[:, None], new, v)
    return np.fft.irfft(v, n=s)


# -------------------------------------------------------------------------------------------------- Darcy
def darcy_coefficient(seed: int, file: int, i: int, s: int) -> np.ndarray:
    """The piecewise-constant coefficient (s, s): 12 where the GRF is >= 0, else 3 (the paper's GRF.m)."""
    import scipy.fft

    k1, k2 = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    coef = DARCY_TAU ** (DARCY_ALPHA - 1) * (np.pi**2 * (k1**2 + k2**2) + DARCY_TAU**2) ** (-DARCY_ALPHA / 2)
    spectrum = s * coef * _rng(seed, file, i).standard_normal((s, s))
    spectrum[0, 0] = 0.0  # a zero-mean field: the threshold at 0 splits the square in comparable parts
    field = scipy.fft.idctn(spectrum, type=2, norm="ortho")
    return np.where(field >= 0, DARCY_HIGH, DARCY_LOW)


def darcy_vertex_solve(a: np.ndarray, f: float = 1.0) -> np.ndarray:
    """u (s, s) of -div(a grad u) = f with u = 0 on the boundary rows and columns of the s x s vertex grid."""
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla

    s = a.shape[0]
    m, h = s - 2, 1.0 / (s - 1)
    cx = 2 * a[:-1, :] * a[1:, :] / (a[:-1, :] + a[1:, :])  # face (i, i+1) along the first axis, (s-1, s)
    cy = 2 * a[:, :-1] * a[:, 1:] / (a[:, :-1] + a[:, 1:])  # face (j, j+1) along the second axis, (s, s-1)
    idx = np.arange(m * m).reshape(m, m)
    diag = cx[:-1, 1:-1] + cx[1:, 1:-1] + cy[1:-1, :-1] + cy[1:-1, 1:]
    east, north = cx[1:-1, 1:-1], cy[1:-1, 1:-1]  # faces between two interior points
    rows = np.concatenate([idx.ravel(), idx[:-1].ravel(), idx[1:].ravel(), idx[:, :-1].ravel(), idx[:, 1:].ravel()])
    cols = np.concatenate([idx.ravel(), idx[1:].ravel(), idx[:-1].ravel(), idx[:, 1:].ravel(), idx[:, :-1].ravel()])
    vals = np.concatenate([diag.ravel(), -east.ravel(), -east.ravel(), -north.ravel(), -north.ravel()])
    matrix = sp.csc_matrix((vals, (rows, cols)), shape=(m * m, m * m))
    u = np.zeros((s, s))
    u[1:-1, 1:-1] = spla.spsolve(matrix, np.full(m * m, f * h * h)).reshape(m, m)
    return u


# ------------------------------------------------------------------------------------------ Navier-Stokes
def ns_initial(seed: int, file: int, samples: range, s: int) -> np.ndarray:
    """w0 (n, s, s) as ns_2d.py's GaussianRF(2, s, alpha=2.5, tau=7).sample: the real part of an inverse FFT."""
    k = np.fft.fftfreq(s, d=1.0 / s)
    kx, ky = np.meshgrid(k, k, indexing="ij")
    sigma = NS_TAU ** (0.5 * (2 * NS_ALPHA - 2))
    root = s * s * math.sqrt(2.0) * sigma * (4 * np.pi**2 * (kx**2 + ky**2) + NS_TAU**2) ** (-NS_ALPHA / 2)
    root[0, 0] = 0.0
    xi = np.stack([_rng(seed, file, i).standard_normal((2, s, s)) for i in samples])
    return np.fft.ifft2(root * (xi[:, 0] + 1j * xi[:, 1])).real


def ns_solve(w0: np.ndarray, n_frames: int, nu: float = NS_NU) -> np.ndarray:
    """Vorticity (n, s, s, n_frames) at t = 1..n_frames from w0 (n, s, s): ns_2d.py's navier_stokes_2d."""
    n, s, _ = w0.shape
    grid = np.linspace(0, 1, s + 1)[:-1]
    x, y = np.meshgrid(grid, grid, indexing="ij")
    forcing = 0.1 * (np.sin(2 * np.pi * (x + y)) + np.cos(2 * np.pi * (x + y)))
    k_max = s // 2
    ky = np.tile(np.concatenate([np.arange(0, k_max), np.arange(-k_max, 0)]), (s, 1))
    kx = ky.T
    kx, ky = kx[:, : k_max + 1], ky[:, : k_max + 1]
    lap = 4 * np.pi**2 * (kx**2 + ky**2)
    lap[0, 0] = 1.0
    dealias = (np.abs(ky) <= 2 / 3 * k_max) & (np.abs(kx) <= 2 / 3 * k_max)
    per_unit = max(50, s)
    dt = 1.0 / per_unit
    implicit = 1.0 + 0.5 * dt * nu * lap
    explicit = 1.0 - 0.5 * dt * nu * lap
    w_h, f_h = np.fft.rfft2(w0), np.fft.rfft2(forcing)
    out = np.empty((n, s, s, n_frames))
    for step in range(1, n_frames * per_unit + 1):
        if step % 200 == 0:
            StopRequested.check()
        psi_h = w_h / lap
        # velocity (psi_y, -psi_x) and the vorticity gradient, four inverse transforms in one call
        fields = np.fft.irfft2(2j * np.pi * np.stack([ky * psi_h, -kx * psi_h, kx * w_h, ky * w_h]), s=(s, s))
        advection = dealias * np.fft.rfft2(fields[0] * fields[2] + fields[1] * fields[3])
        w_h = (-dt * advection + dt * f_h + explicit * w_h) / implicit
        if step % per_unit == 0:
            out[..., step // per_unit - 1] = np.fft.irfft2(w_h, s=(s, s))
    return out


# ---------------------------------------------------------------------------------------------- generate
def _check(pde: str, n_samples: int, resolution: int, seed: int, n_frames: int) -> None:
    if pde not in FAMILIES:
        raise ValueError(f"pde must be one of {FAMILIES}, got {pde!r}")
    for name, value, low in (
        ("n_samples", n_samples, 1),
        ("resolution", resolution, 8),
        ("seed", seed, 0),
        ("n_frames", n_frames, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def generate_fno(
    folder: Path, pde: str, n_samples: int, resolution: int, seed: int, *, n_frames: int = 20
) -> list[Path]:
    """Write a small dataset of an FNO family into ``folder`` under the family's published file names (the
    ``files`` defaults of train.pdes.LAYOUTS), each file atomically and holding ``n_samples`` samples on a
    ``resolution`` grid (per axis); ``n_frames``: Navier-Stokes' recorded frames T. Returns the files written."""
    _check(pde, n_samples, resolution, seed, n_frames)
    reference = LAYOUTS[pde].reference
    names = [reference["train_file"]] + ([reference["test_file"]] if reference.get("test_file") else [])
    written = []
    for file, name in enumerate(names):
        path = Path(folder) / name
        if pde == "fno_burgers":
            a = burgers_initial(seed, file, range(n_samples), resolution)
            write_mat(path, {"a": a, "u": burgers_solve(a)})
        elif pde == "fno_darcy":
            coeff = np.empty((n_samples, resolution, resolution))
            sol = np.empty_like(coeff)
            for i in range(n_samples):
                StopRequested.check()
                coeff[i] = darcy_coefficient(seed, file, i, resolution)
                sol[i] = darcy_vertex_solve(coeff[i])
            write_mat(path, {"coeff": coeff, "sol": sol})
        else:
            a = ns_initial(seed, file, range(n_samples), resolution)
            u = np.concatenate([ns_solve(a[i : i + NS_BATCH], n_frames) for i in range(0, n_samples, NS_BATCH)])
            t = np.arange(1, n_frames + 1, dtype=np.float32)[None]
            arrays = {"a": a.astype(np.float32), "u": u.astype(np.float32), "t": t}
            write_mat(path, arrays, version="7.3")
        written.append(path)
    return written
