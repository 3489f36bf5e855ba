"""The training loop of one rank: DDP over a multi-task model, equal steps on every rank, atomic checkpoints."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from train.config import Config
from train.data.dataset import (
    EqualBatchSampler,
    LatentDataset,
    keep_batch,
    steps_for_one_pass,
    training_dataset,
    worker_seeding,
)
from train.dist.env import DistEnv, all_reduce_sum
from train.engine.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from train.engine.evaluate import TaskData, validation_loss
from train.errors import ConfigError
from train.model.multitask import MultiTaskSurrogate
from train.obs.log import MetricsWriter

log = logging.getLogger(__name__)


def build_model(cfg: Config, tasks: list[TaskData], device: torch.device) -> MultiTaskSurrogate:
    # The same seed on every rank gives identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.run.seed)
    return MultiTaskSurrogate({t.name: t.spec for t in tasks}, cfg.model).to(device)


def steps_per_epoch(cfg: Config, tasks: list[TaskData], world_size: int) -> int:
    if cfg.train.steps_per_epoch is not None:
        return cfg.train.steps_per_epoch
    return max(
        steps_for_one_pass(
            len(training_dataset(t.info, "train", t.spec.initial_step)), cfg.tasks[t.name].batch_size, world_size
        )
        for t in tasks
    )


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def compile_model(model: nn.Module, cfg: Config, env: DistEnv) -> nn.Module:
    enabled = cfg.train.compile if cfg.train.compile != "auto" else env.device.type == "cuda"
    if not enabled:
        return model
    mode = cfg.train.compile_mode
    if mode == "reduce-overhead" and env.world_size > 1:
        # CUDA graphs replay fixed memory and skip DDP's gradient hooks: gradients would not be synchronised.
        log.warning("train.compile_mode=reduce-overhead uses CUDA graphs, which break DDP; using 'default'")
        mode = "default"
    log.info("torch.compile(mode=%s)", mode)
    return torch.compile(model, mode=mode)


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, tasks: list[TaskData], run_dir: Path):
        self.cfg, self.env, self.tasks, self.run_dir = cfg, env, tasks, run_dir
        self.model = build_model(cfg, tasks, env.device)
        for task in tasks:
            if task.latent is not None:  # before DDP, which then leaves the frozen encoder out of its buckets
                self.model.freeze_encoder(task.name, task.latent.encoder_state())
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[env.local_rank] if env.device.type == "cuda" else None
        )
        self.forward = compile_model(self.ddp, cfg, env)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
        )
        self.steps = steps_per_epoch(cfg, tasks, env.world_size)
        total = self.steps * cfg.train.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(min(cfg.train.warmup_steps, total // 2), total)
        )
        self.samplers, self.loaders = {}, {}
        for stream, task in enumerate(tasks):
            dataset = training_dataset(task.info, "train", task.spec.initial_step)
            if task.latent is not None:
                dataset = LatentDataset(dataset, task.latent.file)
            sampler = EqualBatchSampler(
                len(dataset),
                cfg.tasks[task.name].batch_size,
                self.steps,
                env.rank,
                env.world_size,
                cfg.run.seed,
                stream,
            )
            self.samplers[task.name] = sampler
            self.loaders[task.name] = DataLoader(
                dataset,
                batch_sampler=sampler,
                collate_fn=keep_batch,
                num_workers=cfg.train.num_workers,
                worker_init_fn=worker_seeding(cfg.run.seed, env.rank),
                persistent_workers=cfg.train.num_workers > 0,
                pin_memory=env.device.type == "cuda",
            )
        self.weights = {t.name: cfg.tasks[t.name].loss_weight for t in tasks}
        self.epoch = 0
        self.global_step = 0
        self.checkpoints = run_dir / "checkpoints"

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "progress": {"epoch": self.epoch, "global_step": self.global_step},
            "config": self.cfg.model_dump(mode="json"),
            "specs": {t.name: t.spec.as_dict() for t in self.tasks},
        }

    def resume(self) -> None:
        path = latest_checkpoint(self.checkpoints)
        if path is None:
            return
        state = load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.epoch = state["progress"]["epoch"]
        self.global_step = state["progress"]["global_step"]
        log.info("resumed from %s (epoch %d, step %d)", path, self.epoch, self.global_step)

    def _agree_finite(self, losses: torch.Tensor) -> torch.Tensor:
        """Mean losses over ranks; every rank sees the same values, so all take the same branch on NaN."""
        reduced = all_reduce_sum(losses.detach().double().cpu()) / self.env.world_size
        if not torch.isfinite(reduced).all():
            bad = [t.name for t, v in zip(self.tasks, reduced, strict=True) if not math.isfinite(v)]
            raise ConfigError(
                f"training loss became NaN/Inf at step {self.global_step} (tasks: {', '.join(bad)}); the last "
                f"good checkpoint is kept in {self.checkpoints}. Lower train.lr or set train.grad_clip."
            )
        return reduced

    def fit(self, metrics: MetricsWriter) -> None:
        self.resume()
        cfg, env = self.cfg, self.env
        if self.epoch >= cfg.train.epochs:
            log.info("training already complete (%d epochs)", self.epoch)
            return
        log.info(
            "training %d epoch(s) x %d steps on %d rank(s), tasks: %s",
            cfg.train.epochs - self.epoch,
            self.steps,
            env.world_size,
            ", ".join(t.name for t in self.tasks),
        )
        self.model.train()
        while self.epoch < cfg.train.epochs:
            for sampler in self.samplers.values():
                sampler.set_epoch(self.epoch)
            window_start, window_samples, window_steps = time.perf_counter(), 0, 0
            # Summed on the device: moving the loss to the CPU every step would stall the GPU.
            running = torch.zeros(len(self.tasks), dtype=torch.float32, device=env.device)
            for i, batches in enumerate(zip(*self.loaders.values(), strict=True)):
                inputs = {
                    t.name: b["x"].to(env.device, non_blocking=True) for t, b in zip(self.tasks, batches, strict=True)
                }
                targets = {
                    t.name: b["y"].to(env.device, non_blocking=True) for t, b in zip(self.tasks, batches, strict=True)
                }
                latents = {
                    t.name: b["z"].to(env.device, non_blocking=True)
                    for t, b in zip(self.tasks, batches, strict=True)
                    if "z" in b
                }
                preds = self.forward(inputs, latents or None)
                losses = torch.stack([nn.functional.mse_loss(preds[t.name], targets[t.name]) for t in self.tasks])
                loss = sum(self.weights[t.name] * losses[j] for j, t in enumerate(self.tasks))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.train.grad_clip > 0:
                    nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)
                self.optimizer.step()
                self.scheduler.step()
                self.global_step += 1
                running += losses.detach()
                window_steps += 1
                window_samples += sum(len(b["x"]) for b in batches) * env.world_size
                if self.global_step % cfg.train.log_every == 0 or i == self.steps - 1:
                    mean = self._agree_finite(running / window_steps)
                    elapsed = time.perf_counter() - window_start
                    record = {
                        "step": self.global_step,
                        "epoch": self.epoch + (i + 1) / self.steps,
                        "loss": float(sum(self.weights[t.name] * mean[j] for j, t in enumerate(self.tasks))),
                        **{f"loss/{t.name}": float(mean[j]) for j, t in enumerate(self.tasks)},
                        "lr": self.scheduler.get_last_lr()[0],
                        "samples_per_s": window_samples / elapsed,
                    }
                    metrics.write(record)
                    log.info(
                        "epoch %d step %d/%d loss %.4g (%s) %.0f samples/s",
                        self.epoch + 1,
                        i + 1,
                        self.steps,
                        record["loss"],
                        ", ".join(f"{t.name} {mean[j]:.3g}" for j, t in enumerate(self.tasks)),
                        record["samples_per_s"],
                    )
                    running.zero_()
                    window_start, window_samples, window_steps = time.perf_counter(), 0, 0
            self.epoch += 1
            val = validation_loss(self.model, self.tasks, env, cfg.train.eval_batch_size)
            metrics.write({"step": self.global_step, "epoch": self.epoch, **{f"val/{k}": v for k, v in val.items()}})
            log.info("epoch %d validation: %s", self.epoch, ", ".join(f"{k} {v:.4g}" for k, v in val.items()))
            if env.is_main:
                save_checkpoint(self.checkpoints, self.epoch, self.state(), cfg.train.keep_checkpoints)
            dist.barrier()  # no rank starts the next epoch (or exits) before the checkpoint is on disk
