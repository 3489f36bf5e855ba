"""Fourier neural operators after PDEBench's FNO1d, FNO2d and FNO3d: one network per task.

Each network lifts the input (the ``initial_step`` frames' channels, or a steady input's, plus the grid
coordinates) to ``width`` channels, applies ``layers`` spectral layers (a convolution that keeps the lowest
``modes`` Fourier modes along each axis, plus a pointwise convolution; GELU between layers), and projects each
point to the output channels through a hidden layer of 128. The prediction is the next frame itself (or the
steady solution), as in PDEBench. Tasks of different dimensions share nothing.

The spectral layers keep the lowest modes only and compute their transforms as truncated DFTs (matrix products),
in fp32 whatever autocast asks for: the whole network is plain tensor arithmetic, which torch.compile traces as
one graph and ONNX exports as it is.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from train.config import FNOConfig
from train.model.specs import TaskSpec

PROJECTION_WIDTH = 128


def _angles(kept: list[int], n: int) -> torch.Tensor:
    """2 pi k j / N for each kept frequency k (rows) and grid point j (columns), k j reduced mod N exactly (in
    float64: a float32 angle of a large k j loses its low digits)."""
    k = torch.tensor(kept, dtype=torch.float64, device="cpu")[:, None]
    j = torch.arange(n, dtype=torch.float64, device="cpu")[None]
    return 2 * math.pi * torch.remainder(k * j, n) / n


def dft_bases(modes: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    """Per axis, the truncated DFT of the kept frequencies as float32 matrices: (forward cos, forward sin,
    inverse cos, inverse sin), the forward ones (kept, n), the inverse ones (n, kept). Kept: the lowest m and the
    highest m of every axis but the last, the lowest m of the last, where the inverse folds a half spectrum as
    irfft does (each frequency counts twice, but the mean and, for an even n, the Nyquist frequency). Computed on
    the CPU whatever the default device (see train.model.builtin.parameter_count)."""
    kept = [[*range(m), *range(n - m, n)] for m, n in zip(modes[:-1], sizes[:-1], strict=True)]
    kept.append(list(range(modes[-1])))
    bases = []
    for axis, (k, n) in enumerate(zip(kept, sizes, strict=True)):
        theta = _angles(k, n)
        if axis < len(sizes) - 1:
            scale = torch.full((len(k),), 1.0 / n, dtype=torch.float64, device="cpu")
        else:
            doubled = [1.0 if f == 0 or 2 * f == n else 2.0 for f in k]
            scale = torch.tensor(doubled, dtype=torch.float64, device="cpu") / n
        cos, sin = torch.cos(theta), torch.sin(theta)
        inverse = ((cos * scale[:, None]).T, (sin * scale[:, None]).T)
        bases.append(tuple(t.float().contiguous() for t in (cos, sin, *inverse)))
    return bases


def _along(x: torch.Tensor, matrix: torch.Tensor, dim: int) -> torch.Tensor:
    """``matrix`` (out, in) applied along ``dim`` of ``x``."""
    return torch.matmul(x.movedim(dim, -1), matrix.t()).movedim(-1, dim)


def _pointwise(conv: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The 1x1 convolution. Traced, as the matrix product it is (its weights as they are held): oneDNN's compiled
    convolution of a small model's few channels cost several times the product, its backward most. Eagerly, the
    convolution itself (the product's channels-last result slowed the FFTs after it)."""
    if not torch.compiler.is_compiling():
        return conv(h)
    out = torch.matmul(h.movedim(1, -1), conv.weight.flatten(1).t()) + conv.bias
    return out.movedim(-1, 1)


