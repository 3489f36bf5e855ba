"""U-Nets after PDEBench's UNet1d, UNet2d and UNet3d: one network per task.

Four levels down and four up: each level two convolutions of kernel 3, each followed by batch normalisation
and tanh; max pooling by 2 on the way down, transposed convolutions on the way up, with the encoder's features
of the same level concatenated before each decoder block; a 1x1 convolution to the output channels. The
first level has ``init_features`` channels, doubled at each level down. The input is the ``initial_step``
frames stacked as channels (or the steady input); the prediction is the next frame (or the solution).

The four poolings need each axis to be a multiple of 16: a grid that is not is zero-padded at its end to the
next multiple and the prediction cropped back (PDEBench's grids need no padding). The convolutions pad by zeros,
except along axes the data marks periodic (a Well task's boundary conditions), which they wrap around.
"""

from __future__ import annotations

import torch
from torch import nn

from train.config import UNetConfig
from train.model.specs import TaskSpec

LEVELS = 4
MULTIPLE = 2**LEVELS


def _wrapping(conv: type[nn.Module], periodic: tuple[bool, ...]) -> type[nn.Module]:
    """``conv`` with its one-point padding wrapped around on the periodic axes and zero on the others (the
    same parameters, so checkpoints are the same whatever the boundaries)."""
    if not any(periodic):
        return conv

    class WrappingConv(conv):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "padding": 0})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for axis, wraps in enumerate(periodic):  # F.pad lists the last axis first, and wants them all
                pad = [0, 0] * len(periodic)
                pad[2 * (len(periodic) - 1 - axis) : 2 * (len(periodic) - axis)] = [1, 1]
                x = nn.functional.pad(x, pad, mode="circular" if wraps else "constant")
            return super().forward(x)

    return WrappingConv


def _block(conv, norm, channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        conv(channels_in, channels_out, 3, padding=1, bias=False),
        norm(channels_out),
        nn.Tanh(),
        conv(channels_out, channels_out, 3, padding=1, bias=False),
        norm(channels_out),
        nn.Tanh(),
    )


class UNet(nn.Module):
    """The network of one task: (batch, [initial_step,] *grid, channels) -> (batch, *grid, out_channels)."""

    def __init__(self, spec: TaskSpec, cfg: UNetConfig):
        super().__init__()
        dims = len(spec.grid)
        if dims not in (1, 2, 3):
            raise ValueError(f"model.name=unet handles 1D, 2D and 3D grids, not {dims}D")
        self.spec = spec
        conv, norm = (
            (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1],
            (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 1],
        )
        wrapping = _wrapping(conv, spec.periodic)
        self.residual = cfg.residual and spec.autoregressive
        up = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[dims - 1]
        pool = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[dims - 1]
        widths = [cfg.init_features * 2**level for level in range(LEVELS + 1)]
        self.encoders = nn.ModuleList()
        channels = spec.in_features
        for width in widths[:-1]:
            self.encoders.append(_block(wrapping, norm, channels, width))
            channels = width
        self.pool = pool(2, 2)
        self.bottleneck = _block(wrapping, norm, widths[-2], widths[-1])
        self.ups = nn.ModuleList(up(widths[i + 1], widths[i], 2, stride=2) for i in reversed(range(LEVELS)))
        self.decoders = nn.ModuleList(_block(wrapping, norm, 2 * widths[i], widths[i]) for i in reversed(range(LEVELS)))
        self.out = conv(widths[0], spec.out_channels, 1)
        self.padding = [-n % MULTIPLE for n in spec.grid]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = x[:, -1, ..., : self.spec.out_channels] if self.residual else None
        if self.spec.autoregressive:  # (b, k, *grid, c) -> (b, *grid, k * c), frames in order
            x = x.movedim(1, -2).flatten(-2)
        h = x.movedim(-1, 1)
        if any(self.padding):
            h = nn.functional.pad(h, [p for pad in reversed(self.padding) for p in (0, pad)])
        skips = []
        for encoder in self.encoders:
            h = encoder(h)
            skips.append(h)
            h = self.pool(h)
        h = self.bottleneck(h)
        for up, decoder, skip in zip(self.ups, self.decoders, reversed(skips), strict=True):
            h = decoder(torch.cat([up(h), skip], dim=1))
        h = self.out(h)
        if any(self.padding):
            h = h[(..., *[slice(0, n) for n in self.spec.grid])]
        out = h.movedim(1, -1)
        return out if last is None else last + out
