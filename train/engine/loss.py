"""The training objective, one function for training, validation and the bench; and its running mean for
the log, reduced over ranks.

The loss of a task is the mean squared error of its normalised prediction. It is computed in fp32 at least,
whatever dtype autocast produced: the small errors of a good surrogate vanish in bf16.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from train.distributed.collectives import all_reduce_sum


def task_loss(pred: torch.Tensor, target: torch.Tensor, *, per_sample: bool = False) -> torch.Tensor:
    """Mean squared error of one task's batch; ``per_sample``: one value per sample (shape (batch,)), so that
    sums over ranks weigh every sample once."""
    if pred.dtype in (torch.float16, torch.bfloat16):
        pred = pred.float()
    target = target.to(pred.dtype)
    if not per_sample:
        return nn.functional.mse_loss(pred, target)
    return nn.functional.mse_loss(pred, target, reduction="none").flatten(1).mean(1)


NOT_DRAWN, SKIPPED = "not drawn", "skipped"
"""Why a task has no loss in a logging window: no rank drew it (weighted sampling), or every step that trained it
had non-finite gradients and was skipped (train.on_nonfinite=skip)."""


class LossWindow:
    """Per-task loss sums and counts, samples and time since the last log line, summed on the device (moving the
    loss to the CPU every step would stall a GPU). A step whose update was skipped (non-finite gradients) adds no
    loss: it is counted as skipped."""

    def __init__(self, n_tasks: int, device: torch.device):
        self.sums = torch.zeros(n_tasks, device=device)
        self.counts = torch.zeros(n_tasks, device=device)
        self.drawn = torch.zeros(n_tasks, device=device)
        self.skipped = torch.zeros((), device=device)
        self.samples, self.steps, self.excluded = 0, 0, 0.0
        self.start = time.perf_counter()

    def add(self, sums: torch.Tensor, counts: torch.Tensor, samples: int, skipped: torch.Tensor | None = None) -> None:
        """One step's per-task loss sums and counts; ``skipped``: a device bool, true when its update was skipped
        (the same on every rank: the gradients were all-reduced)."""
        self.drawn += counts
        if skipped is None:
            self.sums += sums
            self.counts += counts
        else:
            self.sums += torch.where(skipped, torch.zeros_like(sums), sums)
            self.counts += torch.where(skipped, torch.zeros_like(counts), counts)
            self.skipped += skipped.to(self.skipped.dtype)
        self.samples += samples
        self.steps += 1

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def take(self) -> tuple[list[float | str], dict]:
        """Mean loss per task over all ranks (ranks may train different tasks; :data:`NOT_DRAWN` or
        :data:`SKIPPED` where a task has none), and the throughput figures with the steps skipped."""
        local = torch.cat([self.sums, self.counts, self.drawn]).double().cpu()
        local = torch.cat([local, torch.tensor([float(self.samples)], dtype=torch.float64)])
        reduced = all_reduce_sum(local).tolist()
        n = len(self.sums)
        sums, counts, drawn = reduced[:n], reduced[n : 2 * n], reduced[2 * n : 3 * n]
        mean = [s / c if c else (SKIPPED if d else NOT_DRAWN) for s, c, d in zip(sums, counts, drawn, strict=True)]
        elapsed = max(1e-9, time.perf_counter() - self.start - self.excluded)
        record = {"samples_per_s": reduced[-1] / elapsed, "step_time_s": elapsed / max(1, self.steps)}
        skipped = int(self.skipped.item())
        if skipped:
            record["skipped_steps"] = skipped
        for t in (self.sums, self.counts, self.drawn, self.skipped):
            t.zero_()
        self.samples, self.steps, self.excluded = 0, 0, 0.0
        self.start = time.perf_counter()
        return mean, record
