"""The ``obs`` section: experiment tracking beyond the run folder (Weights & Biases)."""

from __future__ import annotations

from typing import Literal

from train.config.section import Section


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
