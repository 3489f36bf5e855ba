"""Datasets over memory-mapped caches, and a sampler that gives every rank the same number of batches.

Datasets hold only a path until first use, so pickling them into DataLoader workers copies nothing large,
and each process maps the arrays itself after any fork. Batches are fetched with one fancy-indexed read
(``__getitems__``), not sample by sample.
"""

from __future__ import annotations

import functools
import json
import random
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from train.config import TrainConfig
from train.data.cache.build import window_index_name, window_span, write_window_index
from train.data.cache.cached_array import CachedArray
from train.data.cache.info import CacheInfo, with_constants
from train.stop_signals import RANK_STOP_SIGNALS


def target_frames(cfg: TrainConfig) -> int:
    """Frames after the input window a training item of an autoregressive task holds: one for the one-step
    objective, ``rollout_steps`` for the rollout ones. The launcher sizes windows and caches by it, the ranks
    build their items by it."""
    return 1 if cfg.objective == "one_step" else cfg.rollout_steps


class _Mapped:
    """Lazily memory-mapped arrays: cached arrays (normalised as they are read) or .npy files given by path;
    nothing but paths survives pickling."""

    def __init__(self, *sources: Path | CachedArray):
        self._sources = sources
        self._arrays: tuple[np.ndarray | CachedArray, ...] | None = None

    @property
    def arrays(self) -> tuple[np.ndarray | CachedArray, ...]:
        if self._arrays is None:
            self._arrays = tuple(s if isinstance(s, CachedArray) else np.load(s, mmap_mode="r") for s in self._sources)
        return self._arrays

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}


class WindowDataset(_Mapped):
    """Autoregressive training pairs: ``initial_step`` frames in ("x"), the next frame out ("y"); with a
    ``horizon`` above one, the next ``horizon`` frames, stacked on axis 1 of "y" (rollout-aware objectives).

    Item ``i`` is the window at row ``i`` of the cache's window index: (trajectory, start frame).
    """

    def __init__(self, info: CacheInfo, split: str, initial_step: int, horizon: int = 1, stride: int = 1):
        assert info.n_frames >= window_span(initial_step, horizon, stride), "checked when the run is set up"
        index = info.path / window_index_name(split, initial_step, horizon, stride)
        if not index.is_file():  # normally written by the cache stage; building it here costs milliseconds
            write_window_index(info, initial_step, horizon, stride)
        const = (info.array(split, "const"),) if info.const_channels else ()
        super().__init__(info.array(split), index, *const)
        self.initial_step, self.horizon, self.stride = initial_step, horizon, stride
        self.n_windows = len(np.load(index, mmap_mode="r"))  # the index decides; the map is not kept

    def __len__(self) -> int:
        return self.n_windows

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        traj, index, *const = self.arrays
        sample, start = index[np.asarray(indices)].T
        k = self.initial_step
        frames = start[:, None] + np.arange(k + self.horizon) * self.stride
        gathered = traj[sample[:, None], frames]  # (b, k+h, *space, c): one gather, normalised
        windows = torch.from_numpy(gathered)
        target = windows[:, k] if self.horizon == 1 else windows[:, k:]
        if not const:
            # Views of one storage: a batch crosses the workers' shared-memory queue once, not twice.
            return {"x": windows[:, :k], "y": target}
        x = with_constants(windows[:, :k].numpy(), const[0][sample])
        return {"x": torch.from_numpy(x), "y": target.clone()}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([index]).items()}


class PairDataset(_Mapped):
    """Steady problems (Darcy): input field in, solution field out."""

    def __init__(self, info: CacheInfo, split: str):
        super().__init__(info.array(split, "x"), info.array(split, "y"))
        self.n_samples = info.sizes[split]

    def __len__(self) -> int:
        return self.n_samples

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        x, y = self.arrays
        idx = np.asarray(indices)
        return {"x": torch.from_numpy(x[idx]), "y": torch.from_numpy(y[idx])}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.__getitems__([index]).items()}


def training_dataset(
    info: CacheInfo, split: str, initial_step: int, horizon: int = 1, stride: int = 1
) -> WindowDataset | PairDataset:
    """A split's training items; ``horizon``: target frames of autoregressive windows (steady tasks have one),
    ``stride``: saved steps between a window's frames."""
    if info.autoregressive:
        return WindowDataset(info, split, initial_step, horizon, stride)
    return PairDataset(info, split)


