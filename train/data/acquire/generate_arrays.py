"""The generic-array demo (pde: arrays, source: generate): the Kuramoto-Sivashinsky equation as a spectral solver
writes it, arrays of shape (samples, time, x, channels).

u_t + u u_x + u_xx + u_xxxx = 0 on the periodic interval [0, 22), 64 points, solved by the exponential time
differencing Runge-Kutta scheme of order 4 (Kassam and Trefethen, SIAM J. Sci. Comput. 26, 2005) with step 0.25,
from a random smooth initial state run 100 time units onto the chaotic attractor before frames are saved, one
every 2 steps (dt 0.5). The train file holds ``n_samples`` trajectories; the test file, where the task names
one, a quarter as many (at least 2), each ``test_frames`` long: as a user's solver would write them, a test
trajectory may run longer than the training ones. Each file says its own ``fields``, ``periodic``, ``extent``
and ``dt`` as attributes (train.data.formats.arrays).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from train.atomic import atomic_path
from train.errors import StopRequested

LENGTH = 22.0
STEP = 0.25
SAVE_EVERY = 2
BURN_IN_STEPS = 400
FRAMES = 51
"""Frames per training trajectory (25 time units)."""


def _etdrk4(points: int, length: float, h: float) -> tuple[np.ndarray, ...]:
    """The scheme's coefficients for the linear part -u_xx - u_xxxx, by the contour integral of Kassam and
    Trefethen (16 points on a circle of radius 1 around each h * L)."""
    k = 2 * np.pi / length * np.arange(points // 2 + 1)
    linear = k**2 - k**4
    roots = np.exp(1j * np.pi * (np.arange(1, 17) - 0.5) / 16)
    lr = h * linear[:, None] + roots[None, :]
    q = h * np.real(np.mean((np.exp(lr / 2) - 1) / lr, axis=1))
    f1 = h * np.real(np.mean((-4 - lr + np.exp(lr) * (4 - 3 * lr + lr**2)) / lr**3, axis=1))
    f2 = h * np.real(np.mean((2 + lr + np.exp(lr) * (-2 + lr)) / lr**3, axis=1))
    f3 = h * np.real(np.mean((-4 - 3 * lr - lr**2 + np.exp(lr) * (4 - lr)) / lr**3, axis=1))
    return np.exp(h * linear), np.exp(h * linear / 2), q, f1, f2, f3, -0.5j * k


def ks_trajectories(
    n: int, frames: int, seed: int, points: int = 64, length: float = LENGTH, h: float = STEP
) -> np.ndarray:
    """``n`` trajectories of ``frames`` saved frames, float32 (n, frames, points), one every SAVE_EVERY steps
    after BURN_IN_STEPS."""
    e, e2, q, f1, f2, f3, g = _etdrk4(points, length, h)
    rng = np.random.default_rng(seed)
    x = np.arange(points) * length / points
    modes = np.arange(1, 5)
    phases, amplitudes = rng.uniform(0, 2 * np.pi, (n, 4)), rng.normal(0, 0.5, (n, 4))
    u0 = np.sum(amplitudes[..., None] * np.cos(2 * np.pi * modes[None, :, None] * x / length + phases[..., None]), 1)
    v = np.fft.rfft(u0, axis=-1)

    def nonlinear(w: np.ndarray) -> np.ndarray:
        return g * np.fft.rfft(np.fft.irfft(w, n=points, axis=-1) ** 2, axis=-1)

    out = np.empty((n, frames, points), np.float32)
    for step in range(BURN_IN_STEPS + SAVE_EVERY * frames):
        if step % 100 == 0:
            StopRequested.check()
        saved, due = divmod(step - BURN_IN_STEPS, SAVE_EVERY)
        if step >= BURN_IN_STEPS and due == 0:
            out[:, saved] = np.fft.irfft(v, n=points, axis=-1)
        nv = nonlinear(v)
        a = e2 * v + q * nv
        na = nonlinear(a)
        b = e2 * v + q * na
        nb = nonlinear(b)
        c = e2 * a + q * (2 * nb - nv)
        v = e * v + nv * f1 + 2 * (na + nb) * f2 + nonlinear(c) * f3
    return out


def write_arrays(path: Path, u: np.ndarray, dt: float) -> Path:
    """One file of the generic layout, atomically: ``u`` (n, t, x, 1), channels last, and what it is."""
    with atomic_path(Path(path)) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("u", data=u[..., None])
        f.attrs.update(order="channels_last", fields=["u"], periodic=[True], extent=[LENGTH], dt=dt)
    return Path(path)


def generate_arrays(
    folder: Path, n_samples: int, resolution: int, seed: int, train_file: str, test_file: str | None
) -> list[Path]:
    """The demo's files in ``folder``: ``train_file`` with ``n_samples`` trajectories of FRAMES frames, and
    ``test_file`` (where named) with a quarter as many of 4 x FRAMES - 3 frames (200 steps of rollout)."""
    folder = Path(folder)
    dt = STEP * SAVE_EVERY
    written = [write_arrays(folder / train_file, ks_trajectories(n_samples, FRAMES, seed, resolution), dt)]
    if test_file:
        test = ks_trajectories(max(2, n_samples // 4), 4 * FRAMES - 3, seed + 1, resolution)
        written.append(write_arrays(folder / test_file, test, dt))
    return written
