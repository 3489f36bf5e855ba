"""Distributed evaluation: each rank scores its shard of a split, the sums are reduced across ranks.

Autoregressive tasks roll out from their first ``initial_step`` frames to the last frame; the metrics
(every PDEBench metric, train/engine/metrics.py) cover the predicted frames only, in physical units.
Baselines: repeating the last input frame (autoregressive) and the training set's mean field (steady).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from train.data.cache.info import CacheInfo
from train.data.dataset import training_dataset
from train.data.formats import format_of
from train.distributed.collectives import all_reduce_sum
from train.distributed.env import DistEnv
from train.engine.loss import task_loss
from train.engine.metrics import ErrorSums, at_horizons, error_sums, field_scores, finish, nrmse_by_step
from train.engine.objective import advance
from train.engine.well_metrics import WellSums
from train.errors import DataError
from train.model.specs import TaskData
from train.obs.report import headline


def output_names(spec) -> list[str]:
    """The names of a task's predicted channels: its fields' (after the inputs of a steady task), else their
    positions."""
    first = 0 if spec.autoregressive else spec.in_channels
    names = list(spec.fields[first : first + spec.out_channels])
    return names if len(names) == spec.out_channels else [f"channel_{i}" for i in range(spec.out_channels)]


def _shard(n: int, env: DistEnv, batch_size: int) -> Iterator[np.ndarray]:
    """This rank's samples (rank, rank + world, ...) in batches; shards may differ in size by one."""
    mine = np.arange(env.rank, n, env.world_size)
    for start in range(0, len(mine), batch_size):
        yield mine[start : start + batch_size]


@torch.no_grad()
def rollout(model: nn.Module, task: TaskData, trajectories: torch.Tensor, steps: int | None = None) -> torch.Tensor:
    """Predict frames initial_step..T-1 (or the next ``steps``) autoregressively from the first initial_step
    frames (normalised; constant channels ride along in the window, the predictions hold the others)."""
    k = task.spec.initial_step
    window = trajectories[:, :k]
    frames = []
    for _ in range(trajectories.shape[1] - k if steps is None else steps):
        nxt = model({task.name: window})[task.name]
        frames.append(nxt)
        window = advance(window, nxt)
    return torch.stack(frames, dim=1)


@torch.no_grad()
def well_windows(model: nn.Module, task: TaskData, env: DistEnv, split: str, batch_size: int) -> dict:
    """The Well's windowed ("one-step") scores: from every window of ``initial_step`` frames, the next
    ``window_outputs`` frames predicted; the model's and the repeat-last-frame baseline's, over all ranks."""
    c, steps = task.spec.out_channels, task.window_outputs
    sums, base = WellSums.zeros(steps, c), WellSums.zeros(steps, c)
    if task.info.sizes[split]:
        windows = training_dataset(task.info, split, task.spec.initial_step, steps, task.spec.frame_stride)
        for idx in _shard(len(windows), env, batch_size):
            batch = windows.__getitems__(idx.tolist())
            x, y = batch["x"].to(env.device), batch["y"].to(env.device)
            y = y[:, None] if steps == 1 else y
            target = task.denormalise_target(y)
            sums.add(task.denormalise_target(rollout(model, task, x, steps)), target)
            base.add(task.denormalise_target(x[:, -1:, ..., :c]).expand_as(target), target)
    names = list(task.info.channels[:c])
    return {"one_step": sums.all_reduce().scores(names), "baseline_one_step": base.all_reduce().scores(names)}


@torch.no_grad()
def evaluate_split(
    model: nn.Module, tasks: list[TaskData], env: DistEnv, split: str, batch_size: int
) -> dict[str, dict[str, float]]:
    """Every PDEBench metric (metrics.KEYS) of the model and, as ``baseline_<metric>``, of the trivial
    baseline, plus ``n_samples`` and ``nrmse_by_step`` (and the baseline's: the nRMSE of each predicted step),
    per task, over all ranks (the same numbers on every rank)."""
    was_training = model.training
    model.eval()
    results = {}
    for task in tasks:
        well = "well" in format_of(task.info.pde).metrics
        if task.spec.autoregressive:
            n, k, c = task.info.sizes[split], task.spec.initial_step, task.spec.out_channels
            frames = len(range(0, task.info.frames(split), task.spec.frame_stride))  # to the split's own end
            sums = base = ErrorSums.zeros(frames - k, task.spec.grid, c)
            well_sums = WellSums.zeros(frames - k, c)
            for idx in _shard(n, env, batch_size):
                traj = task.trajectories(split, idx).to(env.device)
                target = task.denormalise_target(traj[:, k:, ..., :c])
                pred = task.denormalise_target(rollout(model, task, traj))
                sums += error_sums(pred, target)
                base += error_sums(task.denormalise_target(traj[:, k - 1 : k, ..., :c]).expand_as(target), target)
                if well:
                    well_sums.add(pred, target)
        else:
            xs, ys = task.info.array(split, "x"), task.info.array(split, "y")
            sums = base = ErrorSums.zeros(1, tuple(ys.shape[1:-1]), ys.shape[-1])
            mean_field = task.denormalise_target(torch.from_numpy(mean_training_target(task.info))).to(env.device)
            for idx in _shard(len(xs), env, batch_size):
                x = torch.from_numpy(xs[idx]).to(env.device)
                target = task.denormalise_target(torch.from_numpy(ys[idx]).to(env.device))[:, None]
                pred = task.denormalise_target(model({task.name: x})[task.name])[:, None]
                sums += error_sums(pred, target)
                base += error_sums(mean_field.expand_as(target), target)
        sums, base = sums.all_reduce(), base.all_reduce()
        model_scores, base_scores = finish(sums), finish(base)
        fields, base_fields = field_scores(sums, output_names(task.spec)), field_scores(base, output_names(task.spec))
        results[task.name] = {
            **model_scores,
            **{f"baseline_{key}": value for key, value in base_scores.items()},
            "nrmse_dynamic": fields.pop("nrmse_dynamic"),
            "baseline_nrmse_dynamic": base_fields.pop("nrmse_dynamic"),
            **fields,
            "baseline_nrmse_by_field": base_fields["nrmse_by_field"],
            "n_samples": task.info.sizes[split],
            "nrmse_by_step": nrmse_by_step(sums),
            "nrmse_at_step": at_horizons(nrmse_by_step(sums)),
            "baseline_nrmse_by_step": nrmse_by_step(base),
        }
        if well:
            rollout_scores = well_sums.all_reduce().scores(list(task.info.channels[: task.spec.out_channels]))
            results[task.name]["well"] = {
                **well_windows(model, task, env, split, batch_size),
                "rollout": rollout_scores,
                "statistics": task.info.statistics,
            }
    model.train(was_training)
    return results


