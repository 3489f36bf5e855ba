"""A model of your own, trained with ``--set model.name=examples/my_model.py:build``.

The contract (docs/models.md, 'Your own model'): ``build(specs, **model.args)`` returns a ``torch.nn.Module`` whose
forward maps a dict of inputs by task name to a dict of predictions by task name, all normalised and channels
last. A time-dependent task gets its ``initial_step`` latest frames, ``(batch, initial_step, *grid, channels)``,
and predicts the next frame, ``(batch, *grid, out_channels)``; a steady task maps ``(batch, *grid, channels)``
to its solution. Everything else (DDP, torch.compile, mixed precision, checkpoints, resume, evaluation by
rollout, the report) is the trainer's.

This one is a small convolutional network per task: the frames are stacked as channels, then ``depth``
convolutions of ``width`` channels with a kernel of ``kernel`` points along each axis.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    def __init__(self, spec, width: int, depth: int, kernel: int):
        super().__init__()
        self.autoregressive = spec.autoregressive
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[len(spec.grid)]
        frames = spec.initial_step if spec.autoregressive else 1
        layers, channels = [], frames * spec.in_channels
        for _ in range(depth):
            layers += [conv(channels, width, kernel, padding="same", padding_mode="circular"), nn.GELU()]
            channels = width
        layers.append(conv(channels, spec.out_channels, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.autoregressive:  # (b, k, *grid, c) -> (b, *grid, k * c)
            x = x.movedim(1, -2).flatten(-2)
        return self.net(x.movedim(-1, 1)).movedim(1, -1)  # convolutions want channels first


class PerTask(nn.Module):
    def __init__(self, nets: dict[str, nn.Module]):
        super().__init__()
        self.nets = nn.ModuleDict(nets)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.nets[name](x) for name, x in inputs.items()}


def build(specs, width: int = 32, depth: int = 3, kernel: int = 5) -> nn.Module:
    """``specs``: {task name: TaskSpec} with grid, in_channels, out_channels, initial_step, autoregressive."""
    return PerTask({name: ConvNet(spec, width, depth, kernel) for name, spec in specs.items()})
