"""Local convolutional baselines, one network per task: a plain convolutional emulator and a ResNet.

The input is the ``initial_step`` frames stacked as channels (or the steady input), as the U-Net's; the
prediction is the next frame (or the solution), or with ``residual`` its change from the last frame.

- ``conv`` (:class:`ConvNet`): ``depth`` convolutions of ``width`` channels and ``kernel`` points per axis, each
  followed by the activation, then a pointwise convolution to the output channels. No normalisation: the
  field's plain convolutional emulator (``examples/my_model.py``'s, made a built-in).
- ``resnet`` (:class:`ResNet`): a pointwise lifting to ``width`` channels, ``blocks`` residual blocks (two
  convolutions, the activation after the first and after the sum with the block's input, an optional group norm
  after each convolution, as PDEArena's ResNets) and a pointwise projection to the output channels.

Every convolution keeps the grid's size. It wraps around the axes the data marks periodic (a Well task's
boundary conditions) and pads the others with zeros, axis by axis: a network on a fully periodic grid commutes
with any shift of it. Nothing depends on the data's values, so torch.compile traces either whole.
"""

from __future__ import annotations

import torch
from torch import nn

from train.config import ConvConfig, ResNetConfig
from train.model.specs import TaskSpec

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}


class GridConv(nn.Module):
    """A convolution of an odd ``kernel`` that keeps the grid's size: the periodic axes wrapped around (circular
    padding, by ``F.pad``), the others padded with zeros (by the convolution itself)."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, periodic: tuple[bool, ...]):
        super().__init__()
        half = kernel // 2
        self.conv = CONVS[len(periodic) - 1](
            channels_in, channels_out, kernel, padding=tuple(0 if wraps else half for wraps in periodic)
        )
        # F.pad lists the last axis first, and wants them all in circular mode (0 on the axes the convolution pads).
        self.wrap = [p for wraps in reversed(periodic) for p in ((half, half) if wraps else (0, 0))]
        self.wraps = half > 0 and any(periodic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wraps:
            x = nn.functional.pad(x, self.wrap, mode="circular")
        return self.conv(x)


def _pointwise(channels_in: int, channels_out: int, dims: int) -> nn.Module:
    return CONVS[dims - 1](channels_in, channels_out, 1)


class _Emulator(nn.Module):
    """What both networks share: (batch, [initial_step,] *grid, channels) -> (batch, *grid, out_channels)."""

    name: str

    def __init__(self, spec: TaskSpec, residual: bool):
        super().__init__()
        dims = len(spec.grid)
        if dims not in (1, 2, 3):
            raise ValueError(f"model.name={self.name} handles 1D, 2D and 3D grids, not {dims}D")
        self.spec = spec
        self.residual = residual and spec.autoregressive

    def body(self, h: torch.Tensor) -> torch.Tensor:
        """(batch, in_features, *grid) -> (batch, out_channels, *grid)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = x[:, -1, ..., : self.spec.out_channels] if self.residual else None
        if self.spec.autoregressive:  # (b, k, *grid, c) -> (b, *grid, k * c), frames in order
            x = x.movedim(1, -2).flatten(-2)
        out = self.body(x.movedim(-1, 1)).movedim(1, -1)  # convolutions want channels first
        return out if last is None else last + out


class ConvNet(_Emulator):
    """The plain convolutional emulator of one task."""

    name = "conv"

    def __init__(self, spec: TaskSpec, cfg: ConvConfig):
        super().__init__(spec, cfg.residual)
        layers, channels = [], spec.in_features
        for _ in range(cfg.depth):
            layers += [GridConv(channels, cfg.width, cfg.kernel, spec.periodic), ACTIVATIONS[cfg.activation]()]
            channels = cfg.width
        self.layers = nn.Sequential(*layers)
        self.out = _pointwise(channels, spec.out_channels, len(spec.grid))

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(h))


class Block(nn.Module):
    """A residual block: act(x + norm(conv(act(norm(conv(x))))))."""

    def __init__(self, cfg: ResNetConfig, periodic: tuple[bool, ...]):
        super().__init__()
        norm = (lambda: nn.GroupNorm(1, cfg.width)) if cfg.norm == "group" else nn.Identity
        self.conv1, self.norm1 = GridConv(cfg.width, cfg.width, cfg.kernel, periodic), norm()
        self.conv2, self.norm2 = GridConv(cfg.width, cfg.width, cfg.kernel, periodic), norm()
        self.act = ACTIVATIONS[cfg.activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm1(self.conv1(x)))
        return self.act(x + self.norm2(self.conv2(h)))


class ResNet(_Emulator):
    """The ResNet of one task."""

    name = "resnet"

    def __init__(self, spec: TaskSpec, cfg: ResNetConfig):
        super().__init__(spec, cfg.residual)
        dims = len(spec.grid)
        self.lift = _pointwise(spec.in_features, cfg.width, dims)
        self.blocks = nn.Sequential(*(Block(cfg, spec.periodic) for _ in range(cfg.blocks)))
        self.out = _pointwise(cfg.width, spec.out_channels, dims)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.lift(h)))


def check_specs(section: str):
    """``check(specs, settings)`` of model.name=``section``: a kernel that wraps a periodic axis more than once
    (circular padding takes at most the axis' own points) or a grid of another dimension than 1, 2 or 3."""

    def check(specs: dict[str, TaskSpec], settings: ConvConfig | ResNetConfig) -> list[str]:
        problems = []
        half = settings.kernel // 2
        for name, spec in specs.items():
            if len(spec.grid) not in (1, 2, 3):
                problems.append(
                    f"tasks.{name} has a {len(spec.grid)}D grid {spec.grid}: model.name={section} handles 1D, 2D "
                    "and 3D grids; choose another model"
                )
                continue
            for axis, (n, wraps) in enumerate(zip(spec.grid, spec.periodic, strict=True)):
                if wraps and half > n:
                    problems.append(
                        f"tasks.{name}: model.{section}.kernel={settings.kernel} wraps its periodic axis {axis} of "
                        f"{n} points more than once; set model.{section}.kernel to at most {2 * n + 1}"
                    )
        return problems

    return check