@torch.no_grad()
def example_prediction(model: nn.Module, task: TaskData, split: str = "test") -> dict[str, np.ndarray]:
    """Sample 0 of ``split`` in physical units, for the report's plots: "true" and "pred", plus "input" for
    steady tasks. Shapes: (predicted frames, *space, channel) for autoregressive tasks, (*space, channel)
    for steady ones. Runs the bare model where its parameters are, with no collectives (rank 0 only)."""
    if not task.info.sizes[split]:
        raise DataError(
            f"task {task.name}: the {split} split is empty, so there is no example to plot; give it samples "
            f"(tasks.{task.name}.test_fraction or val_fraction) or leave the task out of the report's examples"
        )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        if task.spec.autoregressive:
            traj = task.trajectories(split, np.arange(1)).to(device)
            out = {
                "true": task.denormalise_target(traj[:, task.spec.initial_step :, ..., : task.spec.out_channels]),
                "pred": task.denormalise_target(rollout(model, task, traj)),
            }
        else:
            x = torch.from_numpy(np.array(task.info.array(split, "x")[:1])).to(device)
            y = torch.from_numpy(np.array(task.info.array(split, "y")[:1])).to(device)
            mean = torch.tensor(task.info.input_mean, dtype=x.dtype, device=device)
            std = torch.tensor(task.info.input_std, dtype=x.dtype, device=device)
            out = {
                "input": x * std + mean,
                "true": task.denormalise_target(y),
                "pred": task.denormalise_target(model({task.name: x})[task.name]),
            }
    finally:
        model.train(was_training)
    return {key: value[0].float().cpu().numpy() for key, value in out.items()}


def mean_training_target(info: CacheInfo) -> np.ndarray:
    """Mean (normalised) target field over the training split, read in blocks from the memory map."""
    ys = info.array("train", "y")
    total = np.zeros(ys.shape[1:], np.float64)
    for start in range(0, len(ys), 256):
        total += ys[start : start + 256].sum(0, dtype=np.float64)
    return (total / max(1, len(ys))).astype(np.float32)[None]


@torch.no_grad()
def validation_loss(model: nn.Module, tasks: list[TaskData], env: DistEnv, batch_size: int) -> dict[str, float]:
    """The training loss (one step, normalised) on the validation split, per task, over all ranks."""
    was_training = model.training
    model.eval()
    losses = {}
    for task in tasks:
        sums = torch.zeros(2, dtype=torch.float64)
        if task.info.sizes["val"]:
            dataset = training_dataset(task.info, "val", task.spec.initial_step, stride=task.spec.frame_stride)
            for idx in _shard(len(dataset), env, batch_size):
                batch = dataset.__getitems__(idx.tolist())
                pred = model({task.name: batch["x"].to(env.device)})[task.name]
                per_sample = task_loss(pred.double(), batch["y"].to(env.device), per_sample=True)
                sums += torch.stack([per_sample.sum().cpu(), torch.tensor(len(idx))])
        total, count = all_reduce_sum(sums).tolist()
        losses[task.name] = total / count if count else float("nan")
    model.train(was_training)
    return losses


def validation_scores(
    model: nn.Module, tasks: list[TaskData], env: DistEnv, batch_size: int, weights: dict[str, float], metric: str
) -> tuple[dict[str, float], float]:
    """The val split's scores as a metrics record, and the one that decides best.pt and early stopping.

    The record holds ``val/<task>`` and ``val/loss`` (the one-step loss, summed with the tasks' weights) and,
    with ``metric`` rollout_nrmse, ``val_nrmse/<task>`` and ``val_nrmse`` (the rollout's headline nRMSE, over the
    fields that change, and their weighted mean), which is then the score; with ``metric`` loss, ``val/loss`` is."""
    losses = validation_loss(model, tasks, env, batch_size)
    record = {**{f"val/{n}": v for n, v in losses.items()}, "val/loss": sum(weights[n] * v for n, v in losses.items())}
    if metric == "loss":
        return record, record["val/loss"]
    # the headline: a field constant over a trajectory, scored by its own tiny size, must not choose best.pt
    nrmse = {name: headline(r) for name, r in evaluate_split(model, tasks, env, "val", batch_size).items()}
    nrmse = {name: float("nan") if v is None else v for name, v in nrmse.items()}
    record.update({f"val_nrmse/{n}": v for n, v in nrmse.items()})
    record["val_nrmse"] = sum(weights[n] * v for n, v in nrmse.items()) / sum(weights[n] for n in nrmse)
    return record, record["val_nrmse"]
