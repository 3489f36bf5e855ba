"""The whole config, ``Config``: every section under one model, and the checks that span sections."""

from __future__ import annotations

import re

import pydantic
from pydantic import Field

from train.config.cluster import KubernetesConfig, SkyPilotConfig, SlurmConfig
from train.config.data import DataConfig
from train.config.dist import DistConfig
from train.config.model import BUILT_IN_MODELS, ModelConfig
from train.config.obs import ObsConfig
from train.config.runs import RunConfig
from train.config.section import Section
from train.config.tasks import TaskConfig
from train.config.training import CompileConfig, TrainConfig


class Config(Section):
    tasks: dict[str, TaskConfig] = Field(min_length=1)
    """Tasks by name; every step trains on one batch of each."""
    model: ModelConfig = ModelConfig()
    """The multi-task surrogate."""
    data: DataConfig = DataConfig()
    """Streaming: shards fetched into a bounded node cache instead of whole files."""
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
    skypilot: SkyPilotConfig = SkyPilotConfig()
    """What `python -m train skypilot` writes into the SkyPilot task it renders."""
    kubernetes: KubernetesConfig = KubernetesConfig()
    """What `python -m train kubernetes` writes into the Indexed Job and Service it renders."""

    def streamed(self, name: str) -> bool:
        """Task ``name``'s training split is streamed from a shard set (tasks.<name>.stream, else data.stream)."""
        own = self.tasks[name].stream
        return self.data.stream if own is None else own

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
        for name, task in self.tasks.items():
            if self.streamed(name) and (task.location == "generate" or task.latent_encoder is not None):
                what = "source: generate" if task.location == "generate" else "a latent_encoder"
                raise ValueError(
                    f"tasks.{name} is streamed (data.stream / tasks.{name}.stream) but has {what}: a streamed task "
                    "reads a shard set (make shard writes one; docs/streaming.md): point its source at one, or set "
                    f"tasks.{name}.stream=false"
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
