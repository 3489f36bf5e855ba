"""Per-channel mean and standard deviation over a stream of blocks, as every cache build takes them."""

from __future__ import annotations

import numpy as np


class RunningStats:
    """Per-channel mean and standard deviation over a stream of channels-last blocks.

    Blocks are merged with Chan et al.'s pairwise update (float64), not E[x^2] - E[x]^2, which cancels
    catastrophically for channels with a large mean and a small spread.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean: np.ndarray | float = 0.0
        self.m2: np.ndarray | float = 0.0

    def update(self, block: np.ndarray) -> None:
        flat = block.reshape(-1, block.shape[-1])
        n = flat.shape[0]
        if n == 0:
            return
        mean = flat.mean(0, dtype=np.float64)  # cast in buffers: no float64 copy of the block
        # Squared deviations from a float32 copy of the mean, summed in float64; sum((x - s)^2) equals
        # sum((x - mean)^2) + n (mean - s)^2 exactly, so the shift's rounding is taken back out.
        shift = mean.astype(np.float32)
        dev = flat - shift
        np.square(dev, out=dev)
        m2 = dev.sum(0, dtype=np.float64) - n * np.square(mean - shift)
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + np.square(delta) * (self.count * n / total)
        self.count = total

    def result(self, std_floor: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Mean and population std per channel; ``std_floor``: the std is at least this (The Well's rule), None:
        a constant channel keeps std 1 (PDEBench tasks)."""
        mean = np.asarray(self.mean, dtype=np.float64)
        std = np.sqrt(np.asarray(self.m2, dtype=np.float64) / max(1, self.count))
        if std_floor is not None:
            return mean, np.maximum(std, std_floor)
        # A constant channel (e.g. Darcy's two-valued coefficient in a tiny set) must not divide by ~zero.
        constant = std <= 1e-6 * np.maximum(1.0, np.abs(mean))
        return mean, np.where(constant, 1.0, std)
