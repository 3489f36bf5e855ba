"""The ``tasks.<name>`` section: a task's data (family, source, splits, windows) and its format's own settings."""

from __future__ import annotations

import re
from typing import Literal

import pydantic
from pydantic import Field

from train.config.section import Section
from train.pdes import LAYOUTS

PDE = Literal[tuple(LAYOUTS)]  # the registry's families; a wrong name gets them listed

# Where a split's file may live under a folder or bucket source, tried in order. {task} is the task's name,
# {split} train/val/test, {Split} PDEBench's Train/Valid/Test.
DEFAULT_TEMPLATES = (
    "{task}/{split}.h5",
    "full/{task}/{task}_{split}.h5",
    "full/{task}/{task}_{split}_000.h5",
    "pdebench/{task}_full_v1/{task}_{split}.h5",
)


class TaskConfig(Section):
    pde: PDE
    """Equation family: picks the generator, the HDF5 keys read and how samples are formed."""
    source: str = "generate"
    """Where the data comes from: 'generate' (a small dataset made locally; for pde: well, a Gray-Scott
    reaction-diffusion dataset in The Well's schema); one HDF5 file (its val/test splits are carved from it);
    or a folder, 'file:///folder', 'b2://bucket/prefix' or 'https://server/folder' searched with `templates` for
    each split's file (for pde: well, the dataset folder holding data/{train,valid,test}/). A remote file or
    folder is downloaded into run.data_dir."""
    templates: list[str] = Field(default_factory=lambda: list(DEFAULT_TEMPLATES), min_length=1)
    """Candidate paths of a split's file under a folder or bucket source, first match wins; placeholders
    {task}, {split} (train/val/test) and {Split} (Train/Valid/Test)."""
    n_samples: int = Field(1000, ge=10)
    """Samples to generate (source 'generate' only)."""
    resolution: int = Field(256, ge=8)
    """Grid points per spatial axis when generating (source 'generate' only)."""
    coefficient: float = 0.1
    """PDE coefficient when generating: beta for advection and Darcy, nu for Burgers."""
    seed: int = 0
    """Seed of the generated dataset."""
    spatial_stride: int = Field(1, ge=1)
    """Keep every n-th grid point along each spatial axis (PDEBench's reduced_resolution)."""
    temporal_stride: int = Field(1, ge=1)
    """Keep every n-th saved frame (PDEBench's reduced_resolution_t); autoregressive tasks only."""
    initial_step: int = Field(10, ge=1)
    """Frames given to the model; it predicts the next one and rolls out to the last (autoregressive only)."""
    test_fraction: float = Field(0.1, gt=0, lt=1)
    """Share of the training file carved out as test set when no test file exists: the FIRST samples of
    single-file datasets, the LAST groups of group-per-seed ones (PDEBench's conventions)."""
    val_fraction: float = Field(0.1, ge=0, lt=1)
    """Share carved out for validation when no val file exists, next to the test share; 0: no val split (a val
    file, where the source has one, is still used): no validation, no best.pt, the last step's checkpoint is the
    run's model."""
    batch_size: int = Field(32, ge=1)
    """Training samples per rank per step."""
    patch_size: int = Field(8, ge=1)
    """Grid points per token along each spatial axis; must divide the strided grid."""
    loss_weight: float = Field(1.0, gt=0)
    """Weight of this task's loss in the summed multi-task loss."""
    sampling_weight: float = Field(1.0, ge=0)
    """Relative probability of drawing this task in a step (train.task_sampling=weighted only), multiplied by its
    size to the power train.sampling_alpha; 0 keeps the task out of training (it is still validated and tested)."""
    periodic: bool | list[bool] | None = None
    """Which spatial axes wrap around (the models then wrap them instead of padding): true or false for every
    axis, or one flag per axis in the data's axis order. Default: what the data says, per axis in a Well file's
    boundary conditions or a generic-array file's attributes, else the family's published boundary conditions
    (train/pdes.py: periodic for PDEBench's advection, Burgers, reaction-diffusion and CFD). A setting that
    contradicts the file is refused (exit 3)."""
    fields: list[str] | None = None
    """The physical name of each channel the model reads, in the data's channel order: a time-dependent task's
    channels (the predicted ones, then constant fields and scalars), a steady task's inputs then its outputs. The
    multi-physics model keeps one row of weights per name, shared by every task that names it (docs/models.md,
    'Field vocabulary'). Default: the format's own names (density, pressure, velocity_x ...; a generic one as
    '<pde>/<key>')."""
    latent_encoder: str | None = None
    """Checkpoint (.pt) of an earlier run whose encoder for this task is frozen: its tokens for every training
    item are precomputed into a latent cache beside the data cache, and training reads them instead of
    running the encoder. The run's data settings, patch_size, initial_step and model.transformer.d_model must
    match it."""
    stream: bool | None = None
    """Stream the training split from the shard set at ``source`` (true), fetch files whole (false); None:
    data.stream decides."""
    well: WellConfig | None = None
    """The dataset and windows of a task in The Well's schema; required with pde: well, refused otherwise."""
    files: DatasetFilesConfig | None = None
    """Which files and samples of a neural-operator dataset (pde: fno_*, neuralop_*, pdearena_*) or of generic
    arrays (pde: arrays) the task reads; unset settings take the family's published benchmark values
    (docs/operator-formats.md)."""
    arrays: ArraysConfig | None = None
    """How generic-array files hold the task's data (pde: arrays; default: trajectories under 'u', channels
    last); refused for other families."""

    @pydantic.field_validator("fields")
    @classmethod
    def _field_names(cls, names: list[str] | None) -> list[str] | None:
        for name in names or ():
            if not re.fullmatch(r"[A-Za-z0-9_./-]+", name):
                raise ValueError(f"field name {name!r}: use letters, digits and _ . / - (e.g. velocity_x)")
        return names

    @pydantic.model_validator(mode="after")
    def _reference_defaults(self) -> TaskConfig:
        layout = LAYOUTS[self.pde]
        if not layout.takes_files:
            if self.files is not None:
                raise ValueError(f"'files' settings are for the neural-operator families, not pde: {self.pde}")
            return self
        reference = layout.reference
        for key in ("spatial_stride", "initial_step"):
            if key in reference and key not in self.model_fields_set:
                object.__setattr__(self, key, reference[key])
        files = self.files or DatasetFilesConfig()
        fields = DatasetFilesConfig.model_fields
        unset = {k: v for k, v in reference.items() if k in fields and getattr(files, k) is None}
        object.__setattr__(self, "files", files.model_copy(update=unset))
        return self

    @pydantic.model_validator(mode="after")
    def _check_arrays(self) -> TaskConfig:
        if LAYOUTS[self.pde].style != "arrays":
            if self.arrays is not None:
                raise ValueError(f"'arrays' settings are for pde: arrays, not pde: {self.pde}; remove them")
            if self.files is not None and self.files.val_file is not None:
                raise ValueError(f"files.val_file is for pde: arrays; a {self.pde} task carves its val split")
        elif self.arrays is None:
            object.__setattr__(self, "arrays", ArraysConfig())
        return self

    @pydantic.model_validator(mode="after")
    def _check_well(self) -> TaskConfig:
        if self.pde != "well":
            if self.well is not None:
                raise ValueError(f"'well' settings are for pde: well, not pde: {self.pde}; remove them")
            return self
        if self.well is None:
            raise ValueError("pde: well needs a 'well' section (n_steps_input, n_steps_output, dt_stride, dataset)")
        if "initial_step" in self.model_fields_set and self.initial_step != self.well.n_steps_input:
            raise ValueError(
                f"initial_step={self.initial_step} contradicts well.n_steps_input={self.well.n_steps_input}; "
                "set only well.n_steps_input"
            )
        if self.temporal_stride != 1:
            raise ValueError("temporal_stride is for PDEBench files; a Well task strides time with well.dt_stride")
        if (self.well.dataset is None) != (self.well.base_path is None):
            raise ValueError("well.dataset and well.base_path go together: set both, or neither and use source")
        object.__setattr__(self, "initial_step", self.well.n_steps_input)
        return self

    @property
    def window_stride(self) -> int:
        """Saved steps between the frames of a training window (1 for PDEBench tasks)."""
        return self.well.dt_stride if self.well is not None else 1

    @property
    def location(self) -> str:
        """Where the task's data lies: ``source``, or a Well dataset's base_path/dataset (source 'generate' of a
        Well task: the Gray-Scott demo dataset, generated under the data folder)."""
        if self.well is not None and self.well.dataset is not None:
            return f"{self.well.base_path.rstrip('/')}/{self.well.dataset}"
        return self.source


