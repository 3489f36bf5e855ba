"""The compressible Euler equations solved by a finite-volume scheme, vectorised over samples (numpy).

    d/dt (rho, rho u, [rho v,] E) + div F = 0,    E = p / (gamma - 1) + rho |u|^2 / 2

on a uniform grid of cells of the unit interval (1D) or square (2D), with periodic or outflow (zero-gradient)
boundaries. Each step: the primitive variables (rho, u, [v,] p) reconstructed to the cell faces by MUSCL with the
monotonised-central limiter, the HLLC approximate Riemann solver's flux at every face (Toro, "Riemann Solvers and
Numerical Methods for Fluid Dynamics", ch. 10), and the second-order strong-stability-preserving Runge-Kutta
scheme (Heun's); the time step from the CFL condition, per sample, cut to land on each saved time. The 2D flux is
unsplit: the x and y faces' fluxes together in one update.

:func:`sod_exact` is the exact solution of a Riemann problem (Toro, ch. 4), against which the solver is checked.
"""

from __future__ import annotations

import math

import numpy as np

CFL = 0.4


def primitive(u: np.ndarray, gamma: float) -> np.ndarray:
    """Conservative (batch, 2 + d, *grid) -> primitive (rho, velocity..., p)."""
    rho = u[:, 0]
    velocity = u[:, 1:-1] / rho[:, None]
    kinetic = 0.5 * rho * (velocity**2).sum(axis=1)
    p = (gamma - 1) * (u[:, -1] - kinetic)
    return np.concatenate([rho[:, None], velocity, p[:, None]], axis=1)


def conservative(w: np.ndarray, gamma: float) -> np.ndarray:
    """Primitive (rho, velocity..., p) -> conservative (rho, momentum..., E)."""
    rho, velocity, p = w[:, 0], w[:, 1:-1], w[:, -1]
    energy = p / (gamma - 1) + 0.5 * rho * (velocity**2).sum(axis=1)
    return np.concatenate([rho[:, None], rho[:, None] * velocity, energy[:, None]], axis=1)


def _pad(w: np.ndarray, axis: int, boundary: str) -> np.ndarray:
    """Two ghost cells on each side of ``axis`` (a spatial axis of (batch, vars, *grid))."""
    widths = [(0, 0)] * w.ndim
    widths[axis] = (2, 2)
    return np.pad(w, widths, mode="wrap" if boundary == "periodic" else "edge")


def _limited_slope(w: np.ndarray, axis: int) -> np.ndarray:
    """The monotonised-central limited slope of each cell along ``axis`` (cells 1..n-2 of the padded array)."""
    n = w.shape[axis]
    take = lambda a, b: np.take(w, range(a, n + b), axis=axis)  # noqa: E731
    left, right = take(1, -1) - take(0, -2), take(2, 0) - take(1, -1)
    centred = 0.5 * (left + right)
    limited = np.sign(centred) * np.minimum(np.abs(centred), 2 * np.minimum(np.abs(left), np.abs(right)))
    return np.where(left * right > 0, limited, 0.0)


