"""The model and the training data of one rank: initial weights, per-task loaders with equal lengths, probes."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader

from train.config import Config
from train.data.dataset import (
    EqualBatchSampler,
    LatentDataset,
    keep_batch,
    steps_for_one_pass,
    target_frames,
    training_dataset,
    worker_seeding,
)
from train.data.device_data import DeviceLoader, DeviceTask, Placement, hold_splits, placement
from train.data.stream.sampler import StreamSampler
from train.disk import human
from train.distributed.env import DistEnv
from train.errors import ConfigError
from train.model.factory import build_model
from train.model.specs import TaskData

log = logging.getLogger(__name__)


def initial_model(cfg: Config, tasks: list[TaskData], device: torch.device) -> nn.Module:
    """The run's model with its initial weights, on ``device``."""
    # The same seed on every rank gives identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.run.seed)
    return build_model({t.name: t.spec for t in tasks}, cfg.model).to(device)


def steps_per_epoch(cfg: Config, tasks: list[TaskData], world_size: int) -> int:
    """Optimizer steps per epoch: train.steps_per_epoch, or one pass over the largest task's training items."""
    if cfg.train.steps_per_epoch is not None:
        return cfg.train.steps_per_epoch
    per_step = cfg.train.accumulate_steps
    return max(
        steps_for_one_pass(
            len(training_dataset(t.info, "train", t.spec.initial_step, target_frames(cfg.train), t.spec.frame_stride)),
            cfg.tasks[t.name].batch_size * per_step,
            world_size,
        )
        for t in tasks
    )


def task_dataset(task: TaskData, horizon: int = 1):
    """A task's training dataset over its cache: items of ``horizon`` target frames (its latent cache's items
    when the model trains on a frozen encoder's latents)."""
    dataset = training_dataset(task.info, "train", task.spec.initial_step, horizon, task.spec.frame_stride)
    return LatentDataset(dataset, task.latent.file) if task.latent is not None else dataset


def training_loaders(
    cfg: Config, env: DistEnv, tasks: list[TaskData], micro_steps: int
) -> tuple[dict[str, DataLoader | DeviceLoader], dict[str, EqualBatchSampler]]:
    """One loader per task, each able to yield ``micro_steps`` batches per epoch on every rank: the data gathered
    on the device (train.data_on_device) or a DataLoader over the cache."""
    datasets = {t.name: task_dataset(t, target_frames(cfg.train)) for t in tasks}
    where = data_placement(cfg, list(datasets.values()), env.device)
    loaders, samplers = {}, {}
    for stream, task in enumerate(tasks):
        dataset = datasets[task.name]
        batch_size = cfg.tasks[task.name].batch_size
        if task.info.stream is not None:
            sampler = stream_sampler(cfg, env, task, len(dataset), micro_steps, stream, fetching=not where.on_device)
        else:
            sampler = EqualBatchSampler(
                len(dataset), batch_size, micro_steps, env.rank, env.world_size, cfg.run.seed, stream
            )
        samplers[task.name] = sampler
        if where.on_device:
            loaders[task.name] = DeviceLoader(DeviceTask(dataset, env.device), sampler, env.device)
            continue
        loaders[task.name] = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=keep_batch,
            num_workers=cfg.train.num_workers,
            worker_init_fn=worker_seeding(cfg.run.seed, env.rank),
            persistent_workers=cfg.train.num_workers > 0,
            pin_memory=env.device.type == "cuda",
        )
    if where.on_device:
        budget = int(cfg.train.data_on_device_share * where.free) - where.nbytes
        held = hold_splits(tasks, env.device, budget)
        log.info("validation and test trajectories held on the device: %s", human(held))
    return loaders, samplers


def stream_sampler(
    cfg: Config, env: DistEnv, task: TaskData, n_items: int, micro_steps: int, stream: int, fetching: bool
) -> StreamSampler:
    """A streamed task's sampler: the streamed order, its shards fetched ahead into the node's cache (not when
    the whole split was gathered on the device: ``fetching`` false)."""
    counts = [r["samples"] for r in task.info.stream["shards"]]
    d = cfg.data
    # Batches the loader's workers may hold before the one being handed out: their shards stay on the node.
    behind = cfg.train.num_workers * 2 + 1
    return StreamSampler(
        task.info.shard_cache(),
        counts,
        n_items // sum(counts),
        cfg.tasks[task.name].batch_size,
        micro_steps,
        env.rank,
        env.world_size,
        cfg.run.seed,
        stream,
        canonical_nodes=d.canonical_nodes,
        block_shards=d.block_shards,
        prefetch_blocks=d.prefetch_blocks,
        behind_batches=behind,
        fetching=fetching,
    )


def data_placement(cfg: Config, datasets: list, device: torch.device) -> Placement:
    """train.data_on_device resolved for this rank, logged once with the bytes; ``true`` that does not fit is an
    error naming the figures."""
    where = placement(cfg.train.data_on_device, cfg.train.data_on_device_share, datasets, device)
    if cfg.train.data_on_device is True and not where.on_device:
        raise ConfigError(
            f"train.data_on_device=true but the training arrays take {human(where.nbytes)}, more than "
            f"train.data_on_device_share={cfg.train.data_on_device_share} of the {human(where.free)} free on "
            f"{device}: set train.data_on_device=auto (the loader then reads them) or raise the share"
        )
    log.info(
        "training data %s: %s of arrays, %s free on %s (%s)",
        "on the device, batches gathered there" if where.on_device else "read through the loader",
        human(where.nbytes),
        human(where.free),
        device,
        where.reason,
    )
    return where


def probe_batches(tasks: list[TaskData], device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """Two training items of each task (one if it has one), on the device: enough to see which parameters a
    task's forward uses (two, because batch normalisation needs more than one value per channel in training)."""
    batches = {}
    for t in tasks:
        dataset = task_dataset(t)
        items = dataset.__getitems__(list(range(min(2, len(dataset)))))
        batches[t.name] = {k: v.to(device) for k, v in items.items()}
    return batches


def predict(
    model: nn.Module, inputs: dict[str, torch.Tensor], latents: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model's predictions by task. Latents (a frozen encoder's tokens, transformer only) are passed only
    when some task has them: every other model takes the inputs alone."""
    return model(inputs, latents) if latents else model(inputs)


def run_on_batches(model: nn.Module, batches: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """A forward pass of ``model`` over ``batches`` reduced to one scalar to differentiate."""
    latents = {n: b["z"] for n, b in batches.items() if "z" in b}
    preds = predict(model, {n: b["x"] for n, b in batches.items()}, latents)
    return sum(p.float().mean() for p in preds.values())
