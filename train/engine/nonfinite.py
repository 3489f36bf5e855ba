"""Steps with non-finite gradients: skipped on the device at once, judged on the host at the next boundary.

Reading the gradient norm back at every step would make the host wait for the GPU at every step. Instead the
decision stays on the device: the optimizer is told to skip the update (the fused AdamW's ``found_inf``, as
fp16's loss scaler does it), and each step's flag and loss sums are kept as device tensors. At a logging,
validation or checkpoint boundary the flags are read in one transfer and judged step by step, as if each had
been read at once: a warning per skipped step, and the error once on_nonfinite=stop, or more than
max_skipped_steps in a row, says so. Every rank holds the same all-reduced gradients, so every rank takes the
same decisions at the same boundary; no checkpoint is written before the flags behind it are judged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from train.distributed.collectives import all_reduce_sum
from train.errors import ConfigError

log = logging.getLogger(__name__)

MAX_PENDING = 1000
"""Steps judged at the latest this many steps after they ran, even with no boundary between (equal on all ranks)."""


class NonFiniteSteps:
    """The flags of the steps not judged yet, and the count of skipped steps in a row so far."""

    def __init__(self, names: list[str], stop: bool, max_skipped: int, last_good: Callable[[], object]):
        """``last_good``: the newest checkpoint, named in the error."""
        self.names, self.stop, self.max_skipped, self.last_good = names, stop, max_skipped, last_good
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.in_row = 0

    def record(self, step: int, bad: torch.Tensor, loss_sums: torch.Tensor) -> None:
        """Step ``step`` (1-based global step) had non-finite gradients where ``bad`` (a device bool) is true."""
        self.pending.append((step, torch.cat([bad.reshape(1).to(loss_sums.dtype), loss_sums.detach()])))
        if len(self.pending) >= MAX_PENDING:
            self.settle()

    def settle(self) -> None:
        """Judge the pending steps (one device-to-host transfer); raise a ConfigError naming the first step that
        may not be skipped."""
        if not self.pending:
            return
        steps = [step for step, _ in self.pending]
        values = torch.stack([v for _, v in self.pending]).tolist()
        self.pending.clear()
        for step, (bad, *losses) in zip(steps, values, strict=True):
            if not bad:
                self.in_row = 0
                continue
            self.in_row += 1
            if not self.stop and self.in_row <= self.max_skipped:
                log.warning("step %d: non-finite gradients, update skipped (%d in a row)", step, self.in_row)
                continue
            self.pending.clear()
            raise self._diverged(step, losses, self.last_good())

    def _diverged(self, step: int, losses: list[float], last_good: object) -> ConfigError:
        # Ranks may have trained different tasks in the step: the sums over ranks say which losses were bad.
        reduced = all_reduce_sum(torch.tensor(losses, dtype=torch.float64)).tolist()
        bad = [n for n, v in zip(self.names, reduced, strict=True) if not math.isfinite(v)]
        return ConfigError(
            f"training diverged: non-finite gradients at step {step}"
            f"{f' ({self.in_row} steps in a row)' if not self.stop else ''}; non-finite loss in: "
            f"{', '.join(bad) or 'none (the gradients overflowed)'}. The last good checkpoint is "
            f"{last_good or 'not written yet'}. Lower train.lr, set train.grad_clip, use train.precision=bf16 or "
            "fp32, or train.on_nonfinite=skip to drop such steps."
        )


def skip_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can be told on the device to skip an update (fused Adam/AdamW/SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