class DatasetFilesConfig(Section):
    """The files and samples of a neural-operator dataset (pde: fno_*, neuralop_*, pdearena_*) or of generic
    arrays (pde: arrays); an unset setting takes the family's published value (docs/operator-formats.md)."""

    train_file: str | None = None
    """The train file's name under the task's `source` folder or location (FNO: burgers_data_R10.mat,
    piececonst_r421_N1024_smooth1.mat, ns_V1e-3_N5000_T50.mat; neuraloperator: {name}_train_{resolution}.pt;
    PDEArena: every .h5 file with 'train' in its name)."""
    val_file: str | None = None
    """The validation file's name, where the dataset has one (pde: arrays); else validation is carved from the
    train file (`val_fraction`)."""
    test_file: str | None = None
    """The test file's name (FNO Darcy: piececonst_r421_N1024_smooth2.mat; neuraloperator:
    {name}_test_{resolution}.pt; PDEArena: the files named 'test'); where the family has none, the test split is
    the train file's last `n_test` samples."""
    n_train: int | None = Field(None, ge=1)
    """Training samples: the train file's first n (the FNO paper: 1000); None: all the file holds beside the
    test and validation samples carved from it."""
    n_test: int | None = Field(None, ge=1)
    """Test samples: the test file's first n, or the train file's last n where there is no test file (the FNO
    paper: 100 for Burgers and Darcy, 200 for Navier-Stokes); None: all of the test file, or `test_fraction`."""
    resolution: int | None = Field(None, ge=2)
    """neuraloperator's file resolution, the {res} of {name}_{split}_{res}.pt (Darcy 16 ... 421; nsforcing 128)."""