class SpectralConv(nn.Module):
    """Multiplies the lowest Fourier modes of each input channel by learned complex weights, per output channel.

    1D: modes 0..m-1 of the real FFT. 2D and 3D: along each axis but the last, the lowest m (positive) or the
    highest m (negative) frequencies, every combination of them a block of weights of its own, each with modes
    0..m_last-1 of the last axis: 2 blocks in 2D, 4 in 3D, as PDEBench's SpectralConv2d_fast and
    SpectralConv3d.

    Traced (torch.compile, TorchScript, ONNX), it computes in real arithmetic. Only the kept modes matter, so the
    transforms are a truncated DFT along each axis (matrix products with the kept frequencies' cosines and sines)
    and the complex weights are their real and imaginary parts: ``irfftn(W * rfftn(x))`` to float32 rounding, at
    O(n * modes) per axis. Being matrix products only, it is traced whole by torch.compile, forward and backward
    (inductor generates no code for complex tensors, and a complex layer's compiled backward failed on torch
    2.13), and exported as it is (ONNX has no complex tensors). Eagerly it runs the FFT, which costs less on a 2D
    grid. Either way the transforms run in fp32 under autocast (cuFFT has no bf16 transform). ``sizes``: the grid
    the layer is built for (the FNO's padded grid), whose DFT matrices it keeps; another size gets its matrices
    computed at the call.
    """

    def __init__(self, width: int, modes: tuple[int, ...], sizes: tuple[int, ...] | None = None):
        super().__init__()
        self.modes = tuple(modes)
        # (low or high, ...) along each axis but the last, in PDEBench's order of weights1, weights2, ...
        self.corners = [c[::-1] for c in itertools.product((False, True), repeat=len(modes) - 1)]
        blocks = len(self.corners)
        scale = 1 / (width * width)
        # Complex weights held as (..., 2) real tensors: every optimizer and collective handles real tensors.
        # Drawn scaled in place (the values of scale * rand): arithmetic on the meta device, where the doctor counts
        # parameters, imports dynamo and sympy (train.model.builtin.parameter_count).
        self.weights = nn.Parameter(torch.empty(blocks, width, width, *modes, 2).uniform_(0, scale))
        self.sizes = tuple(sizes) if sizes is not None else None
        # The DFT matrices of ``sizes``: no buffers (a checkpoint holds the weights alone, and DDP would broadcast
        # every buffer at every forward), moved with the module by _apply.
        if self.sizes:
            self.bases = [tuple(m.to(self.weights.device) for m in axis) for axis in dft_bases(self.modes, self.sizes)]
        else:
            self.bases = None

    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)
        if self.bases is not None:  # .to(device), .cuda(), .cpu(): the matrices go where the weights go
            self.bases = [tuple(fn(m) for m in axis) for axis in self.bases]
        return module

    def _bases(self, sizes: tuple[int, ...], like: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        if sizes == self.sizes:
            return self.bases
        return [tuple(m.to(like.device) for m in axis) for axis in dft_bases(self.modes, sizes)]

    def _placed_weights(self) -> torch.Tensor:
        """(in, out, *kept, 2): the blocks placed along the kept frequencies, the low ones first on each axis."""
        blocks = dict(zip(self.corners, self.weights.float().unbind(0), strict=True))

        def place(prefix: tuple[bool, ...]) -> torch.Tensor:
            if len(prefix) == len(self.modes) - 1:
                return blocks[prefix]
            return torch.cat([place((*prefix, False)), place((*prefix, True))], dim=2 + len(prefix))

        return place(())

    def _mix(self, re: torch.Tensor, im: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each kept mode's (b, in) spectrum times its (in, out) complex weights, as one batched real matrix
        product over the modes: [re | im] @ [[w_re, w_im], [-w_im, w_re]]. (Four einsums over a mode axis that is
        not the leading one made the CPU's bmm copy every mode's operands separately.)"""
        b, _, *kept = re.shape
        w = self._placed_weights().flatten(2, -2).permute(2, 0, 1, 3)  # (modes, in, out, 2)
        w_re, w_im = w[..., 0], w[..., 1]
        weights = torch.cat([torch.cat([w_re, w_im], dim=2), torch.cat([-w_im, w_re], dim=2)], dim=1)
        z = torch.cat([re, im], dim=1).flatten(2).permute(2, 0, 1)  # (modes, b, 2 in)
        out = torch.bmm(z, weights).permute(1, 2, 0).reshape(b, -1, *kept)  # (b, 2 out, *kept)
        return out.chunk(2, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Traced (torch.compile, export): the truncated DFTs, matrix products only. Eager: the FFT, which costs less
        # on a 2D grid (O(n log n) against O(n * modes) per axis) and gives the same to fp32 rounding.
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            return self._dft(x)
        return self._fft(x)

    def _fft(self, x: torch.Tensor) -> torch.Tensor:
        """``irfftn(W * rfftn(x))`` with complex tensors, as PDEBench computes it."""
        dims = tuple(range(2, x.dim()))
        with torch.autocast(x.device.type, enabled=False):
            spectrum = torch.fft.rfftn(x.float(), dim=dims)
            w = torch.view_as_complex(self.weights.float())
            out = torch.zeros_like(spectrum)
            axes = "xyz"[: len(self.modes)]
            for block, corner in enumerate(self.corners):
                index = (
                    slice(None),
                    slice(None),
                    *[
                        slice(-m, None) if high else slice(None, m)
                        for high, m in zip(corner, self.modes[:-1], strict=True)
                    ],
                    slice(None, self.modes[-1]),
                )
                out[index] = torch.einsum(f"bi{axes},io{axes}->bo{axes}", spectrum[index], w[block])
            return torch.fft.irfftn(out, s=x.shape[2:], dim=dims)

    def _dft(self, x: torch.Tensor) -> torch.Tensor:
        """The same with the kept modes' truncated DFTs in real arithmetic."""
        dims = x.dim() - 2
        with torch.autocast(x.device.type, enabled=False):
            bases = self._bases(tuple(x.shape[2:]), x)
            re, im = x.float(), None
            for axis, (cos, sin, _, _) in enumerate(bases):  # X_k = sum_j x_j (cos - i sin)
                dim = 2 + axis
                if im is None:
                    re, im = _along(re, cos, dim), -_along(re, sin, dim)
                else:
                    re, im = _along(re, cos, dim) + _along(im, sin, dim), _along(im, cos, dim) - _along(re, sin, dim)
            re, im = self._mix(re, im)
            for axis, (_, _, cos, sin) in enumerate(bases[:-1]):  # y_j = 1/N sum_k Y_k (cos + i sin)
                dim = 2 + axis
                re, im = _along(re, cos, dim) - _along(im, sin, dim), _along(im, cos, dim) + _along(re, sin, dim)
            _, _, cos, sin = bases[-1]
            return _along(re, cos, 1 + dims) - _along(im, sin, 1 + dims)


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
        self.spectral = nn.ModuleList(SpectralConv(cfg.width, modes, tuple(padded)) for _ in range(cfg.layers))
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.pointwise = nn.ModuleList(conv(cfg.width, cfg.width, 1) for _ in range(cfg.layers))
        self.project = nn.Sequential(
            nn.Linear(cfg.width, PROJECTION_WIDTH), nn.GELU(), nn.Linear(PROJECTION_WIDTH, spec.out_channels)
        )

    def _coordinates(self, like: torch.Tensor) -> torch.Tensor:
        """(batch, *grid, dims): each point's position along each axis, in [0, 1] (both ends on the grid), or in
        [0, 1) on a periodic axis, whose end point is its first point again and so not on the grid."""
        axes = [
            torch.linspace(0, 1, n + 1, device=like.device, dtype=like.dtype)[:-1]
            if wraps
            else torch.linspace(0, 1, n, device=like.device, dtype=like.dtype)
            for n, wraps in zip(self.spec.grid, self.spec.periodic, strict=True)
        ]
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
            h = spectral(h) + _pointwise(pointwise, h)
            if i < len(self.spectral) - 1:
                h = nn.functional.gelu(h)
        if any(self.pads):
            h = h[(..., *[slice(0, n) for n in self.spec.grid])]
        out = self.project(h.movedim(1, -1))
        return out if last is None else last + out
