"""Training data held on the device: a task's arrays copied once to each rank's device, batches gathered there.

The DataLoader path reads every batch from the memory-mapped cache on the host, normalises it and copies it to
the device: per-step host work and a host-to-device copy that a GPU fed by one process waits for. Here a task's
arrays (physical values, as the cache holds them) are copied once, in chunks, and normalised on the device
(``(x - mean) / std`` in float32, the same arithmetic the cache's reads do, so both paths give bitwise-equal
batches); each step then gathers its windows by index with a few device kernels and no host work.

The batches' indices are the sampler's (train.data.dataset.EqualBatchSampler): one epoch's rows are copied to
the device when the epoch starts, so the same seed draws the same windows in the same order on both paths.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from train.data.cache.cached_array import CachedArray
from train.data.dataset import EqualBatchSampler, LatentDataset, PairDataset, WindowDataset

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20
"""Host memory one copying chunk takes: the arrays reach the device without ever being whole on the host."""


def _to_device(array: np.ndarray | CachedArray, device: torch.device) -> torch.Tensor:
    """A whole array on ``device``: a cached array's physical values copied in chunks, then normalised there."""
    if not isinstance(array, CachedArray):  # an index or latents file: plain values
        return torch.from_numpy(np.array(array)).to(device)
    out = torch.empty(array.shape, dtype=torch.float32, device=device)
    rows = max(1, CHUNK_BYTES // max(1, array.nbytes // max(1, len(array))))
    for first in range(0, len(array), rows):
        chunk = torch.from_numpy(array.raw(slice(first, first + rows)))
        out[first : first + len(chunk)].copy_(chunk)
    mean = torch.from_numpy(array.mean).to(device)
    std = torch.from_numpy(array.std).to(device)
    return out.sub_(mean).div_(std)


class DeviceTask:
    """One task's training items on the device; :meth:`gather` returns what the dataset's ``__getitems__``
    returns for the same indices, as device tensors."""

    def __init__(self, dataset: WindowDataset | PairDataset | LatentDataset, device: torch.device):
        base = dataset.base if isinstance(dataset, LatentDataset) else dataset
        arrays = base.arrays
        self.windowed = isinstance(base, WindowDataset)
        self.tensors = [_to_device(a, device) for a in arrays]
        self.latents = _to_device(dataset.latents.arrays[0], device) if isinstance(dataset, LatentDataset) else None
        if self.windowed:
            self.tensors[1] = self.tensors[1].long()  # the window index: (trajectory, start frame) rows
            k, h, stride = base.initial_step, base.horizon, base.stride
            self.k, self.horizon = k, h
            self.offsets = torch.arange(k + h, device=device) * stride
        self.nbytes = sum(t.nbytes for t in self.tensors) + (self.latents.nbytes if self.latents is not None else 0)

    def gather(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch of items ``indices`` (a device int64 tensor), laid out as the dataset lays it out."""
        if self.windowed:
            batch = self._windows(indices)
        else:
            batch = {"x": self.tensors[0][indices], "y": self.tensors[1][indices]}
        if self.latents is not None:
            batch["z"] = self.latents[indices]
        return batch

    def _windows(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        traj, index, *const = self.tensors
        sample, start = index[indices].unbind(1)
        windows = traj[sample[:, None], start[:, None] + self.offsets]  # (b, k+h, *space, c)
        k = self.k
        target = windows[:, k] if self.horizon == 1 else windows[:, k:]
        if not const:
            return {"x": windows[:, :k], "y": target}
        frames = windows[:, :k]
        constants = const[0][sample][:, None].expand(*frames.shape[:-1], const[0].shape[-1])
        return {"x": torch.cat([frames, constants], dim=-1), "y": target.clone()}


class DeviceLoader:
    """A DataLoader's stand-in for one task: iterating it yields the sampler's current batches (those of
    ``set_epoch``'s range), gathered on the device."""

    def __init__(self, task: DeviceTask, sampler: EqualBatchSampler, device: torch.device):
        self.task, self.sampler, self.device = task, sampler, device
        self._rows: torch.Tensor | None = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = list(self.sampler)
        if not batches:
            return iter(())
        rows = torch.from_numpy(np.asarray(batches, dtype=np.int64))
        if self.device.type == "cuda":  # pinned, so the copy neither blocks the host nor outlives its source
            rows = rows.pin_memory()
        self._rows = rows.to(self.device, non_blocking=True)
        return (self.task.gather(row) for row in self._rows)


def hold_splits(tasks: list, device: torch.device, budget: int) -> int:
    """Hold the val and test trajectories of autoregressive tasks on ``device`` (TaskData.resident), split by
    split while they fit in ``budget`` bytes; returns the bytes held. Evaluation then reads them there."""
    held = 0
    for task in tasks:
        if not task.spec.autoregressive:
            continue
        for split in ("val", "test"):
            n = task.info.sizes[split]
            first = task.trajectories(split, [0]) if n else None
            if first is None or held + n * first.nbytes > budget:
                continue
            out = torch.empty((n, *first.shape[1:]), dtype=first.dtype, device=device)
            rows = max(1, CHUNK_BYTES // first.nbytes)
            for start in range(0, n, rows):
                stop = min(n, start + rows)
                out[start:stop].copy_(task.trajectories(split, np.arange(start, stop)))
            task.resident[split] = out
            held += out.nbytes
    return held


@dataclass(frozen=True)
class Placement:
    """Whether the training data goes on the device, and why (logged once)."""

    on_device: bool
    nbytes: int
    free: int
    reason: str


def free_memory(device: torch.device) -> int:
    """Bytes the device can still give: CUDA's free memory, or the host's available memory on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def dataset_bytes(datasets: list) -> int:
    """Bytes the datasets' arrays take once copied to a device."""
    total = 0
    for dataset in datasets:
        base = dataset.base if isinstance(dataset, LatentDataset) else dataset
        # The window index is stored as int32 on disk and gathered from as int64.
        total += sum(int(a.nbytes) * (2 if a.dtype == np.int32 else 1) for a in base.arrays)
        if isinstance(dataset, LatentDataset):
            total += int(dataset.latents.arrays[0].nbytes)
    return total


def placement(requested: bool | str, share: float, datasets: list, device: torch.device) -> Placement:
    """train.data_on_device resolved: ``auto`` puts the data on a CUDA device when it fits in ``share`` of the
    device's free memory; ``true`` wherever it fits (a ConfigError from the caller otherwise); ``false`` never."""
    nbytes = dataset_bytes(datasets)
    free = free_memory(device)
    fits = nbytes <= share * free
    if requested is False:
        return Placement(False, nbytes, free, "train.data_on_device=false")
    if requested == "auto" and device.type != "cuda":
        return Placement(False, nbytes, free, "auto: not on a GPU (the cache is read through the loader)")
    if not fits:
        return Placement(False, nbytes, free, f"the arrays take more than train.data_on_device_share={share} of free")
    return Placement(True, nbytes, free, f"train.data_on_device={str(requested).lower()}")