class ArraysConfig(Section):
    """How a generic-array file holds a task's data (pde: arrays; docs/arrays.md). Each setting may also be an
    attribute of the file (HDF5 root attributes, or arrays of those names in an .npz); where both say, they must
    agree (exit 3)."""

    key: str = "u"
    """The trajectories: an HDF5 dataset or .npz array (a .npy file is the array itself)."""
    order: Literal["channels_last", "channels_first"] | None = None
    """Where the channel axis is: (N, T, *X, C) or (N, T, C, *X) for trajectories, (N, *X, C) or (N, C, *X) for
    steady pairs; None: the file's 'order' attribute, else channels_last. A single channel still has its axis."""
    steady: bool = False
    """Steady pairs, `input_key` -> `target_key` (Darcy-like problems), instead of trajectories under `key`."""
    input_key: str = "x"
    """A steady task's inputs."""
    target_key: str = "y"
    """A steady task's targets (the same grid and samples as the inputs)."""
    extent: list[float] | None = None
    """The domain's length along each spatial axis ([L], [Lx, Ly] ...): the grid's spacing is L/n on a periodic
    axis (its end point is its first) and L/(n-1) on another; None: the file's 'extent' attribute, else 1."""
    dt: float | None = Field(None, gt=0)
    """Time between saved frames; None: the file's 'dt' attribute, else 1 (the report's time axis)."""


class WellConfig(Section):
    """A dataset in The Well's schema (pde: well): where it lies and how samples are windowed (docs/well.md)."""

    dataset: str | None = None
    """The Well's dataset name (e.g. gray_scott_reaction_diffusion), read from `base_path`/<dataset>/ as The
    Well's WellDataset(well_base_path, well_dataset_name) does; None: the task's `source` is the dataset folder
    itself (a local folder, b2://bucket/prefix or https:// URL holding data/{train,valid,test}/)."""
    base_path: str | None = None
    """Folder, b2://bucket/prefix or https:// URL holding datasets by name (with `dataset`), e.g. The Well's
    file server https://sdsc-users.flatironinstitute.org/~polymathic/data/the_well/datasets."""
    n_steps_input: int = Field(4, ge=1)
    """Frames given to the model (The Well's benchmark: 4); sets the task's initial_step."""
    n_steps_output: int = Field(1, ge=1)
    """Frames predicted from each window in the windowed ("one-step") metrics (The Well's benchmark: 1)."""
    dt_stride: int = Field(1, ge=1)
    """Steps between the frames of a window (The Well's min_dt_stride = max_dt_stride); windows start at every
    saved step, and rollouts advance by this stride."""
    use_stats_file: bool = True
    """Normalise with the dataset's stats.yaml when it is present and agrees with the train split's statistics
    (then samples equal The Well's normalised ones); otherwise with the train split's own."""
