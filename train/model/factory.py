"""The model seam: the one function that turns the tasks' specs and the model config into a module.

The trainer, evaluation, the smoke test's callers and the bench all build the model here, so choosing
another architecture changes this function and nothing that calls it. A model maps a dict of per-task
inputs (normalised, channels last) to a dict of per-task predictions of the same layout.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from train.config import ModelConfig
from train.model.multitask import MultiTaskSurrogate
from train.model.specs import TaskSpec


def build_model(specs: Mapping[str, TaskSpec], cfg: ModelConfig) -> nn.Module:
    """A freshly initialised model for these tasks (initialised from torch's default generator)."""
    return MultiTaskSurrogate(dict(specs), cfg)
