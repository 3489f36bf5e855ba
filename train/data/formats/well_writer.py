"""Writing files in The Well's schema (docs/well.md): the demo generator's output, and a way to convert data.

One call writes one file of a dataset (``<dataset>/data/<split>/<name>.hdf5``) with every group and attribute the
schema requires: root attributes, ``dimensions`` (``spatial_dims``, ``time`` and one coordinate array per axis),
``boundary_conditions`` (one group per condition: ``bc_type``, ``associated_dims``, ``mask``, ``values``),
``scalars`` and ``t0_fields``/``t1_fields``/``t2_fields``, each dataset with its ``sample_varying``,
``time_varying`` (and, for fields, ``dim_varying``) flags. The file is written beside its final name and renamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from train.atomic import atomic_path


@dataclass(frozen=True)
class WellArray:
    """A field (tensor order 0, 1 or 2) or a scalar, shaped ``[B if sample_varying] + [T if time_varying] +
    [N_i per dim_varying axis] + [d] * order``."""

    data: np.ndarray
    order: int = 0
    sample_varying: bool = True
    time_varying: bool = True
    dim_varying: tuple[bool, ...] | None = None
    """Per spatial axis; None: every axis (fields only)."""


@dataclass(frozen=True)
class Boundary:
    """One boundary condition: its type on the faces of ``dims`` that ``mask`` (shape: those axes) marks."""

    bc_type: str  # "PERIODIC", "WALL" or "OPEN"
    dims: tuple[str, ...]
    mask: np.ndarray


def periodic(dim: str, n: int) -> Boundary:
    """Both ends of axis ``dim`` (``n`` points) periodic."""
    mask = np.zeros(n, bool)
    mask[[0, -1]] = True
    return Boundary("PERIODIC", (dim,), mask)


def _flags(obj: h5py.HLObject, array: WellArray, n_dims: int | None) -> None:
    obj.attrs["sample_varying"] = array.sample_varying
    obj.attrs["time_varying"] = array.time_varying
    if n_dims is not None:
        obj.attrs["dim_varying"] = np.asarray(array.dim_varying or (True,) * n_dims)


def write_well_file(
    path: str | Path,
    *,
    dataset_name: str,
    n_trajectories: int,
    time: np.ndarray,
    dims: dict[str, np.ndarray],
    fields: dict[str, WellArray],
    scalars: dict[str, WellArray] | None = None,
    boundaries: dict[str, Boundary] | None = None,
    simulation_parameters: tuple[str, ...] = (),
    grid_type: str = "cartesian",
) -> Path:
    """Write one Well file; ``fields`` in the order their groups list them, ``simulation_parameters`` naming
    scalars (each also written as a root attribute)."""
    path, scalars, boundaries = Path(path), scalars or {}, boundaries or {}
    path.parent.mkdir(parents=True, exist_ok=True)
    str_list = h5py.string_dtype()
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["dataset_name"] = dataset_name
        f.attrs["grid_type"] = grid_type
        f.attrs["n_spatial_dims"] = len(dims)
        f.attrs["n_trajectories"] = n_trajectories
        f.attrs["simulation_parameters"] = np.asarray(simulation_parameters, dtype=str_list)
        for name in simulation_parameters:
            f.attrs[name] = np.asarray(scalars[name].data).reshape(-1)[0]
        group = f.create_group("dimensions")
        group.attrs["spatial_dims"] = np.asarray(list(dims), dtype=str_list)
        for name, values in {"time": time, **dims}.items():
            ds = group.create_dataset(name, data=values)
            ds.attrs["sample_varying"], ds.attrs["time_varying"] = values.ndim > 1, name == "time"
        group = f.create_group("boundary_conditions")
        for name, bc in boundaries.items():
            sub = group.create_group(name)
            sub.attrs["bc_type"] = bc.bc_type
            sub.attrs["associated_dims"] = np.asarray(bc.dims, dtype=str_list)
            sub.attrs["associated_fields"] = np.asarray([], dtype=str_list)
            sub.attrs["sample_varying"], sub.attrs["time_varying"] = False, False
            sub.create_dataset("mask", data=bc.mask)
            sub.create_dataset("values", data=np.zeros(bc.mask.shape, np.float32))
        group = f.create_group("scalars")
        group.attrs["field_names"] = np.asarray(list(scalars), dtype=str_list)
        for name, scalar in scalars.items():
            _flags(group.create_dataset(name, data=scalar.data), scalar, None)
        for order in range(3):
            group = f.create_group(f"t{order}_fields")
            mine = {n: a for n, a in fields.items() if a.order == order}
            group.attrs["field_names"] = np.asarray(list(mine), dtype=str_list)
            for name, array in mine.items():
                _flags(group.create_dataset(name, data=array.data), array, len(dims))
    return path
