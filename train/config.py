"""Typed configuration: defaults in code, YAML and ``--set key=value`` on top, every key validated.

The schema is a tree of frozen pydantic models. Unknown keys and wrong types are errors that name the
key path (and the nearest valid key), so a typo never silently trains the wrong thing.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from train.errors import ConfigError
from train.pdes import LAYOUTS

_log = logging.getLogger(__name__)

PDE = Literal[tuple(LAYOUTS)]  # the registry's families; a wrong name gets them listed

# Where a split's file may live under a folder or bucket source, tried in order. {task} is the task's name,
# {split} train/val/test, {Split} PDEBench's Train/Valid/Test.
DEFAULT_TEMPLATES = (
    "{task}/{split}.h5",
    "full/{task}/{task}_{split}.h5",
    "full/{task}/{task}_{split}_000.h5",
    "pdebench/{task}_full_v1/{task}_{split}.h5",
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


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
    """Share carved out for validation when no val file exists, next to the test share; 0 disables
    validation."""
    batch_size: int = Field(32, ge=1)
    """Training samples per rank per step."""
    patch_size: int = Field(8, ge=1)
    """Grid points per token along each spatial axis; must divide the strided grid."""
    loss_weight: float = Field(1.0, gt=0)
    """Weight of this task's loss in the summed multi-task loss."""
    sampling_weight: float = Field(1.0, ge=0)
    """Relative probability of drawing this task in a step (train.task_sampling=weighted only), multiplied by its
    size to the power train.sampling_alpha; 0 keeps the task out of training (it is still validated and tested)."""
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
    well: WellConfig | None = None
    """The dataset and windows of a task in The Well's schema; required with pde: well, refused otherwise."""
    files: DatasetFilesConfig | None = None
    """Which files and samples of a neural-operator dataset the task reads (pde: fno_*, neuralop_*, pdearena_*);
    unset settings take the family's published benchmark values (docs/operator-formats.md)."""

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
    """The files and samples of a neural-operator dataset (pde: fno_*, neuralop_*, pdearena_*); an unset
    setting takes the family's published value (docs/operator-formats.md)."""

    train_file: str | None = None
    """The train file's name under the task's `source` folder or location (FNO: burgers_data_R10.mat,
    piececonst_r421_N1024_smooth1.mat, ns_V1e-3_N5000_T50.mat; neuraloperator: {name}_train_{resolution}.pt;
    PDEArena: every .h5 file with 'train' in its name)."""
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


class FNOConfig(Section):
    """A Fourier neural operator per task, after PDEBench's FNO1d/FNO2d."""

    modes: int = Field(12, ge=1)
    """Fourier modes kept along each spatial axis (capped at what the grid holds)."""
    width: int = Field(20, ge=1)
    """Channels of the spectral layers (PDEBench's 20)."""
    layers: int = Field(4, ge=1)
    """Spectral layers (each a spectral convolution plus a pointwise one)."""
    padding: int | None = Field(None, ge=0)
    """Zero padding appended to each spatial axis before the spectral layers, for non-periodic domains; None:
    PDEBench's choice, none on 1D grids and 2 points on 2D grids. Axes the data marks periodic (a Well task's
    boundary conditions) are never padded: the spectral layers wrap them."""
    residual: bool = False
    """Predict the change from the last input frame instead of the next frame itself (The Well's delta
    prediction); time-dependent tasks only."""


class UNetConfig(Section):
    """A U-Net per task, after PDEBench's UNet1d/UNet2d."""

    init_features: int = Field(32, ge=1)
    """Channels of the first level; each of the four levels down doubles them."""
    residual: bool = False
    """Predict the change from the last input frame instead of the next frame itself (The Well's delta
    prediction); time-dependent tasks only."""


class _Attention(Section):
    """Settings of a model of attention heads over d_model channels (model.<section>)."""

    section: ClassVar[str]

    @pydantic.model_validator(mode="after")
    def _check_heads(self) -> _Attention:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.{self.section}.d_model ({self.d_model}) must be a multiple of model.{self.section}.n_heads "
                f"({self.n_heads})"
            )
        return self


class MultiphysicsConfig(_Attention):
    """The multi-physics model: patch tokens of any dimension, a field vocabulary, per-sample normalisation."""

    section = "multiphysics"

    d_model: int = Field(128, ge=8)
    """Width of the tokens and of the shared processor."""
    n_heads: int = Field(4, ge=1)
    """Attention heads; must divide d_model."""
    n_layers: int = Field(4, ge=1)
    """Processor blocks, each attention over space, attention over time (inputs of several frames) and an MLP."""
    mlp_ratio: int = Field(4, ge=1)
    """Hidden width of each block's MLP, as a multiple of d_model."""
    field_width: int = Field(32, ge=1)
    """Width of a field's row in the vocabulary: each grid point's fields are embedded into this many features
    before patching, and decoded from as many."""
    max_frames: int = Field(16, ge=1)
    """Most input frames a task may give (its initial_step): the rows of the learned frame embedding."""
    std_floor: float = Field(1e-2, gt=0)
    """Floor on a sample's per-channel standard deviation when normalising it (in the cache's units, where a
    dataset's channel has std 1): a near-constant field is not blown up into noise."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout in the attention and MLP outputs."""
    output: Literal["state", "increment"] = "state"
    """What a time-dependent task's decoder predicts: 'state', the next frame in the sample's normalised units
    (mean and std over the input window); 'increment', the change from the latest frame in units of the window's
    own frame-to-frame change, so that a field constant over its input stays constant (tasks of one input frame
    have no change to measure and predict as with 'state')."""
    steady_rows: bool = False
    """Steady tasks' outputs decoded by rows of their own (``field_out_steady``), not the rows that also predict
    the next frame of the field of that name: 'pressure' as a Darcy solution and as a flow's evolving field are
    not one quantity."""