def _hllc(wl: np.ndarray, wr: np.ndarray, normal: int, gamma: float) -> np.ndarray:
    """HLLC flux between left and right primitive states (batch, vars, ...), across faces normal to velocity
    component ``normal``; returns the conservative flux."""
    d = wl.shape[1] - 2

    def flux_of(w: np.ndarray, u_cons: np.ndarray) -> np.ndarray:
        vel, p = w[:, 1 : 1 + d], w[:, -1]
        un = vel[:, normal]
        f = u_cons * un[:, None]
        f[:, 1 + normal] += p
        f[:, -1] += p * un
        return f

    ul, ur = conservative(wl, gamma), conservative(wr, gamma)
    rl, rr = wl[:, 0], wr[:, 0]
    unl, unr = wl[:, 1 + normal], wr[:, 1 + normal]
    pl, pr = wl[:, -1], wr[:, -1]
    cl, cr = np.sqrt(gamma * pl / rl), np.sqrt(gamma * pr / rr)
    sl = np.minimum(unl - cl, unr - cr)  # Davis's wave speed estimates
    sr = np.maximum(unl + cl, unr + cr)
    sm = (pr - pl + rl * unl * (sl - unl) - rr * unr * (sr - unr)) / (rl * (sl - unl) - rr * (sr - unr))

    def star(w: np.ndarray, u_cons: np.ndarray, s: np.ndarray, un: np.ndarray) -> np.ndarray:
        rho = w[:, 0]
        factor = rho * (s - un) / (s - sm)
        out = np.empty_like(u_cons)
        out[:, 0] = factor
        for k in range(d):
            out[:, 1 + k] = factor * (sm if k == normal else w[:, 1 + k])
        energy = u_cons[:, -1] / rho + (sm - un) * (sm + w[:, -1] / (rho * (s - un)))
        out[:, -1] = factor * energy
        return out

    fl, fr = flux_of(wl, ul), flux_of(wr, ur)
    fsl = fl + sl[:, None] * (star(wl, ul, sl, unl) - ul)
    fsr = fr + sr[:, None] * (star(wr, ur, sr, unr) - ur)
    return np.where((sl >= 0)[:, None], fl, np.where((sm >= 0)[:, None], fsl, np.where((sr >= 0)[:, None], fsr, fr)))


def _rhs(u: np.ndarray, gamma: float, dx: float, boundary: str) -> np.ndarray:
    """-div F of the conservative state (batch, vars, *grid)."""
    w = primitive(u, gamma)
    out = np.zeros_like(u)
    for normal in range(u.ndim - 2):
        axis = 2 + normal
        padded = _pad(w, axis, boundary)
        slope = _limited_slope(padded, axis)  # cells 1 .. n+2 of the padded array
        n = padded.shape[axis]
        inner = np.take(padded, range(1, n - 1), axis=axis)
        left_face, right_face = inner - 0.5 * slope, inner + 0.5 * slope  # each cell's two reconstructed faces
        # Face i+1/2 between cells i and i+1 (cells 0..n_cells of the grid plus one ghost on each side).
        wl = np.take(right_face, range(0, right_face.shape[axis] - 1), axis=axis)
        wr = np.take(left_face, range(1, left_face.shape[axis]), axis=axis)
        flux = _hllc(np.moveaxis(wl, axis, -1), np.moveaxis(wr, axis, -1), normal, gamma)
        flux = np.moveaxis(flux, -1, axis)  # faces -1/2 .. n-1/2 of the grid's cells
        count = flux.shape[axis]
        out -= (np.take(flux, range(1, count), axis=axis) - np.take(flux, range(0, count - 1), axis=axis)) / dx
    return out


def _max_speed(u: np.ndarray, gamma: float) -> np.ndarray:
    w = primitive(u, gamma)
    c = np.sqrt(gamma * w[:, -1] / w[:, 0])
    speed = np.abs(w[:, 1:-1]).max(axis=1) + c
    return speed.reshape(len(u), -1).max(axis=1)


def evolve(w0: np.ndarray, times: np.ndarray, gamma: float, boundary: str = "periodic") -> np.ndarray:
    """Primitive initial states (batch, 2 + d, *grid) on the unit interval/square -> primitive states at ``times``
    (batch, len(times), 2 + d, *grid), ``times[0]`` being the initial one (0)."""
    grid = w0.shape[2:]
    dx = 1.0 / grid[0]
    u = conservative(w0.astype(np.float64), gamma)
    frames = [w0.astype(np.float64)]
    t = np.zeros(len(u))
    shape = (len(u), *[1] * (u.ndim - 1))
    for target in times[1:]:
        while (t < target - 1e-12).any():
            dt = np.minimum(CFL * dx / _max_speed(u, gamma), target - t)
            dt = np.where(t < target - 1e-12, dt, 0.0).reshape(shape)
            stage = u + dt * _rhs(u, gamma, dx, boundary)  # SSP-RK2 (Heun)
            u = 0.5 * (u + stage + dt * _rhs(stage, gamma, dx, boundary))
            t = t + dt.reshape(-1)
        frames.append(primitive(u, gamma))
    return np.stack(frames, axis=1)


# -- the exact solution of a Riemann problem ------------------------------------------------------------------


