"""Datasets over memory-mapped caches, and a sampler that gives every rank the same number of batches.

Datasets hold only a path until first use, so pickling them into DataLoader workers copies nothing large,
and each process maps the arrays itself after any fork. Batches are fetched with one fancy-indexed read
(``__getitems__``), not sample by sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from train.data.cache import CacheInfo


class _Mapped:
    """Lazily memory-mapped .npy files: nothing but paths survives pickling."""

    def __init__(self, *paths: Path):
        self._paths = paths
        self._arrays: tuple[np.ndarray, ...] | None = None

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            self._arrays = tuple(np.load(p, mmap_mode="r") for p in self._paths)
        return self._arrays

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}


class WindowDataset(_Mapped):
    """Autoregressive training pairs: ``initial_step`` frames in, the next frame out.

    Item ``i`` is window ``i % windows_per_sample`` of trajectory ``i // windows_per_sample``.
    """

    def __init__(self, info: CacheInfo, split: str, initial_step: int):
        super().__init__(info.path / f"{split}.npy")
        self.initial_step = initial_step
        self.n_samples = info.sizes[split]
        self.windows_per_sample = info.n_frames - initial_step
        assert self.windows_per_sample >= 1, "checked when the run is set up"

    def __len__(self) -> int:
        return self.n_samples * self.windows_per_sample

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        (traj,) = self.arrays
        idx = np.asarray(indices)
        sample, start = np.divmod(idx, self.windows_per_sample)
        frames = start[:, None] + np.arange(self.initial_step + 1)
        windows = traj[sample[:, None], frames]  # (b, k+1, *space, c): one gather
        windows = torch.from_numpy(np.ascontiguousarray(windows))
        return {"x": windows[:, :-1], "y": windows[:, -1]}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([index]).items()}


class PairDataset(_Mapped):
    """Steady problems (Darcy): input field in, solution field out."""

    def __init__(self, info: CacheInfo, split: str):
        super().__init__(info.path / f"{split}_x.npy", info.path / f"{split}_y.npy")
        self.n_samples = info.sizes[split]

    def __len__(self) -> int:
        return self.n_samples

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        x, y = self.arrays
        idx = np.asarray(indices)
        return {"x": torch.from_numpy(x[idx]), "y": torch.from_numpy(y[idx])}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([index]).items()}


def training_dataset(info: CacheInfo, split: str, initial_step: int) -> WindowDataset | PairDataset:
    return WindowDataset(info, split, initial_step) if info.autoregressive else PairDataset(info, split)


def keep_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DataLoader collate for datasets that already return whole batches."""
    return batch


class EqualBatchSampler:
    """A fixed number of batches per epoch on every rank, whatever the dataset size.

    The global order for epoch ``e`` is a chain of permutations drawn from (seed, stream, e), long enough
    for ``steps x world_size x batch_size`` indices; rank ``r`` takes every ``world_size``-th batch. A
    short dataset is passed over several times per epoch, a long one partially; no index repeats within
    one pass, and all ranks run exactly ``steps`` batches, so no collective ever waits on a finished rank.
    """

    def __init__(self, n_items: int, batch_size: int, steps: int, rank: int, world_size: int, seed: int, stream: int):
        assert n_items > 0 and 0 <= rank < world_size
        self.n_items, self.batch_size, self.steps = n_items, batch_size, steps
        self.rank, self.world_size, self.seed, self.stream = rank, world_size, seed, stream
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.stream, self.epoch])
        needed = self.steps * self.world_size * self.batch_size
        passes = -(-needed // self.n_items)
        order = np.concatenate([rng.permutation(self.n_items) for _ in range(passes)])[:needed]
        batches = order.reshape(self.steps, self.world_size, self.batch_size)[:, self.rank]
        # Sorted indices read the memory map front to back; order inside a batch does not matter.
        for batch in batches:
            yield np.sort(batch).tolist()


def steps_for_one_pass(n_items: int, batch_size: int, world_size: int) -> int:
    return max(1, n_items // (batch_size * world_size))