class TransformerConfig(_Attention):
    """The multi-task transformer: per-task patch encoders and decoders around one shared processor."""

    section = "transformer"

    d_model: int = Field(96, ge=8)
    """Width of the shared transformer processor."""
    n_heads: int = Field(4, ge=1)
    """Attention heads; must divide d_model."""
    n_layers: int = Field(4, ge=1)
    """Transformer blocks in the shared processor."""
    mlp_ratio: int = Field(4, ge=1)
    """Hidden width of each block's MLP, as a multiple of d_model."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout inside the transformer blocks."""


BUILT_IN_MODELS = ("transformer", "fno", "unet", "multiphysics")
"""The built-in architectures; each reads its settings from model.<its name> (train.model.builtin's table)."""
LEGACY_TRANSFORMER_KEYS = tuple(TransformerConfig.model_fields)
"""Keys the transformer read directly under ``model`` before it had a section of its own: still accepted there
(moved into model.transformer with a note), so older configs, overrides and checkpoints keep working."""


def model_keys_in_use(name: str) -> tuple[str, ...]:
    """The keys under ``model`` that model.name=``name`` is built from."""
    return ("name", name if name in BUILT_IN_MODELS else "args")


def migrate_model_keys(model: Any, origin: str = "model") -> Any:
    """``model`` (a config's model section as data) with the transformer's old top-level keys moved into
    ``model.transformer``; the same value given both ways is one setting, two different ones an error."""
    if not isinstance(model, dict) or not set(model) & set(LEGACY_TRANSFORMER_KEYS):
        return model
    model = dict(model)
    section = dict(model.get("transformer") or {})
    for key in LEGACY_TRANSFORMER_KEYS:
        if key not in model:
            continue
        value = model.pop(key)
        if key in section and section[key] != value:
            raise ValueError(
                f"{origin}.{key}={value!r} and {origin}.transformer.{key}={section[key]!r} disagree; "
                f"{origin}.{key} is the older name of {origin}.transformer.{key}: keep one"
            )
        section[key] = value
    model["transformer"] = section
    return model


class ModelConfig(Section):
    name: str = "transformer"
    """The architecture: a built-in one (transformer, fno, unet, multiphysics: train/model/builtin.py's MODELS), or
    your own factory as 'package.module:function' or 'path/to/file.py:function', called as
    factory(specs, **model.args) (see docs/models.md)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of your own factory (built-in models take their settings from their own section)."""
    transformer: TransformerConfig = TransformerConfig()
    """Settings of model.name=transformer. The keys used to sit directly under model (model.d_model, ...): they
    are still accepted there and moved here, with a note."""
    fno: FNOConfig = FNOConfig()
    """Settings of model.name=fno."""
    unet: UNetConfig = UNetConfig()
    """Settings of model.name=unet."""
    multiphysics: MultiphysicsConfig = MultiphysicsConfig()
    """Settings of model.name=multiphysics."""
    shard_units: list[str] = []
    """With dist.parallel=fsdp or hsdp: the submodules sharded as one unit each (gathered for their forward,
    freed after), as module-name patterns ('blocks.*', 'encoder'). Default: a built-in model's own blocks (the
    model table), and for a model of your own each direct child that holds parameters. The rest of the model
    is sharded as the root unit."""

    @pydantic.field_validator("name")
    @classmethod
    def _known_name(cls, name: str) -> str:
        if name not in BUILT_IN_MODELS and ":" not in name:
            close = difflib.get_close_matches(name.lower(), BUILT_IN_MODELS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"{name!r} is neither a built-in model ({', '.join(BUILT_IN_MODELS)}) nor a factory "
                f"'package.module:function' or 'path/to/file.py:function'{hint}"
            )
        return name

    @pydantic.model_validator(mode="before")
    @classmethod
    def _move_legacy_keys(cls, data: Any) -> Any:
        moved = migrate_model_keys(data)
        if moved is not data:
            old = sorted(set(data) & set(LEGACY_TRANSFORMER_KEYS))
            _log.info(
                "config: %s now live under model.transformer (%s); read from there",
                ", ".join(f"model.{k}" for k in old),
                ", ".join(f"model.transformer.{k}" for k in old),
            )
        return moved