def sod_exact(
    x: np.ndarray,
    t: float,
    left: tuple[float, float, float],
    right: tuple[float, float, float],
    gamma: float,
    x0: float = 0.5,
) -> np.ndarray:
    """(rho, u, p) at points ``x`` and time ``t`` of the 1D Riemann problem with (rho, u, p) ``left`` of ``x0``
    and ``right`` of it: Toro's exact solver (the star pressure by Newton's iteration, then the waves sampled)."""
    rl, ul, pl = left
    rr, ur, pr = right
    cl, cr = math.sqrt(gamma * pl / rl), math.sqrt(gamma * pr / rr)

    def f(p: float, rho: float, pk: float, ck: float) -> tuple[float, float]:
        if p > pk:  # shock
            a, b = 2 / ((gamma + 1) * rho), (gamma - 1) / (gamma + 1) * pk
            root = math.sqrt(a / (p + b))
            return (p - pk) * root, root * (1 - (p - pk) / (2 * (p + b)))
        ratio = p / pk  # rarefaction
        value = 2 * ck / (gamma - 1) * (ratio ** ((gamma - 1) / (2 * gamma)) - 1)
        return value, ratio ** (-(gamma + 1) / (2 * gamma)) / (rho * ck)

    p = max(1e-8, 0.5 * (pl + pr))
    for _ in range(100):
        fl, dl = f(p, rl, pl, cl)
        fr, dr = f(p, rr, pr, cr)
        step = (fl + fr + ur - ul) / (dl + dr)
        p_new = max(1e-8, p - step)
        if abs(p_new - p) / (0.5 * (p_new + p)) < 1e-12:
            p = p_new
            break
        p = p_new
    u_star = 0.5 * (ul + ur) + 0.5 * (f(p, rr, pr, cr)[0] - f(p, rl, pl, cl)[0])
    g1, g2 = (gamma - 1) / (gamma + 1), (gamma - 1) / (2 * gamma)
    out = np.empty((3, len(x)))
    for i, xi in enumerate(x):
        s = (xi - x0) / t if t > 0 else (-np.inf if xi < x0 else np.inf)
        if s <= u_star:  # left of the contact
            if p > pl:
                shock = ul - cl * math.sqrt((gamma + 1) / (2 * gamma) * p / pl + g2)
                state = (rl * (p / pl + g1) / (g1 * p / pl + 1), u_star, p) if s > shock else (rl, ul, pl)
            else:
                head, tail = ul - cl, u_star - cl * (p / pl) ** g2
                if s <= head:
                    state = (rl, ul, pl)
                elif s >= tail:
                    state = (rl * (p / pl) ** (1 / gamma), u_star, p)
                else:
                    u_fan = 2 / (gamma + 1) * (cl + (gamma - 1) / 2 * ul + s)
                    c_fan = 2 / (gamma + 1) * (cl + (gamma - 1) / 2 * (ul - s))
                    rho_fan = rl * (c_fan / cl) ** (2 / (gamma - 1))
                    state = (rho_fan, u_fan, pl * (c_fan / cl) ** (2 * gamma / (gamma - 1)))
        else:  # right of the contact
            if p > pr:
                shock = ur + cr * math.sqrt((gamma + 1) / (2 * gamma) * p / pr + g2)
                state = (rr * (p / pr + g1) / (g1 * p / pr + 1), u_star, p) if s < shock else (rr, ur, pr)
            else:
                head, tail = ur + cr, u_star + cr * (p / pr) ** g2
                if s >= head:
                    state = (rr, ur, pr)
                elif s <= tail:
                    state = (rr * (p / pr) ** (1 / gamma), u_star, p)
                else:
                    u_fan = 2 / (gamma + 1) * (-cr + (gamma - 1) / 2 * ur + s)
                    c_fan = 2 / (gamma + 1) * (cr - (gamma - 1) / 2 * (ur - s))
                    rho_fan = rr * (c_fan / cr) ** (2 / (gamma - 1))
                    state = (rho_fan, u_fan, pr * (c_fan / cr) ** (2 * gamma / (gamma - 1)))
        out[:, i] = state
    return out
