"""The PDE registry: every equation family the project reads, with its HDF5 layout, in one place.

The config's ``tasks.<name>.pde`` is validated against it, the readers take their keys from it, and the
families the project can also generate name their file here. The layouts are described in
docs/data-formats.md ('Supported PDEs', 'Single-file layout', 'Grouped layout').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Layout:
    """Which HDF5 keys hold a family's fields and how a sample is formed from them.

    ``style`` "single": one dataset per field, sample axis first. "groups": one group per seed whose ``data``
    array is [t, *space, channel]; ``channels`` is the channel count that array must have. "well": The Well's
    schema, a folder of files per split whose fields, dimensions and channels each file describes itself
    (``spatial_dims`` 0: read from the files).
    """

    inputs: tuple[str, ...]
    targets: tuple[str, ...]
    spatial_dims: int
    autoregressive: bool
    style: Literal["single", "groups", "well"] = "single"
    channels: int | None = None
    generated_file: str | None = None
    """PDEBench's file name pattern of the family ({} is the coefficient); None: no generator. The generator's
    output adds its settings to it (train.data.generate.generated_filename)."""

    @property
    def test_first(self) -> bool:
        """PDEBench's split convention: single-file test sets are the first samples, group-per-seed the last."""
        return self.style == "single"

    @property
    def multi_file(self) -> bool:
        """Each split is a folder of files (The Well) rather than one file."""
        return self.style == "well"


LAYOUTS = {
    "advection1d": Layout(("tensor",), ("tensor",), 1, True, generated_file="1D_Advection_Sols_beta{}.hdf5"),
    "burgers1d": Layout(("tensor",), ("tensor",), 1, True, generated_file="1D_Burgers_Sols_Nu{}.hdf5"),
    "reacdiff1d": Layout(("tensor",), ("tensor",), 1, True),
    "darcy2d": Layout(("nu",), ("tensor",), 2, False, generated_file="2D_DarcyFlow_beta{}_Train.hdf5"),
    "cfd1d": Layout(("density", "pressure", "Vx"), ("density", "pressure", "Vx"), 1, True),
    "cfd2d": Layout(("density", "pressure", "Vx", "Vy"), ("density", "pressure", "Vx", "Vy"), 2, True),
    # 3D_CFD_{Rand,Turb}_M*_Eta*_Zeta*_periodic_Train.hdf5: each field [sample, t, x, y, z]
    "cfd3d": Layout(("density", "pressure", "Vx", "Vy", "Vz"), ("density", "pressure", "Vx", "Vy", "Vz"), 3, True),
    "diffreact2d": Layout(("data",), ("data",), 2, True, "groups", 2),  # 2D_diff-react_NA_NA.h5
    "shallowwater2d": Layout(("data",), ("data",), 2, True, "groups", 1),  # 2D_rdb_NA_NA.h5
    "diffsorp1d": Layout(("data",), ("data",), 1, True, "groups", 1),  # 1D_diff-sorp_NA_NA.h5
    "well": Layout((), (), 0, True, "well"),  # any dataset of The Well (tasks.<name>.well)
}

GENERATED = tuple(name for name, layout in LAYOUTS.items() if layout.generated_file)
"""The families the project can generate a small dataset of (tasks.<name>.source: generate)."""