class TrainConfig(Section):
    epochs: int = Field(10, ge=1)
    """Training epochs."""
    steps_per_epoch: int | None = Field(None, ge=1)
    """Optimizer steps per epoch; default: enough for one pass over the largest task's training windows."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(1e-4, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(50, ge=0)
    """Linear warm-up steps before the cosine decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes per rank (unused while the training data is on the device)."""
    data_on_device: bool | Literal["auto"] = "auto"
    """Copy each task's training arrays to every rank's device once and gather each step's batches there by index
    (no DataLoader, no per-batch host work or copy): true, false, or auto (on a GPU when they fit in
    data_on_device_share of its free memory; never on CPU). The same seed trains on the same batches either way;
    true on a device they do not fit is an error (exit 2)."""
    data_on_device_share: float = Field(0.5, gt=0, le=1)
    """The share of a device's free memory (at start-up) the training arrays may take on it; the rest is left to
    the model, its activations and the optimizer."""
    log_every: int = Field(20, ge=1)
    """Write a metrics line every n steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Step checkpoints kept (best.pt is kept besides them); older ones are deleted only after a newer one is
    safely written."""
    checkpoint_every: int | None = Field(None, ge=1)
    """Also checkpoint every n optimizer steps (mid-epoch); default: at the end of each epoch only."""
    find_unused_parameters: bool = False
    """Tell DDP that a step may leave some parameters without a gradient (a model whose forward skips parts of
    itself depending on the data). DDP then searches the autograd graph at every step, which costs time; set
    automatically when ranks draw different tasks (task_sampling=weighted) and the model leaves some task's
    parameters unused when another runs."""
    accept_changed_model_source: bool = False
    """Resume although the source file of a factory of your own (model.name=path.py:function) changed since the
    checkpoint was written; the saved weights are then loaded into the edited model as they are. By default such
    a resume is refused (exit 2): an edit that keeps every shape (GELU to ReLU) would otherwise continue
    silently as another model."""
    accept_changed_data: bool = False
    """Continue (or evaluate) a run whose checkpoints were trained on source files that have changed since (each
    checkpoint records the checksums of the files it was trained on). By default such a launch is refused
    (exit 3) naming the file and both checksums: a rewritten or replaced file would otherwise be trained on, and
    scored, without a word. train.resume=never starts over on the new data instead."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint of this run; 'never': start over (earlier
    checkpoints are moved to checkpoints/archive-<time>/, not deleted); or the path of a checkpoint to start
    from (used while this run has none of its own; its model config must match)."""
    init_from: str | None = None
    """Fine-tuning: start from another run's weights, given as a checkpoint file, a run folder (its best.pt, else
    its newest checkpoint) or a run's remote copy b2://bucket/prefix/<run name>. Only the weights come across:
    the optimizer, schedule, data and steps are this run's own. Parameters of tasks the source was not trained on
    start fresh; any other difference in names or shapes is an error naming the parameter. Used while this run
    has no checkpoint of its own (then it resumes from those). inputs.json and the report record the source."""
    freeze: list[str] = []
    """Parameters kept fixed during training, each given as a name prefix, e.g. ['processor.'] (the transformer's
    shared processor) or ['networks.advection1d.lift'], or as a group the model names (multiphysics: trunk,
    field_rows, patches, decoders); each must match a parameter."""
    lr_groups: dict[str, float] = {}
    """Learning-rate multipliers by parameter group (a name prefix or a group the model names), e.g.
    {trunk: 0.1}: those parameters learn at 0.1 x train.lr, the rest at train.lr, all on the one schedule; the
    first entry that matches a parameter applies. The usual fine-tuning recipe: the pretrained trunk about 10x
    slower than the embeddings and decoders (docs/models.md, 'Fine-tuning onto a new dataset')."""
    init_reset: dict[str, Literal["fresh", "zero"]] = {}
    """With train.init_from: parameter groups (name prefixes or groups the model names) that do not take the
    source's weights: 'fresh' keeps this run's new initialisation, 'zero' sets them to zero (the multi-physics
    model's output rows, field_out, zeroed start fine-tuning at "repeat the last frame", as training from scratch
    does, with the source's decoder projections kept; zero is refused where it would leave no gradient)."""
    eval_batch_size: int = Field(64, ge=1)
    """Samples per rank per evaluation batch."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Autocast precision: auto = bf16 on GPUs that support it (fp16 with a gradient scaler on older ones),
    fp32 on CPU; bf16 and fp16 may be asked for on CPU too."""
    accumulate_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step; gradients are synchronised only on the last (no_sync on the others),
    so the effective batch is batch_size x accumulate_steps x ranks."""
    task_sampling: Literal["all", "weighted"] = "all"
    """'all': every step trains one batch of every task (every head is used, DDP needs no unused-parameter
    search); 'weighted': each rank draws one task per micro-step with probability proportional to
    tasks.<name>.sampling_weight x (its training windows)^sampling_alpha, from (seed, draw group, epoch, step):
    under ddp every rank is its own draw group, so ranks train different tasks in the same step; under fsdp and
    hsdp the ranks of one shard group draw the same task."""
    sampling_alpha: float = Field(0.0, ge=0)
    """With task_sampling=weighted: the exponent of each task's size (its training windows) in its probability; 0
    ignores sizes (sampling_weight alone), 1 draws in proportion to size, between them flattens a mix toward its
    small sources (alpha = 1/temperature)."""
    held_out: list[str] = []
    """Datasets this run must not train on (a pretraining recipe's evaluation sets, kept for fine-tuning): a task
    of that name is refused (exit 2)."""
    val_every: int | None = Field(None, ge=1)
    """Validate every n optimizer steps (on every rank's shard, reduced); default: at the end of each epoch."""
    objective: Literal["one_step", "pushforward", "unrolled"] = "one_step"
    """How time-dependent tasks are trained (steady ones always predict their one output): 'one_step' predicts
    the next frame from true frames; 'pushforward' first rolls out a number of steps drawn from
    0..rollout_steps-1 without gradient, then trains one step from its own predictions (robust rollouts at
    about one step's cost); 'unrolled' backpropagates through rollout_steps predicted frames."""
    rollout_steps: int = Field(4, ge=2)
    """Frames predicted from one training window by pushforward (the most steps rolled out without gradient,
    plus one) and unrolled (the steps backpropagated through); one_step does not use it."""
    val_metric: Literal["rollout_nrmse", "loss"] = "rollout_nrmse"
    """What validation scores, and best.pt and early stopping follow: 'rollout_nrmse', the nRMSE of the whole
    autoregressive rollout on the val split (the test metric: a low one-step loss can still roll out badly);
    'loss', the one-step training loss. Both are logged. Tasks are weighed by loss_weight."""
    early_stop_patience: int | None = Field(None, ge=1)
    """Stop after this many validations in a row without improvement of the validation score (val_metric);
    every rank stops at the same step. Default: never stop early."""
    early_stop_min_delta: float = Field(0.0, ge=0)
    """A validation score counts as an improvement only when it is below the best by more than this."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What a NaN/Inf gradient does (detected after the all-reduce, so every rank agrees): 'stop' exits with
    an error and keeps the last good checkpoint; 'skip' drops that step's update."""
    max_skipped_steps: int = Field(10, ge=1)
    """Non-finite steps in a row tolerated (with on_nonfinite=skip, or fp16's loss scaling) before stopping."""


class CompileConfig(Section):
    enabled: bool | Literal["auto"] = "auto"
    """torch.compile the whole training step (rollout, loss, gradients and their all-reduce, clipping, AdamW;
    the model alone where a strategy or model rules that out): true, false, or auto (on with CUDA; off on CPU,
    where compiling a default-sized run costs about what it saves: docs/benchmarks.md, 'Compiled step')."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode. reduce-overhead replays the whole step as a CUDA graph with one process; with several,
    or where the model is compiled alone under DDP (whose gradient hooks a replayed CUDA graph would skip), the
    modes that capture CUDA graphs run as their graph-free variant (default, max-autotune-no-cudagraphs)."""
    backend: Literal["inductor", "aot_eager"] = "inductor"
    """The compiler behind torch.compile: inductor generates fused kernels (Triton on GPU, C++ on CPU); aot_eager
    traces the same graphs (rollout, backward, all-reduce, update) and runs them with PyTorch's own kernels. With no
    code generated it compiles in seconds and gains no speed: to tell a failing code generator from a step that
    does not hold as one graph, and to check a compiled run's graphs and its replay after a fault on CPU."""
    strict: bool = False
    """Stop (exit 2) when the step cannot be compiled whole (a graph break, named with its place) or compiling
    fails; by default a break compiles the model alone and a failing compiler runs the step eagerly, each with a
    warning."""


class DistConfig(Section):
    nproc: int | Literal["auto"] = "auto"
    """Processes per node: auto = one per visible GPU, or cpu_nproc without GPUs."""
    cpu_nproc: int = Field(2, ge=1)
    """Processes launched by nproc=auto when no GPU is visible."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto = nccl on CUDA, gloo on CPU."""
    timeout_s: int = Field(300, ge=10)
    """Seconds a collective (or the rendezvous) may wait for a peer before failing with an error."""
    max_restarts: int = Field(0, ge=0)
    """Times torchrun restarts the whole group after a rank fails."""
    backend_fallback: bool = False
    """Allow falling back from nccl to gloo (with a loud warning) when NCCL is missing or fails to start;
    off by default, because a silent fall back to gloo trains many times slower."""
    shutdown_timeout_s: int = Field(120, ge=1)
    """Seconds the ranks get to stop (and save a checkpoint) after the launcher forwards a SIGTERM or SIGUSR1,
    before they are killed."""
    parallel: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """How the model is spread over the ranks (train/strategies.py's STRATEGIES, wrapped by
    train/engine/parallel.py): 'ddp', a whole copy of weights,
    gradients and optimizer state on every rank; 'fsdp', each of them sharded over all ranks (FSDP2's fully_shard:
    about 1/ranks of the model state per rank, the weights gathered unit by unit for the forward and backward);
    'hsdp', sharded within groups of dist.shard_group_size ranks and replicated across the groups."""
    shard_group_size: int | None = Field(None, ge=1)
    """With hsdp: the ranks one copy of the model is sharded over (it must divide the world size); default: the
    ranks of one node, so that the gathers stay inside a node and only the gradient reduction crosses nodes."""
    checkpoint: Literal["auto", "sharded", "full"] = "auto"
    """How a sharded model (fsdp, hsdp) is checkpointed. 'sharded': every rank writes its own shards into one
    folder, step_NNNNNNNN.dcp (torch.distributed.checkpoint): no rank ever holds the whole model, and the save
    costs no gathers. 'full': the shards gathered onto rank 0's CPU and written as one .pt file, as under ddp.
    'auto': sharded where every rank writes into the one run folder (one node, or nodes sharing a file system),
    full across nodes with run folders of their own (a launch hands rank 0's checkpoint to the other nodes as
    one file). Either form resumes under any strategy and world size, and run.remote mirrors either (a folder
    packed as one file); `python -m train consolidate` turns a folder into one file."""


class SlurmConfig(Section):
    nodes: int = Field(1, ge=1)
    """Nodes of the job; one task per node runs the launcher, which starts one rank per GPU."""
    gpus_per_node: int = Field(8, ge=0)
    """GPUs requested on each node (--gpus-per-node); the launcher starts one rank per visible GPU. 0: a CPU-only
    job without any GPU request (nodes without GPUs reject one), whose launcher starts CPU ranks (dist.nproc, or
    dist.cpu_nproc with nproc auto)."""
    cpus_per_gpu: int = Field(8, ge=1)
    """CPU cores per GPU (the task gets gpus_per_node times this): DataLoader workers run on them."""
    cpus_per_task: int | None = Field(None, ge=1)
    """CPU cores of each node's task (--cpus-per-task), which runs the launcher and all its ranks; default:
    gpus_per_node x cpus_per_gpu with GPUs; with gpus_per_node=0, the CPU ranks (dist.nproc, or dist.cpu_nproc
    with nproc auto) x (train.num_workers + 1)."""
    time: str = "24:00:00"
    """Wall-clock limit (--time), e.g. 24:00:00, 2-00:00:00 or UNLIMITED; at least preempt_signal_s + 120 s."""
    partition: str | None = None
    """Partition (--partition); default: the cluster's default."""
    account: str | None = None
    """Account charged (--account); default: your default account."""
    container: Literal["none", "pyxis", "apptainer"] = "none"
    """Run inside a container: pyxis/enroot (srun --container-image) or apptainer (apptainer exec --nv)."""
    image: str | None = None
    """Container image: a registry reference for pyxis, a .sif file or docker:// reference for apptainer."""
    preempt_signal_s: int = Field(300, ge=10)
    """Seconds before the time limit at which SLURM sends SIGUSR1, so the run checkpoints and requeues. SLURM may
    send it up to 60 s earlier, so `time` must be at least this plus 120 s."""
    requeue: bool = True
    """Requeue the job after a preemption or time-limit stop (exit code 75), so it resumes where it stopped."""
    extra_sbatch: list[str] = []
    """Further #SBATCH options, e.g. ['--qos=high', '--constraint=h100']."""

    @pydantic.model_validator(mode="after")
    def _check_image(self) -> SlurmConfig:
        if self.container != "none" and not self.image:
            raise ValueError(f"slurm.container={self.container} needs slurm.image (the image to run)")
        return self


class RunConfig(Section):
    name: str | None = None
    """Run folder name under runs_dir; default: the config file's stem."""

    @pydantic.field_validator("name")
    @classmethod
    def _one_folder(cls, name: str | None) -> str | None:
        if name is not None and (name.strip() in ("", ".", "..") or any(c in name for c in "/\\\0")):
            raise ValueError(
                f"{name!r} is not a folder name: a run is one folder under run.runs_dir, whose name holds no '/' "
                "and is neither '.' nor '..' (run.runs_dir says where run folders go)"
            )
        return name

    runs_dir: str = "runs"
    """Where run folders (config, metrics, logs, checkpoints, report) go."""
    data_dir: str = "data"
    """Where generated or downloaded HDF5 files go (data/<task>/...)."""
    cache_dir: str = "cache"
    """Where memory-mapped training caches go (cache/<task>/<hash>/...)."""
    seed: int = 0
    """Seed of model initialisation, sampling order and dropout."""
    remote: str | None = None
    """Where the run is mirrored so that it outlives this machine: 'b2://bucket/prefix' (the B2 credentials of
    data downloads) or a folder on a shared file system. The run's folder <remote>/<run name>/ receives every
    kept checkpoint and best.pt (each SHA1-verified, then named by checkpoints/latest.json), the config,
    metrics.jsonl and, when the launch ends, the report and logs. A launch without a local checkpoint resumes
    from the remote's newest verified one. Default: no remote."""
    remote_wait_s: int = Field(120, ge=0)
    """Seconds the launcher waits, when the ranks have stopped (a finished run, a stop request or a failure),
    for the newest checkpoint, the report and the logs to reach the remote, before it exits anyway."""
    remote_lease_s: float = Field(60.0, ge=1.0)
    """Seconds a launch's lease on the remote (``<remote>/<run name>/lease.json``) lasts without renewal; the
    launch renews it three times as often. A second launch of the run (another box) that finds a lease renewed
    within this time stops with exit 4; one left by a launch that died is taken over after this long."""

    @pydantic.field_validator("remote")
    @classmethod
    def _check_remote(cls, remote: str | None) -> str | None:
        if remote is None:
            return None
        if remote.startswith("b2://"):
            bucket, _, prefix = remote.removeprefix("b2://").partition("/")
            if not bucket or {".", ".."} & set(prefix.strip("/").split("/")) or "\\" in prefix:
                raise ValueError(f"run.remote={remote!r}: expected b2://bucket or b2://bucket/prefix")
        elif "://" in remote or not remote.strip():
            raise ValueError(f"run.remote={remote!r}: use b2://bucket/prefix or a folder path")
        elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", remote):
            raise ValueError(
                f"run.remote={remote!r} looks like a mistyped URL (b2:// has two slashes); a folder named "
                f"{remote.split(':')[0]}: is refused. Use b2://bucket/prefix, or ./{remote} for such a folder"
            )
        return remote


class WandbConfig(Section):
    """Weights & Biases tracking of the run, beside metrics.jsonl and TensorBoard (needs the 'wandb' extra)."""

    mode: Literal["disabled", "online", "offline"] = "disabled"
    """'online' streams to W&B (WANDB_API_KEY in the environment, or `wandb login`); 'offline' writes the run
    under runs/<name>/wandb/ for a later `wandb sync`; 'disabled' does nothing."""
    project: str = "pde-surrogates"
    """W&B project the run belongs to."""
    entity: str | None = None
    """W&B team or user; default: the API key's default entity."""
    group: str | None = None
    """W&B group of the run; a sweep's trials are grouped under the sweep's name."""


class ObsConfig(Section):
    wandb: WandbConfig = WandbConfig()
    """Experiment tracking in W&B: the same scalars as metrics.jsonl, the report's plots, and the run's true
    outcome (finished, preempted at a step, or failed with its exit code and first error line)."""


class Config(Section):
    tasks: dict[str, TaskConfig] = Field(min_length=1)
    """Tasks by name; every step trains on one batch of each."""
    model: ModelConfig = ModelConfig()
    """The multi-task surrogate."""
    train: TrainConfig = TrainConfig()
    """Optimisation, checkpoints and logging."""
    compile: CompileConfig = CompileConfig()
    """torch.compile settings."""
    dist: DistConfig = DistConfig()
    """Launch and process-group settings."""
    run: RunConfig = RunConfig()
    """Names, folders and the remote copy of the run."""
    obs: ObsConfig = ObsConfig()
    """Experiment tracking beyond the run folder."""
    slurm: SlurmConfig = SlurmConfig()
    """What `python -m train slurm` writes into the sbatch file it renders."""

    @pydantic.model_validator(mode="after")
    def _check_consistency(self) -> Config:
        name = self.model.name
        if self.model.args and name in BUILT_IN_MODELS:
            raise ValueError(
                f"model.args is only for a factory of your own; model.name={name} takes its settings from its "
                "own section (see docs/models.md)"
            )
        latent = [t for t, task in self.tasks.items() if task.latent_encoder is not None]
        if latent and name != "transformer":
            raise ValueError(
                f"tasks.{latent[0]}.latent_encoder needs model.name=transformer (the frozen encoder is the "
                f"transformer's patch encoder); model.name={name} cannot use it: remove latent_encoder"
            )
        if latent and self.train.objective != "one_step":
            raise ValueError(
                f"tasks.{latent[0]}.latent_encoder holds the encoder's tokens of true input frames, but "
                f"train.objective={self.train.objective} feeds the model its own predictions: use "
                "train.objective=one_step, or remove latent_encoder"
            )
        held = sorted(set(self.train.held_out) & set(self.tasks))
        if held:
            raise ValueError(
                f"tasks.{held[0]} is named in train.held_out: a held-out dataset must not be trained on; remove the "
                f"task, or take it out of train.held_out"
            )
        if self.train.task_sampling == "weighted" and not any(t.sampling_weight > 0 for t in self.tasks.values()):
            raise ValueError(
                f"every task's sampling_weight is 0 ({', '.join(f'tasks.{n}' for n in self.tasks)}): with "
                "train.task_sampling=weighted no task could be drawn; give at least one a weight above 0"
            )
        for name in self.tasks:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
                raise ValueError(f"task name {name!r} must be letters, digits and '_', starting with a letter")
            if name == "compile":  # report/summary.json's block of what torch.compile did
                raise ValueError("task name 'compile' is taken by the report's compile block: name the task otherwise")
        for name, task in self.tasks.items():
            for template in task.templates:
                try:
                    template.format(task="t", split="train", Split="Train")
                except (KeyError, IndexError, ValueError) as e:
                    raise ValueError(
                        f"tasks.{name}.templates: {template!r} is not a valid template ({type(e).__name__}: {e}); "
                        f"placeholders are {{task}}, {{split}} and {{Split}}"
                    ) from None
            if task.test_fraction + task.val_fraction > 0.9 + 1e-9:
                raise ValueError(
                    f"tasks.{name}: test_fraction + val_fraction must leave at least 10% of samples for training"
                )
        return self


# YAML 1.1 (PyYAML) reads "1e-3" as a string; users mean a float.
class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def parse_yaml(text: str, origin: str) -> Any:
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=_Loader), origin)
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{origin}: not valid YAML: {e}") from None


def _refuse_duplicate_keys(node: yaml.Node | None, origin: str, path: tuple[str, ...] = ()) -> None:
    """YAML lets a repeated key replace the first silently: a second ``train:`` section drops every key of the
    first. Any key twice in one mapping, at any depth, is an error naming both lines."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, origin, (*path, str(i)))
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
        if key is not None and key in seen:
            where = ".".join((*path, key))
            raise ConfigError(
                f"{origin}: '{where}' appears twice, at line {seen[key]} and line {key_node.start_mark.line + 1}; "
                "YAML would silently keep only the second (a whole section, when it is one). Merge the two into one"
            )
        if key is not None:
            seen[key] = key_node.start_mark.line + 1
        _refuse_duplicate_keys(value_node, origin, (*path, key or "?"))


def apply_override(tree: dict, override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (``3`` is an int, ``x`` a string)."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} must look like key.path=value, e.g. train.epochs=3")
    parts = key.strip().split(".")
    if len(parts) == 2 and parts[0] == "model" and parts[1] in LEGACY_TRANSFORMER_KEYS:
        parts.insert(1, "transformer")  # the older name: the override sets what it always meant
    if parts[:2] == ["model", "transformer"] and len(parts) == 3 and isinstance(tree.get("model"), dict):
        tree["model"].pop(parts[2], None)  # the file's value under the older name is what the override replaces
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = parse_yaml(raw, f"override {override!r}")


def _walk(loc: tuple) -> tuple[list[str], list[str]]:
    """Split a pydantic error location into the user's key path and the valid keys at its end.

    Pydantic adds the member of a union type to the location ('compile.enabled.bool'); those parts are
    not keys the user wrote, so they are dropped.
    """
    node: Any = Config
    path: list[str] = []
    for part in loc:
        if isinstance(node, tuple):  # ("dict", value type): this part is a key the user chose
            path.append(str(part))
            node = node[1]
            continue
        if isinstance(node, type) and issubclass(node, BaseModel) and str(part) in node.model_fields:
            path.append(str(part))
            annotation = node.model_fields[str(part)].annotation
            is_dict = getattr(annotation, "__origin__", None) is dict
            node = ("dict", annotation.__args__[-1]) if is_dict else annotation
        elif isinstance(node, type) and issubclass(node, BaseModel):
            path.append(str(part))  # an unknown key: the end of the path
            break
    if isinstance(node, type) and issubclass(node, BaseModel):
        return path, list(node.model_fields)
    return path, []


# Keys that moved to another section: an old config gets told where they went.
_MOVED = {"train.compile": "compile.enabled", "train.compile_mode": "compile.mode"}


def _describe(errors: list[dict]) -> list[tuple[str, str]]:
    """Each problem as (the key path it is about, a line for the user)."""
    by_path: dict[str, list[dict]] = {}
    lines = []
    for error in errors:
        loc = tuple(error["loc"])
        if error["type"] == "extra_forbidden":
            path, _ = _walk(loc)
            section, valid = _walk(loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            if ".".join(path) in _MOVED:
                hint = f" (moved: use '{_MOVED['.'.join(path)]}')"
            elif close:
                hint = f" (did you mean '{'.'.join(path[:-1] + close)}'?)"
            else:
                hint = f" (the keys of {'.'.join(section) or 'the top level'} are: {', '.join(valid)})"
            lines.append((".".join(path), f"unknown key '{'.'.join(path)}'{hint}"))
        elif error["type"] == "missing":
            where = ".".join(_walk(loc)[0])
            lines.append((where, f"missing required key '{where}'"))
        elif error["type"] == "value_error":
            where = ".".join(_walk(loc)[0])
            msg = error["msg"].removeprefix("Value error, ")
            lines.append((where, f"'{where}': {msg}" if where else msg))
        else:
            by_path.setdefault(".".join(_walk(loc)[0]), []).append(error)
    for path, errs in by_path.items():
        msgs = " or ".join(dict.fromkeys(e["msg"] for e in errs))
        lines.append((path, f"'{path}': {msgs} (got {errs[0].get('input')!r})"))
    return lines


def _override_of(path: str, overrides: dict[str, str]) -> str | None:
    """The --set override that set ``path``, a section above it, or a key below it."""
    for key, override in overrides.items():
        if path == key or path.startswith(key + ".") or (path and key.startswith(path + ".")):
            return override
    return None


def validate(tree: Any, origin: str, overrides: dict[str, str] | None = None, file_tree: Any = None) -> Config:
    """The typed config of ``tree``; ``overrides``: the --set overrides applied to it by key path, so that a
    problem they caused is blamed on them rather than on the file; ``file_tree``: the file's own tree, before
    them (a problem of several keys at once, which names no one key, is the overrides' when the file alone is
    valid)."""
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping of sections, got {type(tree).__name__}")
    try:
        return Config.model_validate(tree)
    except pydantic.ValidationError as e:
        found = [(line, _override_of(path, overrides or {})) for path, line in _describe(e.errors())]
        if overrides and file_tree is not None and not all(override for _, override in found):
            try:
                Config.model_validate(file_tree)
            except pydantic.ValidationError:
                pass
            else:  # the file alone is valid: the overrides together made it invalid
                every = ", ".join(dict.fromkeys(overrides.values()))
                found = [(line, override or every) for line, override in found]
        if all(override for _, override in found):  # the file is fine: name the overrides alone
            where = ", ".join(dict.fromkeys(override for _, override in found))
            problems = "\n".join(f"  - {line}" for line, _ in found)
            raise ConfigError(f"{where}: invalid override of {origin}:\n{problems}") from None
        problems = "\n".join(f"  - {line}{f' (set by {o})' if o else ''}" for line, o in found)
        raise ConfigError(f"{origin}: invalid config:\n{problems}") from None


def load_config(path: str | Path | None, overrides: list[str] = (), run_name: str | None = None) -> Config:
    """Read a YAML config (or none: defaults only), apply ``key=value`` overrides, validate."""
    tree: Any = {}
    origin = "config"
    if path is not None:
        path = Path(path)
        origin = str(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found; pass an existing YAML file (see configs/)")
        tree = parse_yaml(path.read_text(), origin)
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{origin}: the top level must be a mapping of sections, got {type(tree).__name__}")
        if path.stem and (tree.get("run") or {}).get("name") is None:
            tree.setdefault("run", {})
            if isinstance(tree["run"], dict):
                tree["run"] = {**tree["run"], "name": path.stem}
    set_by, file_tree = {}, copy.deepcopy(tree)
    for override in overrides:
        apply_override(tree, override)
        set_by[override.partition("=")[0].strip()] = f"--set {override}"
    if run_name is not None:
        if not isinstance(tree.get("run", {}), dict):
            raise ConfigError(f"{origin}: 'run' must be a section")
        tree["run"] = {**tree.get("run", {}), "name": run_name}
        set_by["run.name"] = f"--run {run_name}"
    return validate(tree, origin, set_by, file_tree)


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


# Settings that do not change what is trained: a run may continue under different ones.
_RUNTIME_ONLY = (
    "dist.",
    "slurm.",
    "run.name",
    "run.runs_dir",
    "run.data_dir",
    "run.cache_dir",
    "run.remote",
    "obs.",
    "train.num_workers",
    "train.data_on_device",  # and its share: the same batches either way
    "model.shard_units",  # how the model is spread, not what it is
    "train.find_unused_parameters",
    "train.accept_changed_model_source",
    "train.accept_changed_data",
    "train.log_every",
    "train.eval_batch_size",
    "train.keep_checkpoints",
    "train.checkpoint_every",
    "train.resume",
    "compile.",
)


def _left_out(model_name: str, one_step: bool) -> tuple[str, ...]:
    """Settings that do not change what is trained, for a model and objective: the runtime-only ones, the other
    models' settings, and rollout_steps under one-step training."""
    unused = tuple(f"model.{key}" for key in ModelConfig.model_fields if key not in model_keys_in_use(model_name))
    return _RUNTIME_ONLY + unused + (("train.rollout_steps",) if one_step else ())


def training_view(cfg: Config) -> dict[str, Any]:
    """The flattened settings that decide what is trained."""
    left_out = _left_out(cfg.model.name, cfg.train.objective == "one_step")
    return {k: v for k, v in sorted(flatten(cfg.model_dump(mode="json")).items()) if not k.startswith(left_out)}


def training_differences(a: Config, b: Config) -> list[str]:
    """Keys whose values differ between two configs, ignoring settings that do not affect training (a model's
    settings are differences only under b's model.name: a changed name always is one)."""
    fa, fb = flatten(a.model_dump(mode="json")), flatten(b.model_dump(mode="json"))
    left_out = _left_out(b.model.name, a.train.objective == "one_step" and b.train.objective == "one_step")
    return [k for k in sorted(set(fa) | set(fb)) if not k.startswith(left_out) and fa.get(k) != fb.get(k)]


_ADDED_LATER = {
    "train.init_from": None,
    "train.freeze": [],
    "model.multiphysics.output": "state",
    "model.multiphysics.steady_rows": False,
}
"""Keys added after runs were tagged with their identity: at these defaults they leave a run's identity as it was."""


def run_identity(cfg: Config) -> str:
    """A short hash of :func:`training_view`: the same for every config that trains the same run. The remote's
    pointer tags each checkpoint with it, so a checkpoint of another run is never taken for this run's. Spelled
    as runs were tagged before: the transformer's keys by their older names, later keys only off their defaults,
    so that a remote written by an earlier version still holds this run's checkpoints."""
    view = {
        key.replace("model.transformer.", "model.", 1): value
        for key, value in training_view(cfg).items()
        if key not in _ADDED_LATER or value != _ADDED_LATER[key]
    }
    return hashlib.sha1(json.dumps(view, sort_keys=True).encode()).hexdigest()[:16]
