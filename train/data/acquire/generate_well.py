"""A small Gray-Scott reaction-diffusion dataset in The Well's exact schema and folder layout (the offline demo).

As The Well's ``gray_scott_reaction_diffusion``: fields A and B on a periodic square [-1, 1]^2, constant scalars
F and k (one parameter set per file, so each file of a split holds one pattern family), the files of each split
holding 80/10/10% of each family's trajectories. Smaller: a ``resolution``^2 grid, ``frames`` saved steps.

    A_t = dA lap(A) - A B^2 + F (1 - A)        B_t = dB lap(B) + A B^2 - (F + k) B

Explicit Euler on the five-point Laplacian, time step 1. The diffusivities are The Well's (2e-5, 1e-5 on a
128^2 grid) scaled by (128 / resolution)^2, so the patterns span as many grid points as theirs. Initial
conditions: A = 1, B = 0, plus a few random squares of A = 0.5, B = 0.25 with 1% noise; the first
``burn_in`` steps are not saved, so every saved trajectory already shows its pattern growing.
Trajectory i of family j draws its random numbers from ``SeedSequence(seed, spawn_key=(j, i))`` only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from train.atomic import write_text_atomic
from train.data.formats.well_writer import WellArray, periodic, write_well_file
from train.errors import StopRequested

DATASET = "gray_scott_reaction_diffusion"
VERSION = 1
FAMILIES = {  # (F, k) of the pattern families, and the trajectories each family holds
    "gliders": (0.014, 0.054, 10),
    "spirals": (0.018, 0.051, 12),
    "maze": (0.029, 0.057, 10),
    "spots": (0.03, 0.062, 14),
}
SPLIT_SHARES = {"train": 0.8, "valid": 0.1, "test": 0.1}
DIFFUSION = (2e-5, 1e-5)
PARAMS_FILE = "generator.json"


def _laplacian(u: np.ndarray, dx: float) -> np.ndarray:
    lap = np.roll(u, 1, -1) + np.roll(u, -1, -1) + np.roll(u, 1, -2) + np.roll(u, -1, -2) - 4 * u
    return lap / (dx * dx)


def _initial(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.ones((n, n)), np.zeros((n, n))
    for _ in range(int(rng.integers(2, 6))):
        size = int(rng.integers(max(2, n // 16), max(3, n // 6)))
        x, y = rng.integers(0, n, 2)
        rows, cols = np.arange(x, x + size) % n, np.arange(y, y + size) % n
        a[np.ix_(rows, cols)], b[np.ix_(rows, cols)] = 0.5, 0.25
    a += 0.01 * rng.standard_normal((n, n))
    b += 0.01 * rng.standard_normal((n, n))
    return a, b


def simulate(f: float, k: float, seeds: list[np.random.SeedSequence], n: int, frames: int, every: int, burn_in: int):
    """(trajectories, frames, n, n) arrays of A and B, float32."""
    scale = (128 / n) ** 2
    da, db = DIFFUSION[0] * scale, DIFFUSION[1] * scale
    dx = 2.0 / n
    starts = [_initial(np.random.default_rng(s), n) for s in seeds]
    a, b = np.stack([s[0] for s in starts]), np.stack([s[1] for s in starts])
    out_a = np.empty((len(seeds), frames, n, n), np.float32)
    out_b = np.empty_like(out_a)
    for step in range(burn_in + frames * every):
        if step % 200 == 0:
            StopRequested.check()
        saved, rest = divmod(step - burn_in, every)
        if step >= burn_in and rest == 0:
            out_a[:, saved], out_b[:, saved] = a, b
        reaction = a * b * b
        a, b = (
            a + da * _laplacian(a, dx) - reaction + f * (1 - a),
            b + db * _laplacian(b, dx) + reaction - (f + k) * b,
        )
    return out_a, out_b


def generate_gray_scott(
    folder: str | Path, *, resolution: int = 32, frames: int = 48, every: int = 20, burn_in: int = 200, seed: int = 0
) -> Path:
    """Write the dataset under ``folder`` (``data/{train,valid,test}/*.hdf5``, no stats.yaml: the cache computes
    the statistics) and return it; a no-op when a dataset of the same settings is there."""
    folder = Path(folder)
    request = {
        "dataset": DATASET,
        "version": VERSION,
        "resolution": resolution,
        "frames": frames,
        "every": every,
        "burn_in": burn_in,
        "seed": seed,
    }
    params = folder / PARAMS_FILE
    if params.is_file() and json.loads(params.read_text()) == request:
        return folder
    coords = (np.arange(resolution) + 0.5) * (2.0 / resolution) - 1.0
    time = (np.arange(frames) * every).astype(np.float32)
    for family, (f, k, count) in enumerate(FAMILIES.values()):
        name = list(FAMILIES)[family]
        seeds = [np.random.SeedSequence(seed, spawn_key=(family, i)) for i in range(count)]
        a, b = simulate(f, k, seeds, resolution, frames, every, burn_in)
        n_valid = n_test = max(1, round(count * SPLIT_SHARES["test"]))
        bounds = {
            "train": (0, count - n_valid - n_test),
            "valid": (count - n_valid - n_test, count - n_test),
            "test": (count - n_test, count),
        }
        for split, (lo, hi) in bounds.items():
            write_well_file(
                folder / "data" / split / f"{DATASET}_{name}_F_{f}_k_{k}.hdf5",
                dataset_name=DATASET,
                n_trajectories=hi - lo,
                time=time,
                dims={"x": coords.astype(np.float32), "y": coords.astype(np.float32)},
                fields={"A": WellArray(a[lo:hi]), "B": WellArray(b[lo:hi])},
                scalars={
                    "F": WellArray(np.float32(f), sample_varying=False, time_varying=False),
                    "k": WellArray(np.float32(k), sample_varying=False, time_varying=False),
                },
                boundaries={"x_periodic": periodic("x", resolution), "y_periodic": periodic("y", resolution)},
                simulation_parameters=("F", "k"),
            )
    write_text_atomic(params, json.dumps(request))  # last: a folder with it is complete
    return folder
