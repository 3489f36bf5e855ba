"""What a model is built from: each task's shapes (``TaskSpec``), made from its cache in one place.

Every model (the built-in one and a user's) is built from ``{task name: TaskSpec}`` and the model config; the
trainer and evaluation see a task as ``TaskData``: its cache, its spec and its optional latent cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from train.config import TaskConfig
from train.data.cache import CacheInfo
from train.data.dataset import LatentInfo


@dataclass(frozen=True)
class TaskSpec:
    """Shapes of one task, from its cache: what the encoder reads and the decoder writes."""

    grid: tuple[int, ...]
    in_channels: int
    out_channels: int
    patch_size: int
    initial_step: int
    autoregressive: bool

    @property
    def in_features(self) -> int:
        frames = self.initial_step if self.autoregressive else 1
        return frames * self.in_channels

    def as_dict(self) -> dict:
        return asdict(self)


def task_spec(info: CacheInfo, task: TaskConfig) -> TaskSpec:
    """The spec of a task whose cache is ``info``: shapes from the data, patching and history from the config."""
    return TaskSpec(
        grid=info.grid,
        in_channels=info.in_channels,
        out_channels=info.out_channels,
        patch_size=task.patch_size,
        initial_step=task.initial_step,
        autoregressive=info.autoregressive,
    )


@dataclass(frozen=True)
class TaskData:
    """A task as the trainer sees it: its cache and its model spec."""

    name: str
    info: CacheInfo
    spec: TaskSpec
    latent: LatentInfo | None = None
    """The frozen encoder's precomputed tokens of the training split, when the task names a latent_encoder."""

    def denormalise_target(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.info.target_mean, dtype=x.dtype, device=x.device)
        std = torch.tensor(self.info.target_std, dtype=x.dtype, device=x.device)
        return x * std + mean
