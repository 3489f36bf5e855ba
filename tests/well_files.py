"""Small datasets in The Well's schema exercising every part of it, for the reader's tests.

``write_dataset`` makes ``<root>/data/{train,valid,test}/*.hdf5`` whose files hold t0, t1 and t2 fields, a field
constant in time (sample-varying), a constant scalar, a per-sample constant scalar and a time-varying scalar,
mixed boundary conditions, on a non-square 2D grid or a 3D grid, with several files per split of different
trajectory counts. ``write_stats`` writes ``stats.yaml`` by The Well's own definition (per file, float64
population moments over every non-component axis, combined with count weights, five significant digits).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch
import yaml

from train.data.formats.well_writer import Boundary, WellArray, periodic, write_well_file

GRIDS = {2: (8, 6), 3: (4, 5, 6)}
COUNTS = {"train": (2, 3), "valid": (1, 2), "test": (2,)}
STEPS = 9


def _file(path: Path, dims: int, n: int, rng: np.random.Generator, shift: float, grid=None, name: str = "rich") -> None:
    grid = grid or GRIDS[dims]
    axes = "xyz"[:dims]
    d = dims
    field = lambda *tail: (rng.standard_normal((n, STEPS, *grid, *tail)) * 2 + shift).astype(np.float32)  # noqa: E731
    bounds = {"x_periodic": periodic("x", grid[0])}
    wall = np.zeros(grid[1], bool)
    wall[0] = True
    bounds["y_wall"] = Boundary("WALL", ("y",), wall)
    write_well_file(
        path,
        dataset_name=name,
        n_trajectories=n,
        time=np.linspace(0, 1, STEPS).astype(np.float32),
        dims={a: np.linspace(0, 1, k).astype(np.float32) for a, k in zip(axes, grid, strict=True)},
        fields={
            "rho": WellArray(field()),
            "mask": WellArray((rng.random((n, *grid)) * 3 + shift).astype(np.float32), time_varying=False),
            "pressure": WellArray(field() * 0.1 + 5),
            "velocity": WellArray(field(d), order=1),
            "stress": WellArray(field(d, d), order=2),
        },
        scalars={
            "Re": WellArray(np.float32(100 + shift), sample_varying=False, time_varying=False),
            "amp": WellArray(rng.random(n).astype(np.float32), time_varying=False),
            "clock": WellArray(np.linspace(0, 1, STEPS).astype(np.float32), sample_varying=False),
        },
        boundaries=bounds,
        simulation_parameters=("Re",),
    )


def write_dataset(root: Path, dims: int = 2, seed: int = 0, grid: tuple[int, ...] | None = None) -> Path:
    rng = np.random.default_rng(seed)
    for split, counts in COUNTS.items():
        for i, n in enumerate(counts):
            _file(root / "data" / split / f"rich_{i}.hdf5", dims, n, rng, shift=float(i), grid=grid)
    return root


def well_moments(files: list[Path], float32_weights: bool = True) -> dict[str, dict[str, np.ndarray]]:
    """mean, std and rms (and their delta forms) per field, components kept, by The Well's statistics computation:
    per file float64 moments, combined with each file's share of the count, which The Well rounds to float32
    (``float32_weights=False``: the same in float64 throughout, the definition without that rounding)."""
    import h5py

    means, m2s, counts = {}, {}, {}

    def add(key: str, data: torch.Tensor, order: int) -> None:
        axes = tuple(range(data.dim() - order))
        var, mean = torch.var_mean(data, dim=axes, unbiased=False)
        means.setdefault(key, []).append(mean)
        m2s.setdefault(key, []).append(var + mean**2)
        counts.setdefault(key, []).append(int(np.prod(data.shape[: data.dim() - order])))

    for path in sorted(files, key=str):
        with h5py.File(path) as f:
            for order in range(3):
                group = f[f"t{order}_fields"]
                for name in group.attrs["field_names"]:
                    name = name.decode() if isinstance(name, bytes) else str(name)
                    data = torch.as_tensor(group[name][()], dtype=torch.float64)
                    add(name, data, order)
                    if group[name].attrs["time_varying"]:
                        add(f"{name}/delta", data[:, 1:] - data[:, :-1], order)
    out = {key: {} for key in ("mean", "std", "rms", "mean_delta", "std_delta", "rms_delta")}
    for key in means:
        name, _, delta = key.partition("/")
        suffix = "_delta" if delta else ""
        w = torch.as_tensor(counts[key], dtype=torch.int64)
        w = (w / w.sum()).to(torch.float64) if float32_weights else w.to(torch.float64) / float(w.sum())
        mean = torch.einsum("i...,i", torch.stack(means[key]), w)
        m2 = torch.einsum("i...,i", torch.stack(m2s[key]), w)
        out["mean" + suffix][name] = mean.numpy()
        out["std" + suffix][name] = (m2 - mean**2).sqrt().numpy()
        out["rms" + suffix][name] = m2.sqrt().numpy()
    return out


class _FiveDigits(yaml.SafeDumper):
    """The Well writes its statistics with five significant digits."""


_FiveDigits.add_representer(float, lambda dumper, v: dumper.represent_scalar("tag:yaml.org,2002:float", f"{v:.4E}"))


def write_stats(root: Path) -> dict:
    moments = well_moments(sorted((root / "data" / "train").glob("*.hdf5")))
    stats = {key: {n: np.asarray(v).tolist() for n, v in per.items()} for key, per in moments.items()}
    (root / "stats.yaml").write_text(yaml.dump(stats, Dumper=_FiveDigits))
    return moments


def channel_names(dims: int) -> list[str]:
    axes = "xyz"[:dims]
    tensors = [f"stress_{a}{b}" for a, b in itertools.product(axes, repeat=2)]
    return ["rho", "pressure", *[f"velocity_{a}" for a in axes], *tensors]
