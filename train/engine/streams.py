"""What each micro-step of an epoch trains on: which tasks, which batches, which random seed.

Everything is a pure function of (seed, rank, epoch, micro-step), so a run resumed at any step position
replays exactly the batches, task draws and dropout masks of the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from train.data.dataset import EqualBatchSampler


def draw_probabilities(weights: list[float], sizes: list[int], alpha: float) -> np.ndarray:
    """Each task's probability of being drawn: its sampling_weight x its size (training windows) ^ alpha."""
    p = np.asarray(weights, dtype=np.float64) * np.asarray(sizes, dtype=np.float64) ** alpha
    assert p.sum() > 0, "the config refuses a mix whose every weight is 0"
    return p / p.sum()


def draw_group(strategy: str, rank: int, shard_group_size: int) -> int:
    """Which ranks draw the same tasks: under ddp each rank its own; under fsdp and hsdp the ranks of one shard
    group (they gather each other's weights, so a group trains one source at a time and no rank waits on a
    larger one's step)."""
    return rank if strategy == "ddp" else rank // shard_group_size


def task_draws(seed: int, group: int, epoch: int, micro_steps: int, p: np.ndarray) -> np.ndarray:
    """Index of the task this rank trains at each micro-step of ``epoch`` (task_sampling=weighted), from the
    probabilities ``p``.

    Draw groups draw independently (``group``, :func:`draw_group`, is part of the random seed), so in one step
    they usually train different tasks; each rank still runs exactly ``micro_steps`` micro-steps.
    """
    rng = np.random.default_rng([seed, group, epoch, 0x7A5C])
    return rng.choice(len(p), size=micro_steps, p=p)


def step_seed(seed: int, rank: int, epoch: int, micro_step: int) -> int:
    """The torch seed of one micro-step (dropout and any other randomness in the forward pass)."""
    return int(np.random.SeedSequence([seed, rank, epoch, micro_step]).generate_state(1, np.uint64)[0] >> 1)


class EpochStreams:
    """The per-task batch iterators of one epoch, positioned at micro-step ``start``.

    With ``draws`` (weighted sampling) task ``t`` has consumed ``count(draws[:start] == t)`` batches before
    ``start`` and will consume ``count(draws == t)`` in the whole epoch; without, every task one per micro-step.
    """

    def __init__(
        self,
        loaders: dict[str, DataLoader],
        samplers: dict[str, EqualBatchSampler],
        epoch: int,
        start: int,
        micro_steps: int,
        draws: np.ndarray | None,
    ):
        self.names = list(loaders)
        self.draws = draws
        self.iterators: dict[str, Iterator] = {}
        for index, name in enumerate(self.names):
            if draws is None:
                first, last = start, micro_steps
            else:
                first, last = int(np.sum(draws[:start] == index)), int(np.sum(draws == index))
            samplers[name].set_epoch(epoch, first, last)
            self.iterators[name] = iter(loaders[name])

    def tasks_at(self, micro_step: int) -> list[str]:
        return self.names if self.draws is None else [self.names[int(self.draws[micro_step])]]

    def batches_at(self, micro_step: int) -> dict[str, dict[str, torch.Tensor]]:
        return {name: next(self.iterators[name]) for name in self.tasks_at(micro_step)}
