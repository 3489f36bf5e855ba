"""A run's identity: the settings that decide what is trained, their differences, the hash its checkpoints bear."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from train.config.loading import flatten
from train.config.model import ModelConfig, model_keys_in_use
from train.config.root import Config

# Settings that do not change what is trained: a run may continue under different ones.
_RUNTIME_ONLY = (
    "dist.",
    "slurm.",
    "skypilot.",
    "kubernetes.",
    "run.name",
    "run.runs_dir",
    "run.data_dir",
    "run.cache_dir",
    "run.remote",
    "obs.",
    "train.num_workers",
    "data.cache_limit",  # where the shards wait, not which: the order is data.canonical_nodes' and block_shards'
    "data.prefetch_blocks",
    "data.store_wait_s",
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
    "data.stream": False,
    "data.canonical_nodes": 1,
    "data.block_shards": 2,
}
"""Keys added after runs were tagged with their identity: at these defaults they leave a run's identity as it was."""
_ADDED_LATER_TO_TASKS = {"periodic": None, "stream": None}
"""The same, for a key of every task (``tasks.<name>.<key>``)."""


def _added_later_at_default(key: str, value: Any) -> bool:
    if key in _ADDED_LATER:
        return value == _ADDED_LATER[key]
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "tasks" or parts[2] not in _ADDED_LATER_TO_TASKS:
        return False
    return value == _ADDED_LATER_TO_TASKS[parts[2]]


def run_identity(cfg: Config) -> str:
    """A short hash of :func:`training_view`: the same for every config that trains the same run. The remote's
    pointer tags each checkpoint with it, so a checkpoint of another run is never taken for this run's. Spelled
    as runs were tagged before: the transformer's keys by their older names, later keys only off their defaults,
    so that a remote written by an earlier version still holds this run's checkpoints."""
    view = {
        key.replace("model.transformer.", "model.", 1): value
        for key, value in training_view(cfg).items()
        if not _added_later_at_default(key, value)
    }
    return hashlib.sha1(json.dumps(view, sort_keys=True).encode()).hexdigest()[:16]
