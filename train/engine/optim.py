"""The optimizer and its learning-rate schedule, built in one place from the train config."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from train.config import TrainConfig


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate factor at each step: linear warm-up over ``warmup`` steps, then a cosine to zero."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter] | list[dict], cfg: TrainConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (fused where the parameters allow) over the trainable ``parameters`` (or optimizer groups, each with
    its own learning rate: train.engine.param_groups) and a warm-up + cosine schedule over ``total_steps`` (the
    warm-up is capped at half of them, so a short run still decays); every group follows the schedule."""
    given = list(parameters)
    groups = given if given and isinstance(given[0], dict) else [{"params": given, "lr": cfg.lr}]
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
    groups = [g for g in groups if g["params"]]
    trained = [p for g in groups for p in g["params"]]
    # The fused kernel: a few launches per step instead of several per parameter, and an update it can be told
    # to skip on the device (train.engine.nonfinite). It takes real floating-point parameters only.
    fused = all(p.is_floating_point() for p in trained)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    schedule = warmup_cosine(min(cfg.warmup_steps, total_steps // 2), total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
