"""What each micro-step of an epoch trains on: which tasks, which batches, which random seed.

Everything is a pure function of (seed, rank, epoch, micro-step), so a run resumed at any step position
replays exactly the batches, task draws and dropout masks of the uninterrupted run; a run resumed on another
number of ranks continues the epoch's sequence of samples at the same sample (:func:`continue_on_world_size`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from train.checkpoint import RunState
from train.data.dataset import EqualBatchSampler, step_on_world_size
from train.errors import ConfigError

log = logging.getLogger(__name__)


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


def continue_on_world_size(state: RunState, world: int, steps: int, fixed_steps: bool, weighted: bool, path) -> None:
    """``state``, read from checkpoint ``path``, continued on ``world`` ranks. Trained on another number and with
    epochs of one pass over the data (not ``fixed_steps``: train.steps_per_epoch unset), the step within the epoch
    becomes the one that reaches the same sample of the epoch's sequence (every rank takes its slice of one
    sequence: EqualBatchSampler), so that no sample of the epoch is trained twice or skipped; ``steps``: steps
    per epoch on ``world`` ranks."""
    s = state
    if s.world_size in (0, world) or fixed_steps:
        # train.steps_per_epoch makes an epoch a number of steps, whatever the ranks: it goes on by steps
        s.world_size = world
        return
    if weighted:
        raise ConfigError(
            f"{path} was trained on {s.world_size} ranks; with train.task_sampling=weighted each rank draws its "
            f"own tasks, so {world} ranks cannot continue its epoch: resume on {s.world_size} ranks"
        )
    step = step_on_world_size(s.step_in_epoch, s.world_size, world)
    if step is None:
        consumed = s.step_in_epoch * s.world_size
        raise ConfigError(
            f"{path} stopped {s.step_in_epoch} steps into epoch {s.epoch + 1} on {s.world_size} ranks: "
            f"{consumed} batches of the epoch's sequence, not a whole number of steps on {world} ranks. Resume "
            f"on {s.world_size} ranks, or on a number of ranks that divides {consumed}"
        )
    log.info(
        "resuming on %d ranks a run trained on %d: step %d of the epoch becomes step %d (the same sample)",
        world,
        s.world_size,
        s.step_in_epoch,
        step,
    )
    s.step_in_epoch, s.world_size = step, world
    if step >= steps:  # the few samples the new step size drops at the epoch's end
        s.epoch, s.step_in_epoch = s.epoch + 1, 0
