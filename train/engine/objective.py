"""Rollout-aware training objectives for time-dependent tasks (train.objective).

``one_step`` trains the next frame from true frames: cheap, but the model never sees its own errors, so they
compound over a rollout. ``pushforward`` rolls the model out for a drawn number of steps without gradient and
trains the step after from its own predictions: it learns to correct the errors it makes at about one step's
backward cost. ``unrolled`` backpropagates through ``rollout_steps`` predicted frames.

The whole rollout is one forward call of :class:`Unroll`, which DDP wraps: DDP then sees one forward per
backward whatever the number of steps (its buffer broadcast and gradient hooks expect exactly that). The
number of steps drawn comes from the default generator, which the trainer seeds from (seed, rank, epoch,
micro-step) just before, so a resumed run draws the same.
"""

from __future__ import annotations

import torch
from torch import nn

from train.config import TrainConfig
from train.data.dataset import target_frames  # noqa: F401 (the objective's, with the data's windows)


def draw_steps(cfg: TrainConfig) -> tuple[int, int]:
    """(steps rolled out without gradient, steps with gradient) of one micro-batch."""
    if cfg.objective == "pushforward":
        return int(torch.randint(cfg.rollout_steps, ())), 1
    if cfg.objective == "unrolled":
        return 0, cfg.rollout_steps
    return 0, 1


def advance(window: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
    """The input window one step later: its oldest frame dropped, ``frame`` appended (axis 1 is time).

    Channels the model does not predict (a Well task's constant fields and scalars, after the predicted ones)
    are carried over from the window's last frame."""
    frame = frame.to(window.dtype)
    if frame.shape[-1] < window.shape[-1]:
        frame = torch.cat([frame, window[:, -1, ..., frame.shape[-1] :]], dim=-1)
    return torch.cat([window[:, 1:], frame[:, None]], dim=1)


class Unroll(nn.Module):
    """A model rolled out over its autoregressive tasks in one forward call.

    ``forward(inputs, free, grad)`` returns, per task, the ``grad`` frames predicted after ``free`` steps
    without gradient, stacked on axis 1 ``(batch, grad, *grid, channels)``; a steady task's output is its one
    prediction, as the model gives it. The wrapped model's parameters are this module's ``model.*``.
    """

    def __init__(self, model: nn.Module, autoregressive: set[str]):
        super().__init__()
        self.model = model
        self.autoregressive = autoregressive

    def forward(self, inputs: dict[str, torch.Tensor], free: int, grad: int) -> dict[str, torch.Tensor]:
        window = {n: x for n, x in inputs.items() if n in self.autoregressive}
        steady = {n: x for n, x in inputs.items() if n not in self.autoregressive}
        if free and window:
            with torch.no_grad():
                for _ in range(free):
                    preds = self.model(window)
                    window = {n: advance(x, preds[n]) for n, x in window.items()}
        frames: dict[str, list[torch.Tensor]] = {n: [] for n in window}
        out: dict[str, torch.Tensor] = {}
        for step in range(grad):
            preds = self.model({**window, **(steady if step == 0 else {})})
            out.update({n: preds[n] for n in steady if step == 0})
            for n in window:
                frames[n].append(preds[n])
            if step < grad - 1:
                window = {n: advance(x, preds[n]) for n, x in window.items()}
        return {**out, **{n: torch.stack(f, dim=1) for n, f in frames.items()}}


def unrolled_targets(y: torch.Tensor, free: int, grad: int) -> torch.Tensor:
    """The true frames an :class:`Unroll` output of (free, grad) steps is scored against."""
    return y[:, free : free + grad]
