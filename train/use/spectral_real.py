"""The FNO's spectral convolution in real arithmetic, for export.

ONNX has no complex tensors, and exporting ``rfftn -> complex einsum -> irfftn`` fails. The layer keeps only
the lowest modes, so its transforms are small matrix products: along each axis, the kept frequencies' cosines
and sines (a truncated DFT), the complex weights as real and imaginary parts, and the inverse transform back
onto the grid, the last axis folded as ``irfft`` folds a half spectrum. O(n * modes) per axis instead of
O(n log n): cheap for truncated modes, and the graph holds nothing but matrix products.

It equals :class:`train.model.fno.SpectralConv` to float32 rounding (the export verifies it on every model it
writes) for the grid size it is built for; the sizes are fixed at export, as the FNO's padding already is.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from train.model.fno import FNO, SpectralConv


def _angles(kept: list[int], n: int) -> np.ndarray:
    """2 pi k n / N for each kept frequency k (rows) and grid point n (columns), reduced mod N exactly."""
    return 2 * math.pi * (np.outer(kept, np.arange(n)) % n) / n


def _along(x: torch.Tensor, matrix: torch.Tensor, dim: int) -> torch.Tensor:
    """``matrix`` (out, in) applied along ``dim`` of ``x``."""
    return torch.matmul(x.movedim(dim, -1), matrix.t()).movedim(-1, dim)


class RealSpectralConv(nn.Module):
    """``conv`` for inputs of spatial ``sizes`` (the padded grid), with no complex tensor anywhere."""

    def __init__(self, conv: SpectralConv, sizes: tuple[int, ...]):
        super().__init__()
        modes, d = conv.modes, len(conv.modes)
        assert len(sizes) == d, (sizes, modes)
        # Kept frequencies: the lowest m and the highest m of every axis but the last, the lowest m of the last.
        kept = [[*range(m), *range(n - m, n)] for m, n in zip(modes[:-1], sizes[:-1], strict=True)]
        kept.append(list(range(modes[-1])))
        weights = conv.weights.detach().float()  # (blocks, in, out, *modes, 2)
        full = torch.zeros(*weights.shape[1:3], *[len(k) for k in kept], 2)
        for block, corner in enumerate(conv.corners):
            index = (
                slice(None), slice(None),
                *[slice(m, 2 * m) if high else slice(0, m) for high, m in zip(corner, modes[:-1], strict=True)],
                slice(None),
            )  # fmt: skip
            full[index] = weights[block]
        self.register_buffer("w_re", full[..., 0].contiguous())
        self.register_buffer("w_im", full[..., 1].contiguous())
        self.dims = d
        for axis, (k, n) in enumerate(zip(kept, sizes, strict=True)):
            theta = _angles(k, n)
            self.register_buffer(f"fwd_cos{axis}", torch.from_numpy(np.cos(theta)).float())
            self.register_buffer(f"fwd_sin{axis}", torch.from_numpy(np.sin(theta)).float())
            if axis < d - 1:  # a full inverse DFT over the kept frequencies
                scale = np.full(len(k), 1.0 / n)
            else:  # irfft: the half spectrum counts twice, but for the mean and (even n) the Nyquist frequency
                scale = np.array([1.0 if f == 0 or 2 * f == n else 2.0 for f in k]) / n
            self.register_buffer(f"inv_cos{axis}", torch.from_numpy((np.cos(theta) * scale[:, None]).T).float())
            self.register_buffer(f"inv_sin{axis}", torch.from_numpy((np.sin(theta) * scale[:, None]).T).float())

    def _matrix(self, name: str, axis: int) -> torch.Tensor:
        return getattr(self, f"{name}{axis}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        re, im = x.float(), None
        for axis in range(self.dims):  # X_k = sum_n x_n (cos - i sin)
            dim, c, s = 2 + axis, self._matrix("fwd_cos", axis), self._matrix("fwd_sin", axis)
            if im is None:
                re, im = _along(re, c, dim), -_along(re, s, dim)
            else:
                re, im = _along(re, c, dim) + _along(im, s, dim), _along(im, c, dim) - _along(re, s, dim)
        letters = "xyz"[: self.dims]
        mix = f"bi{letters},io{letters}->bo{letters}"
        re, im = (
            torch.einsum(mix, re, self.w_re) - torch.einsum(mix, im, self.w_im),
            torch.einsum(mix, re, self.w_im) + torch.einsum(mix, im, self.w_re),
        )
        for axis in range(self.dims - 1):  # y_n = 1/N sum_k Y_k (cos + i sin)
            dim, c, s = 2 + axis, self._matrix("inv_cos", axis), self._matrix("inv_sin", axis)
            re, im = _along(re, c, dim) - _along(im, s, dim), _along(im, c, dim) + _along(re, s, dim)
        last = self.dims - 1
        return _along(re, self._matrix("inv_cos", last), 2 + last) - _along(im, self._matrix("inv_sin", last), 2 + last)


def with_real_spectra(model: nn.Module) -> int:
    """Replace every FNO's spectral layers in ``model`` by their real-arithmetic equals, in place; returns how
    many were replaced."""
    replaced = 0
    for fno in [m for m in model.modules() if isinstance(m, FNO)]:
        sizes = tuple(n + p for n, p in zip(fno.spec.grid, fno.pads, strict=True))
        for i, conv in enumerate(fno.spectral):
            if isinstance(conv, SpectralConv):
                fno.spectral[i] = RealSpectralConv(conv, sizes)
                replaced += 1
    return replaced
