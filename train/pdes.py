"""The PDE registry: every equation family the project reads, with its keys, storage style and published
settings, in one place.

The config's ``tasks.<name>.pde`` is validated against it, the readers take their keys from it, the Format table
(train.data.formats) its style, and the families the project can also generate in PDEBench's layout name their
file here. The layouts are described in docs/data-formats.md ('Supported PDEs', 'Single-file layout', 'Grouped
layout'), docs/well.md and docs/operator-formats.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PERIODIC = 2
"""The boundary code of a side that wraps around (The Well's codes: WALL 0, OPEN 1, PERIODIC 2), as TaskSpec and
the caches record boundaries."""

STYLES = ("single", "groups", "well", "fno_mat", "neuralop_pt", "pdearena", "arrays")
"""Storage styles, one per row of the Format table (train.data.formats.FORMATS)."""


@dataclass(frozen=True)
class Layout:
    """Which HDF5 keys hold a family's fields and how a sample is formed from them.

    ``style`` "single": one dataset per field, sample axis first. "groups": one group per seed whose ``data``
    array is [t, *space, channel]; ``channels`` is the channel count that array must have. "well": The Well's
    schema, a folder of files per split whose fields, dimensions and channels each file describes itself
    (``spatial_dims`` 0: read from the files). "fno_mat": the FNO paper's MATLAB files (v5 or v7.3), "neuralop_pt":
    neuraloperator's torch.save dicts, "pdearena": PDEArena's HDF5 files, one per split and seed, "arrays": a
    solver's own arrays in HDF5, .npy or .npz files, their channels, grid and periodic axes said per task.
    """

    inputs: tuple[str, ...]
    targets: tuple[str, ...]
    spatial_dims: int
    autoregressive: bool
    style: Literal[STYLES] = "single"
    channels: int | None = None
    generated_file: str | None = None
    """PDEBench's file name pattern of the family ({} is the coefficient); None: no generator. The generator's
    output adds its settings to it (train.data.acquire.generate.generated_filename)."""
    periodic: bool = False
    """Every spatial axis wraps around, as the family's published generator sets its boundary conditions
    (PDEBench's advection, Burgers, reaction-diffusion and periodic CFD files; the FNO paper's Burgers and
    Navier-Stokes): the models wrap those axes instead of padding them (TaskSpec.boundary). A Well dataset says
    per axis in its files, a generic-array task in its config."""
    reference: dict = field(default_factory=dict)
    """The settings the family's published benchmark uses, as defaults a task may override: ``spatial_stride``
    (the reference sub-sampling), ``initial_step``, and the ``files`` section's ``train_file``, ``test_file``,
    ``n_train``, ``n_test``, ``resolution``."""

    @property
    def takes_files(self) -> bool:
        """Its tasks name their files and samples in a ``files`` section (every format after PDEBench's and The
        Well's, which have templates and a ``well`` section)."""
        return self.style not in ("single", "groups", "well")


def _flow(spatial_dims: int, generated_file: str) -> Layout:
    """A compressible flow in PDEBench's single-file layout: density, pressure and one velocity per axis, each
    frame predicting the next."""
    fields = ("density", "pressure", *("Vx", "Vy", "Vz")[:spatial_dims])
    return Layout(fields, fields, spatial_dims, True, generated_file=generated_file, periodic=True)


LAYOUTS = {
    "advection1d": Layout(
        ("tensor",), ("tensor",), 1, True, generated_file="1D_Advection_Sols_beta{}.hdf5", periodic=True
    ),
    "burgers1d": Layout(("tensor",), ("tensor",), 1, True, generated_file="1D_Burgers_Sols_Nu{}.hdf5", periodic=True),
    "reacdiff1d": Layout(("tensor",), ("tensor",), 1, True, periodic=True),
    "darcy2d": Layout(("nu",), ("tensor",), 2, False, generated_file="2D_DarcyFlow_beta{}_Train.hdf5"),
    "cfd1d": _flow(1, "1D_CFD_Advected_V{}_periodic_Train.hdf5"),
    "cfd2d": _flow(2, "2D_CFD_Advected_V{}_periodic_Train.hdf5"),
    # 3D_CFD_{Rand,Turb}_M*_Eta*_Zeta*_periodic_Train.hdf5: each field [sample, t, x, y, z]
    "cfd3d": _flow(3, "3D_CFD_Advected_V{}_periodic_Train.hdf5"),
    # The Euler equations solved by a finite-volume scheme (generate_euler): smooth and Riemann initial states
    "euler1d": _flow(1, "1D_CFD_Euler_Riemann{}_periodic_Train.hdf5"),
    "euler2d": _flow(2, "2D_CFD_Euler_Riemann{}_periodic_Train.hdf5"),
    "diffreact2d": Layout(("data",), ("data",), 2, True, "groups", 2),  # 2D_diff-react_NA_NA.h5
    "shallowwater2d": Layout(("data",), ("data",), 2, True, "groups", 1),  # 2D_rdb_NA_NA.h5
    "diffsorp1d": Layout(("data",), ("data",), 1, True, "groups", 1),  # 1D_diff-sorp_NA_NA.h5
    "well": Layout((), (), 0, True, "well"),  # any dataset of The Well (tasks.<name>.well)
    # your own solver's arrays (tasks.<name>.arrays, docs/arrays.md)
    "arrays": Layout((), (), 0, True, "arrays", reference=dict(train_file="train.h5")),
    # The FNO paper's files (docs/fno-mat.md): a -> u at T=1; coeff -> sol; the first 10 recorded steps -> the rest
    "fno_burgers": Layout(
        ("a",),
        ("u",),
        1,
        False,
        "fno_mat",
        reference=dict(train_file="burgers_data_R10.mat", n_train=1000, n_test=100, spatial_stride=8),
        periodic=True,
    ),
    "fno_darcy": Layout(
        ("coeff",),
        ("sol",),
        2,
        False,
        "fno_mat",
        reference=dict(
            train_file="piececonst_r421_N1024_smooth1.mat",
            test_file="piececonst_r421_N1024_smooth2.mat",
            n_train=1000,
            n_test=100,
            spatial_stride=5,
        ),
    ),
    "fno_ns": Layout(
        ("u",),
        ("u",),
        2,
        True,
        "fno_mat",
        reference=dict(train_file="ns_V1e-3_N5000_T50.mat", n_train=1000, n_test=200, initial_step=10),
        periodic=True,
    ),
    # neuraloperator's {name}_{train|test}_{resolution}.pt (docs/neuralop-pt.md); Burgers' y is (n, t, x)
    "neuralop_darcy": Layout(("x",), ("y",), 2, False, "neuralop_pt", reference=dict(resolution=16)),
    "neuralop_burgers": Layout(
        ("y",), ("y",), 1, True, "neuralop_pt", reference=dict(resolution=16, initial_step=1), periodic=True
    ),
    "neuralop_ns": Layout(("x",), ("y",), 2, False, "neuralop_pt", reference=dict(resolution=128), periodic=True),
    # PDEArena's NavierStokes2D_{train|valid|test}_*.h5 (docs/pdearena.md): smoke density and velocity
    "pdearena_ns": Layout(("u", "vx", "vy"), ("u", "vx", "vy"), 2, True, "pdearena", reference=dict(initial_step=4)),
}

GENERATED = tuple(name for name, layout in LAYOUTS.items() if layout.generated_file)
"""The families the project can generate a small dataset of (tasks.<name>.source: generate)."""
