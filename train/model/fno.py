"""Fourier neural operators after PDEBench's FNO1d, FNO2d and FNO3d: one network per task.

Each network lifts the input (the ``initial_step`` frames' channels, or a steady input's, plus the grid
coordinates) to ``width`` channels, applies ``layers`` spectral layers (a convolution that keeps the lowest
``modes`` Fourier modes along each axis, plus a pointwise convolution; GELU between layers), and projects each
point to the output channels through a hidden layer of 128. The prediction is the next frame itself (or the
steady solution), as in PDEBench. Tasks of different dimensions share nothing.

The Fourier transforms run in fp32 whatever autocast asks for: cuFFT has no bf16 transform, and fp16 ones only
for power-of-two sizes.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

from train.config import FNOConfig
from train.model.specs import TaskSpec

PROJECTION_WIDTH = 128


def eager_under_compile(fn):
    """``torch.compiler.disable(fn)``, made at the first call rather than at import: the decorator imports
    dynamo (and sympy), seconds of every process that imports the models (the launcher, each rank) when nothing
    compiles at all."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        disabled = getattr(fn, "_eager_under_compile", None)
        if disabled is None:
            disabled = fn._eager_under_compile = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


class SpectralConv(nn.Module):
    """Multiplies the lowest Fourier modes of each input channel by learned complex weights, per output channel.

    1D: modes 0..m-1 of the real FFT. 2D and 3D: along each axis but the last, the lowest m (positive) or the
    highest m (negative) frequencies, every combination of them a block of weights of its own, each with modes
    0..m_last-1 of the last axis: 2 blocks in 2D, 4 in 3D, as PDEBench's SpectralConv2d_fast and
    SpectralConv3d.
    """

    def __init__(self, width: int, modes: tuple[int, ...]):
        super().__init__()
        self.modes = modes
        # (low or high, ...) along each axis but the last, in PDEBench's order of weights1, weights2, ...
        self.corners = [c[::-1] for c in itertools.product((False, True), repeat=len(modes) - 1)]
        blocks = len(self.corners)
        scale = 1 / (width * width)
        # Complex weights held as (..., 2) real tensors: every optimizer and collective handles real tensors.
        self.weights = nn.Parameter(scale * torch.rand(blocks, width, width, *modes, 2))

    # Runs eagerly under torch.compile (a graph break around it): the compiled backward of complex tensors fails
    # (torch 2.13: "must be 1 to view ComplexFloat as Float"), while the layers around it compile.
    @eager_under_compile
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(2, x.dim()))
        with torch.autocast(x.device.type, enabled=False):
            spectrum = torch.fft.rfftn(x.float(), dim=dims)
            w = torch.view_as_complex(self.weights.float())
            out = torch.zeros_like(spectrum)
            axes = "xyz"[: len(self.modes)]
            for block, corner in enumerate(self.corners):
                index = (
                    slice(None), slice(None),
                    *[slice(-m, None) if high else slice(None, m) for high, m in zip(corner, self.modes, strict=False)],
                    slice(None, self.modes[-1]),
                )  # fmt: skip
                out[index] = torch.einsum(f"bi{axes},io{axes}->bo{axes}", spectrum[index], w[block])
            return torch.fft.irfftn(out, s=x.shape[2:], dim=dims)


class FNO(nn.Module):
    """The network of one task: (batch, [initial_step,] *grid, channels) -> (batch, *grid, out_channels)."""

    def __init__(self, spec: TaskSpec, cfg: FNOConfig):
        super().__init__()
        if len(spec.grid) not in (1, 2, 3):
            raise ValueError(f"model.name=fno handles 1D, 2D and 3D grids, not {len(spec.grid)}D")
        self.spec = spec
        dims = len(spec.grid)
        padding = cfg.padding if cfg.padding is not None else (0 if dims == 1 else 2)
        # A periodic axis is what the FFT assumes already; padding it would break the wrap-around.
        self.pads = [0 if wraps else padding for wraps in spec.periodic]
        self.residual = cfg.residual and spec.autoregressive
        padded = [n + p for n, p in zip(spec.grid, self.pads, strict=True)]
        # Every axis but the last is a full FFT: its positive and negative blocks must not overlap.
        limits = [n // 2 for n in padded[:-1]] + [padded[-1] // 2 + 1]
        modes = tuple(min(cfg.modes, limit) for limit in limits)
        self.lift = nn.Linear(spec.in_features + dims, cfg.width)
        self.spectral = nn.ModuleList(SpectralConv(cfg.width, modes) for _ in range(cfg.layers))
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.pointwise = nn.ModuleList(conv(cfg.width, cfg.width, 1) for _ in range(cfg.layers))
        self.project = nn.Sequential(
            nn.Linear(cfg.width, PROJECTION_WIDTH), nn.GELU(), nn.Linear(PROJECTION_WIDTH, spec.out_channels)
        )

    def _coordinates(self, like: torch.Tensor) -> torch.Tensor:
        """(batch, *grid, dims): each point's position in [0, 1] along each axis."""
        axes = [torch.linspace(0, 1, n, device=like.device, dtype=like.dtype) for n in self.spec.grid]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)
        return grid.expand(like.shape[0], *grid.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = x[:, -1, ..., : self.spec.out_channels] if self.residual else None
        if self.spec.autoregressive:  # (b, k, *grid, c) -> (b, *grid, k * c), frames in order
            x = x.movedim(1, -2).flatten(-2)
        h = self.lift(torch.cat([x, self._coordinates(x)], dim=-1)).movedim(-1, 1)
        if any(self.pads):  # F.pad lists the last axis first
            h = nn.functional.pad(h, [p for pad in reversed(self.pads) for p in (0, pad)])
        for i, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise, strict=True)):
            h = spectral(h) + pointwise(h)
            if i < len(self.spectral) - 1:
                h = nn.functional.gelu(h)
        if any(self.pads):
            h = h[(..., *[slice(0, n) for n in self.spec.grid])]
        out = self.project(h.movedim(1, -1))
        return out if last is None else last + out