# A latent cache (train.model.latent builds it): the frozen encoder's tokens of every training item.
LATENT_FORMAT = 1
MANIFEST = "manifest.json"
TOKENS = "train_z.npy"


@dataclass(frozen=True)
class LatentInfo:
    """A finished latent cache: the tokens of every training item, and the encoder weights that made them."""

    path: Path
    encoder: str
    items: int
    tokens: int
    d_model: int

    @property
    def file(self) -> Path:
        """The (items, tokens, d_model) float32 array of the training split's tokens."""
        return self.path / TOKENS

    def encoder_state(self) -> dict[str, torch.Tensor]:
        """The frozen encoder's parameters (codec-relative names), as stored with the latents."""
        return torch.load(self.path / "encoder.pt", map_location="cpu", weights_only=True)

    @classmethod
    def load(cls, path: Path) -> LatentInfo | None:
        try:
            meta = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if meta.get("format") != LATENT_FORMAT:
            return None
        return cls(path, meta["encoder"], meta["items"], meta["tokens"], meta["d_model"])


class LatentDataset:
    """A training dataset plus the frozen encoder's tokens of each item ("z"), read from a latent cache."""

    def __init__(self, base: WindowDataset | PairDataset, latents: Path):
        self.base = base
        self.latents = _Mapped(latents)
        n = len(np.load(latents, mmap_mode="r"))
        assert n == len(base), f"latent cache {latents} holds {n} items, the dataset {len(base)}"

    def __len__(self) -> int:
        return len(self.base)

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        (z,) = self.latents.arrays
        return {**self.base.__getitems__(indices), "z": torch.from_numpy(z[np.asarray(indices)])}


def seed_worker(seed: int, rank: int, worker_id: int) -> None:
    """Seed a DataLoader worker's generators from (seed, rank, worker), and make it ignore stop signals.

    Without it, numpy's global generator is copied into every forked worker in the same state, so random
    augmentations repeat across workers and ranks; with it they differ, and repeat from run to run.
    """
    # The rank stops its workers itself; a SIGTERM sent to the whole process group (docker stop, SLURM) must
    # not kill them under it before it has saved its checkpoint.
    for sig in RANK_STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    state = np.random.SeedSequence([seed, rank, worker_id]).generate_state(2)
    np.random.seed(int(state[0]))
    random.seed(int(state[1]))
    torch.manual_seed(int(state[0]) << 32 | int(state[1]))


def worker_seeding(seed: int, rank: int) -> Callable[[int], None]:
    """``worker_init_fn`` for this rank's DataLoaders (a partial, so it pickles under any start method)."""
    return functools.partial(seed_worker, seed, rank)


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
        self.epoch, self.start, self.stop = 0, 0, steps

    def set_epoch(self, epoch: int, start: int = 0, stop: int | None = None) -> None:
        """Yield batches ``start..stop`` of epoch ``epoch``: a resumed run skips the ones already trained."""
        stop = self.steps if stop is None else stop
        assert 0 <= start <= stop <= self.steps, (start, stop, self.steps)
        self.epoch, self.start, self.stop = epoch, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def global_batch(self) -> int:
        """Items all ranks take in one of this sampler's batches."""
        return self.world_size * self.batch_size

    def order(self) -> np.ndarray:
        """The epoch's items in the order every rank's batches take them, as long as the epoch needs."""
        rng = np.random.default_rng([self.seed, self.stream, self.epoch])
        needed = self.steps * self.global_batch
        passes = -(-needed // self.n_items)
        return np.concatenate([rng.permutation(self.n_items) for _ in range(passes)])[:needed]

    def close(self) -> None:
        """What a sampler holds beyond its numbers (a streamed one: a thread, pins); nothing here."""

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.order().reshape(self.steps, self.world_size, self.batch_size)[:, self.rank]
        # Sorted indices read the memory map front to back; order inside a batch does not matter.
        for batch in batches[self.start : self.stop]:
            yield np.sort(batch).tolist()


def step_on_world_size(step: int, trained_on: int, world_size: int) -> int | None:
    """The step of an epoch at which ``world_size`` ranks reach the sample ``trained_on`` ranks reached at
    ``step`` (every rank takes its slice of one sequence: EqualBatchSampler); None where no step does."""
    consumed = step * trained_on
    return None if consumed % world_size else consumed // world_size


def steps_for_one_pass(n_items: int, batch_size: int, world_size: int) -> int:
    return max(1, n_items // (batch_size * world_size))
