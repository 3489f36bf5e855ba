"""What a model is built from: each task's shapes (``TaskSpec``), made from its cache in one place.

Every model (the built-in one and a user's) is built from ``{task name: TaskSpec}`` and the model config; the
trainer and evaluation see a task as ``TaskData``: its cache, its spec and its optional latent cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from train.config import TaskConfig
from train.data.cache.info import CacheInfo
from train.data.dataset import LatentInfo
from train.errors import ConfigError, DataError
from train.model.fields import task_fields
from train.pdes import LAYOUTS, PERIODIC


@dataclass(frozen=True)
class TaskSpec:
    """Shapes of one task, from its cache: what the encoder reads and the decoder writes."""

    grid: tuple[int, ...]
    in_channels: int
    out_channels: int
    patch_size: int
    initial_step: int
    autoregressive: bool
    frame_stride: int = 1
    """Saved steps between consecutive frames the model sees (a Well task's dt_stride)."""
    boundary: tuple[tuple[int, int], ...] = ()
    """Per spatial axis, the (lower, upper) boundary codes WALL=0, OPEN=1, PERIODIC=2 where the data says
    (The Well); () where it does not (PDEBench). The built-in FNO and U-Net wrap periodic axes and pad others."""
    fields: tuple[str, ...] = ()
    """The physical name of each channel (train.model.fields): the inputs, then for a steady task the outputs;
    () where unknown. The multi-physics model's weights are rows by these names."""

    @property
    def const_channels(self) -> int:
        """Input channels beyond the predicted ones: constant fields and scalars, appended to every frame."""
        return self.in_channels - self.out_channels if self.autoregressive else 0

    @property
    def periodic(self) -> tuple[bool, ...]:
        """Per spatial axis, whether it wraps around (both sides periodic); all False when unknown."""
        if not self.boundary:
            return (False,) * len(self.grid)
        return tuple(lo == 2 and hi == 2 for lo, hi in self.boundary)

    @property
    def in_features(self) -> int:
        frames = self.initial_step if self.autoregressive else 1
        return frames * self.in_channels

    def as_dict(self) -> dict:
        return asdict(self)


def spec_from_record(record: dict) -> TaskSpec:
    """A TaskSpec from its record in a checkpoint (``as_dict``, JSON-like: lists for tuples); keys a checkpoint
    predates take their defaults."""
    tuples = lambda value: tuple(tuples(v) for v in value) if isinstance(value, list | tuple) else value  # noqa: E731
    return TaskSpec(**{key: tuples(value) for key, value in record.items()})


def task_spec(info: CacheInfo, task: TaskConfig, name: str) -> TaskSpec:
    """The spec of task ``name`` whose cache is ``info``: shapes from the data, patching and history from the
    config, field names from both."""
    return TaskSpec(
        grid=info.grid,
        in_channels=info.in_channels,
        out_channels=info.out_channels,
        patch_size=task.patch_size,
        initial_step=task.initial_step,
        autoregressive=info.autoregressive,
        frame_stride=task.window_stride,
        boundary=task_boundary(name, task, info),
        fields=task_fields(name, task, info),
    )


def task_boundary(name: str, task: TaskConfig, info: CacheInfo) -> tuple[tuple[int, int], ...]:
    """Per spatial axis, the (lower, upper) boundary codes the models honour: the data's own record (a Well
    file's boundary conditions, a generic-array file's periodic axes), else the family's published ones
    (train/pdes.py), else () unknown; ``tasks.<name>.periodic`` sets them where the data says nothing and must
    agree where it does (DataError, exit 3, naming both)."""
    dims = len(info.grid)
    recorded = tuple(tuple(int(c) for c in axis) for axis in info.boundary)
    if not recorded and LAYOUTS[info.pde].periodic:
        recorded = ((PERIODIC, PERIODIC),) * dims
    if task.periodic is None:
        return recorded
    wanted = [task.periodic] * dims if isinstance(task.periodic, bool) else list(task.periodic)
    if len(wanted) != dims:
        raise ConfigError(
            f"tasks.{name}.periodic has {len(wanted)} flag(s), the data has {dims} spatial axes: give one per axis "
            "or a single true/false"
        )
    if info.boundary:  # the file says: the setting may only repeat it
        said = [lo == PERIODIC and hi == PERIODIC for lo, hi in recorded]
        if said != wanted:
            raise DataError(
                f"tasks.{name}.periodic={wanted} contradicts the data ({info.path}: periodic axes {said}); remove "
                f"the setting or fix the file"
            )
        return recorded
    return tuple((PERIODIC, PERIODIC) if wraps else (0, 0) for wraps in wanted)


@dataclass(frozen=True)
class TaskData:
    """A task as the trainer sees it: its cache and its model spec."""

    name: str
    info: CacheInfo
    spec: TaskSpec
    latent: LatentInfo | None = None
    """The frozen encoder's precomputed tokens of the training split, when the task names a latent_encoder."""
    window_outputs: int = 1
    """Frames predicted from each window in a Well task's windowed metrics (well.n_steps_output)."""
    resident: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """Splits whose trajectories (as :meth:`trajectories` reads them) are held on the device
    (train.data_on_device); filled by the trainer where they fit."""

    def trajectories(self, split: str, index) -> torch.Tensor:
        """Trajectories ``index`` of ``split`` as the model reads them (constant channels on every frame), every
        ``frame_stride``-th saved step: (b, t, *grid, in_channels), normalised; on the device where the split is
        held there."""
        held = self.resident.get(split)
        if held is not None:
            return held[torch.as_tensor(np.asarray(index), device=held.device)]
        traj = self.info.trajectories(split, index)[:, :: self.spec.frame_stride]
        return torch.from_numpy(np.ascontiguousarray(traj))

    def card(self) -> dict:
        """What using the model on this task needs beyond its shapes (a checkpoint's TASK_CARDS entry)."""
        info = self.info
        return {
            "pde": info.pde,
            "channels": list(info.channels),
            "n_frames": info.n_frames,
            "input_mean": list(info.input_mean),
            "input_std": list(info.input_std),
            "target_mean": list(info.target_mean),
            "target_std": list(info.target_std),
            "const_mean": list(info.const_mean),
            "const_std": list(info.const_std),
            "statistics": info.statistics,
        }

    def denormalise_target(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.info.target_mean, dtype=x.dtype, device=x.device)
        std = torch.tensor(self.info.target_std, dtype=x.dtype, device=x.device)
        return x * std + mean
