"""Fine-tuning: a new run that starts from another run's weights (``train.init_from``), parts of it fixed
(``train.freeze``).

The launcher resolves the source once (train.remote.fetch.resolve_initial_weights: a checkpoint file, a run
folder's best checkpoint, or a remote run's, fetched) and records it in inputs.json; every rank loads the same
file before DDP wraps the model. Only the weights come across: the optimizer, the schedule, the data and the
step count are the new run's own. A run that has checkpoints of its own resumes from them, never from the
source again.

Matching is by parameter name. A parameter under the name of a task the source was not trained on (the
transformer's ``codecs.<task>.*``, the FNO's and U-Net's ``networks.<task>.*``, a user model's ModuleDict by
task) starts fresh; the source's parameters of tasks this run leaves out are dropped. A model whose weights are
rows keyed by the data (the multi-physics model's field vocabulary and patch geometries) first fits the source's
state to itself (``adapt_initial_state``): known field names keep their trained rows, new ones start fresh.
Any other parameter must be in the source with the same shape: a mismatch names the parameter and both shapes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from train.checkpoint import CONFIG, MODEL, SPECS, checkpoint_digest, load_checkpoint
from train.config import Config
from train.engine.param_groups import names_of, selected
from train.errors import ConfigError
from train.model.specs import spec_from_record

log = logging.getLogger(__name__)


def sha256_of(path: Path) -> str:
    """The record's digest, as the launcher wrote it (train.remote.fetch)."""
    return checkpoint_digest(path, "sha256")


def _task_of(key: str, tasks: set[str]) -> str | None:
    return next((part for part in key.split(".") if part in tasks), None)


def _matched(state: dict, ours: dict, new_tasks: set[str], fresh_parts) -> tuple[dict, set, set, list[str]]:
    """The source's tensors this model takes (same name and shape), the new tasks and patch geometries that start
    fresh, and what does not fit."""
    problems, load, fresh, shapes = [], {}, set(), set()
    for key, value in ours.items():
        if key in state and tuple(state[key].shape) == tuple(value.shape):
            load[key] = state[key]
        elif key in state:
            problems.append(f"{key}: {tuple(state[key].shape)} there, {tuple(value.shape)} here")
        elif (task := _task_of(key, new_tasks)) is not None:
            fresh.add(task)
        elif key.startswith(tuple(fresh_parts)):
            shapes.add(key.split(".")[1])
        else:
            problems.append(f"{key}: not in the source")
    return load, fresh, shapes, problems


def _resets(model: nn.Module, cfg: Config) -> dict[str, str]:
    """train.init_reset as parameter name -> 'fresh' or 'zero'; a zero that would leave a parameter without a
    gradient is a ConfigError naming the parameters the model allows."""
    reset = {}
    for selector, how in cfg.train.init_reset.items():
        reset.update(dict.fromkeys(selected(model, selector, "train.init_reset"), how))
    zeroable = getattr(model, "zeroable", None)  # a model that says which of its parameters may start at zero
    stuck = [n for n, how in reset.items() if how == "zero" and zeroable is not None and not n.startswith(zeroable)]
    if stuck:
        raise ConfigError(
            f"train.init_reset: 'zero' on {', '.join(stuck[:4])}{' ...' if len(stuck) > 4 else ''} would leave "
            f"them without a gradient (a zero layer feeding zero output rows: each is the other's factor); zero "
            f"only {', '.join(zeroable)} (e.g. {{{zeroable[0]}: zero}}), or start the others from this run's "
            "initialisation ('fresh')"
        )
    return reset


def load_initial_weights(model: nn.Module, cfg: Config, record: dict) -> dict:
    """Every rank: the source's weights into ``model`` (its fresh initialisation stays where a task is new).
    Returns what was done: parameters loaded, tasks started fresh, tasks dropped."""
    path, where = Path(record["checkpoint"]), f"train.init_from={record['source']}"
    saved = load_checkpoint(path, advice=f"{where} names it: point it at an intact checkpoint (best, or a step's)")
    theirs = saved.get(CONFIG, {}).get("model", {}).get("name")
    if theirs != cfg.model.name:
        raise ConfigError(
            f"{where}: {path} holds a model.name={theirs} model; this run builds model.name={cfg.model.name}. "
            "Fine-tune with the source's architecture (model.name and its settings)"
        )
    if record.get("sha256") and sha256_of(path) != record["sha256"]:
        raise ConfigError(f"{where}: {path} changed since the launcher chose it; re-run the command")
    state, ours = saved[MODEL], model.state_dict()
    source_tasks, our_tasks = set(saved.get(SPECS, {})), set(cfg.tasks)
    new_tasks, dropped = our_tasks - source_tasks, source_tasks - our_tasks
    new_fields, fresh_parts = [], []
    adapt = getattr(model, "adapt_initial_state", None)  # a model whose rows are keyed by the data (field names)
    if adapt is not None:
        source_specs = {name: spec_from_record(record) for name, record in saved.get(SPECS, {}).items()}
        state, new_fields, fresh_parts = adapt(state, source_specs)
    load, fresh, shapes, problems = _matched(state, ours, new_tasks, fresh_parts)
    if problems:
        raise ConfigError(
            f"{where}: the weights do not fit this run's model ({len(problems)} parameter(s)): "
            + "; ".join(problems[:8])
            + (" ..." if len(problems) > 8 else "")
            + ". Match model.* and the tasks' shapes (patch_size, initial_step, strides, channels) to the source"
        )
    unused = [k for k in state if k not in ours and _task_of(k, dropped) is None]
    if unused:
        raise ConfigError(
            f"{where}: the source has parameters this model lacks: {', '.join(unused[:8])}; match model.* to the source"
        )
    reset = _resets(model, cfg)
    load = {key: value for key, value in load.items() if reset.get(key) != "fresh"}
    model.load_state_dict(load, strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if reset.get(name) == "zero":
                p.zero_()
    log.info(
        "initial weights from %s: %d tensors loaded%s%s%s%s%s",
        path,
        len(load),
        f"; kept fresh or zeroed (train.init_reset): {', '.join(cfg.train.init_reset)}" if reset else "",
        f"; fresh heads for {', '.join(sorted(fresh))}" if fresh else "",
        f"; fresh rows for the new field(s) {', '.join(new_fields)}" if new_fields else "",
        f"; fresh projections for the new patch geometry {', '.join(sorted(shapes))}" if shapes else "",
        f"; the source's {', '.join(sorted(dropped))} left out" if dropped else "",
    )
    return {
        **record,
        "loaded": len(load),
        "fresh_tasks": sorted(fresh),
        "dropped_tasks": sorted(dropped),
        "new_fields": new_fields,
        "new_geometries": sorted(shapes),
    }


def freeze(model: nn.Module, prefixes: list[str]) -> int:
    """Keep the parameters that ``prefixes`` select (name prefixes, or groups the model names: train.engine.
    param_groups) fixed; returns how many were frozen."""
    chosen = names_of(model, prefixes, "train.freeze")
    frozen = 0
    for name, p in model.named_parameters():
        if name in chosen:
            p.requires_grad_(False)
            frozen += p.numel()
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"train.freeze={prefixes} freezes every parameter: nothing would be trained")
    if prefixes:
        total = sum(p.numel() for p in model.parameters())
        log.info("train.freeze: %d of %d parameters fixed (%s)", frozen, total, ", ".join(prefixes))
    return frozen
