"""Distributed evaluation: each rank scores its shard of a split, the sums are reduced across ranks.

Autoregressive tasks roll out from their first ``initial_step`` frames to the last frame; the metrics
cover the predicted frames only, in physical units. Baselines: repeating the last input frame
(autoregressive) and the training set's mean field (steady).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from train.data.cache import CacheInfo
from train.data.dataset import training_dataset
from train.data.latent import LatentInfo
from train.dist.env import DistEnv, all_reduce_sum
from train.engine.metrics import error_sums, finish
from train.model.multitask import TaskSpec


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


def _shard(n: int, env: DistEnv, batch_size: int) -> Iterator[np.ndarray]:
    """This rank's samples (rank, rank + world, ...) in batches; shards may differ in size by one."""
    mine = np.arange(env.rank, n, env.world_size)
    for start in range(0, len(mine), batch_size):
        yield mine[start : start + batch_size]


@torch.no_grad()
def rollout(model: nn.Module, task: TaskData, trajectories: torch.Tensor) -> torch.Tensor:
    """Predict frames initial_step..T-1 autoregressively from the first initial_step frames (normalised)."""
    k = task.spec.initial_step
    window = trajectories[:, :k]
    frames = []
    for _ in range(k, trajectories.shape[1]):
        nxt = model({task.name: window})[task.name]
        frames.append(nxt)
        window = torch.cat([window[:, 1:], nxt[:, None]], dim=1)
    return torch.stack(frames, dim=1)


@torch.no_grad()
def evaluate_split(
    model: nn.Module, tasks: list[TaskData], env: DistEnv, split: str, batch_size: int
) -> dict[str, dict[str, float]]:
    """PDEBench nRMSE and RMSE of the model and of the trivial baseline, per task, over all ranks."""
    was_training = model.training
    model.eval()
    results = {}
    for task in tasks:
        sums = torch.zeros(3, dtype=torch.float64)
        base = torch.zeros(3, dtype=torch.float64)
        if task.spec.autoregressive:
            data = task.info.array(split)
            k = task.spec.initial_step
            for idx in _shard(len(data), env, batch_size):
                traj = torch.from_numpy(np.ascontiguousarray(data[idx])).to(env.device)
                target = task.denormalise_target(traj[:, k:])
                pred = task.denormalise_target(rollout(model, task, traj))
                sums += error_sums(pred, target)
                base += error_sums(task.denormalise_target(traj[:, k - 1 : k]).expand_as(target), target)
        else:
            xs, ys = task.info.array(split, "x"), task.info.array(split, "y")
            mean_field = task.denormalise_target(torch.from_numpy(mean_training_target(task.info))).to(env.device)
            for idx in _shard(len(xs), env, batch_size):
                x = torch.from_numpy(xs[idx]).to(env.device)
                target = task.denormalise_target(torch.from_numpy(ys[idx]).to(env.device))[:, None]
                pred = task.denormalise_target(model({task.name: x})[task.name])[:, None]
                sums += error_sums(pred, target)
                base += error_sums(mean_field.expand_as(target), target)
        model_scores = finish(all_reduce_sum(sums))
        base_scores = finish(all_reduce_sum(base))
        results[task.name] = {
            **model_scores,
            "baseline_nrmse": base_scores["nrmse"],
            "baseline_rmse": base_scores["rmse"],
            "n_samples": task.info.sizes[split],
        }
    model.train(was_training)
    return results


def mean_training_target(info: CacheInfo) -> np.ndarray:
    """Mean (normalised) target field over the training split, read in blocks from the memory map."""
    ys = info.array("train", "y")
    total = np.zeros(ys.shape[1:], np.float64)
    for start in range(0, len(ys), 256):
        total += ys[start : start + 256].sum(0, dtype=np.float64)
    return (total / max(1, len(ys))).astype(np.float32)[None]


@torch.no_grad()
def validation_loss(model: nn.Module, tasks: list[TaskData], env: DistEnv, batch_size: int) -> dict[str, float]:
    """One-step MSE (normalised, as in training) on the validation split, per task, over all ranks."""
    was_training = model.training
    model.eval()
    losses = {}
    for task in tasks:
        sums = torch.zeros(2, dtype=torch.float64)
        if task.info.sizes["val"]:
            dataset = training_dataset(task.info, "val", task.spec.initial_step)
            for idx in _shard(len(dataset), env, batch_size):
                batch = dataset.__getitems__(idx.tolist())
                pred = model({task.name: batch["x"].to(env.device)})[task.name]
                err = (pred.double() - batch["y"].to(env.device).double()).square()
                sums += torch.stack([err.mean(tuple(range(1, err.dim()))).sum().cpu(), torch.tensor(len(idx))])
        total, count = all_reduce_sum(sums).tolist()
        losses[task.name] = total / count if count else float("nan")
    model.train(was_training)
    return losses
