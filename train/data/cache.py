"""Training caches: normalised, strided, contiguous ``.npy`` arrays on disk, opened memory-mapped.

A cache never lives in /dev/shm: every rank and DataLoader worker maps the same files and shares the OS
page cache, one copy in RAM whatever the number of processes. A cache folder is named by a hash of
everything that determines its contents; it is built in a temporary folder and renamed into place, so a
folder under a final name is always complete and a stale cache is simply never looked up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from train.atomic import fsync_dir, write_json_atomic
from train.config import TaskConfig
from train.data.pdebench import LAYOUTS, SPLITS, open_reader, split_ranges
from train.data.sources import SplitFiles
from train.errors import DataError

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
MANIFEST = "manifest.json"


def array_name(split: str, part: str = "") -> str:
    """File of one cached array: ``part`` is '' (trajectories), 'x' or 'y' (steady inputs/targets)."""
    return f"{split}_{part}.npy" if part else f"{split}.npy"


@dataclass(frozen=True)
class CacheInfo:
    """What a finished cache holds; read from its manifest."""

    path: Path
    pde: str
    autoregressive: bool
    grid: tuple[int, ...]
    n_frames: int
    in_channels: int
    out_channels: int
    sizes: dict[str, int]
    input_mean: tuple[float, ...]
    input_std: tuple[float, ...]
    target_mean: tuple[float, ...]
    target_std: tuple[float, ...]
    splits: dict[str, dict]

    def array(self, split: str, part: str = "") -> np.ndarray:
        """Memory-map one array: ``part`` is '' (trajectories), 'x' or 'y' (steady inputs/targets)."""
        return np.load(self.path / array_name(split, part), mmap_mode="r")

    @classmethod
    def load(cls, path: Path) -> CacheInfo | None:
        try:
            meta = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if meta.get("format") != CACHE_FORMAT:
            return None
        fields = {k: meta[k] for k in cls.__dataclass_fields__ if k != "path"}
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        return cls(path=path, **fields)


def fingerprint(source: Path) -> dict:
    """Identity of a source file: cheap to compute, changes whenever the file is rewritten."""
    try:
        st = source.stat()
    except OSError as e:
        raise DataError(f"data file '{source}' cannot be read: {e}") from None
    return {"path": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _as_files(source: Path | SplitFiles) -> SplitFiles:
    return source if isinstance(source, SplitFiles) else SplitFiles(train=Path(source))


def cache_key(task: TaskConfig, source: Path | SplitFiles) -> str:
    files = _as_files(source)
    recipe = {
        "format": CACHE_FORMAT,
        "pde": task.pde,
        "spatial_stride": task.spatial_stride,
        "temporal_stride": task.temporal_stride,
        "test_fraction": task.test_fraction,
        "val_fraction": task.val_fraction,
        "source": {split: fingerprint(path) for split in SPLITS if (path := files.get(split)) is not None},
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(cache_root: Path, name: str, task: TaskConfig, source: Path | SplitFiles) -> Path:
    return cache_root / name / cache_key(task, source)


class _RunningStats:
    """Per-channel mean and standard deviation over a stream of channels-last blocks.

    Blocks are merged with Chan et al.'s pairwise update (float64), not E[x^2] - E[x]^2, which cancels
    catastrophically for channels with a large mean and a small spread.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean: np.ndarray | float = 0.0
        self.m2: np.ndarray | float = 0.0

    def update(self, block: np.ndarray) -> None:
        flat = block.reshape(-1, block.shape[-1]).astype(np.float64)
        n = flat.shape[0]
        if n == 0:
            return
        mean = flat.mean(0)
        m2 = np.square(flat - mean).sum(0)
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + np.square(delta) * (self.count * n / total)
        self.count = total

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        mean = np.asarray(self.mean, dtype=np.float64)
        std = np.sqrt(np.asarray(self.m2, dtype=np.float64) / self.count)
        # A constant channel (e.g. Darcy's two-valued coefficient in a tiny set) must not divide by ~zero.
        constant = std <= 1e-6 * np.maximum(1.0, np.abs(mean))
        return mean, np.where(constant, 1.0, std)


def build_cache(name: str, task: TaskConfig, source: Path | SplitFiles, cache_root: Path) -> CacheInfo:
    """Return the valid cache for this task, building it first if needed (a no-op when it exists)."""
    final = cache_path(cache_root, name, task, source)
    info = CacheInfo.load(final)
    if info is not None:
        log.info("cache %s: up to date at %s", name, final)
        return info
    if final.exists():
        log.warning("cache %s: %s is incomplete or of an old format; rebuilding", name, final)
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        _write(tmp, task, _as_files(source))
        try:
            os.rename(tmp, final)
        except OSError:
            if CacheInfo.load(final) is None:  # not another process's complete build
                raise
            shutil.rmtree(tmp)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info = CacheInfo.load(final)
    assert info is not None
    log.info("cache %s: built %s (%s)", name, final, ", ".join(f"{k}={v}" for k, v in info.sizes.items()))
    return info


def _plan(task: TaskConfig, files: SplitFiles) -> dict[str, tuple[Any, range, bool]]:
    """Each split's reader and sample range; splits without a file of their own are carved from train."""
    layout = LAYOUTS[task.pde]
    open_ = lambda path: open_reader(path, task.pde, task.spatial_stride, task.temporal_stride)  # noqa: E731
    train = open_(files.train)
    carve_test, carve_val = files.test is None, files.val is None
    ranges = split_ranges(
        train.n_samples,
        task.test_fraction if carve_test else 0.0,
        task.val_fraction if carve_val else 0.0,
        layout.test_first,
    )
    plan = {"train": (train, ranges["train"], False)}
    for split, carve in (("val", carve_val), ("test", carve_test)):
        if carve:
            plan[split] = (train, ranges[split], True)
        else:
            reader = open_(files.get(split))
            if (reader.grid, reader.n_frames) != (train.grid, train.n_frames):
                raise DataError(
                    f"{reader.path}: grid {reader.grid} x {reader.n_frames} frames differs from the train file "
                    f"{train.path} ({train.grid} x {train.n_frames} frames); the splits must come from one dataset"
                )
            plan[split] = (reader, range(reader.n_samples), False)
    return plan


def _write(folder: Path, task: TaskConfig, files: SplitFiles) -> None:
    layout = LAYOUTS[task.pde]
    plan = _plan(task, files)
    train = plan["train"][0]
    try:
        parts = [""] if layout.autoregressive else ["x", "y"]
        stats = {part: _RunningStats() for part in parts}
        arrays: dict[tuple[str, str], np.ndarray] = {}
        # Training split first: its statistics normalise every split, so val/test never leak into them.
        for split in ("train", "val", "test"):
            reader, samples, _ = plan[split]
            offset = 0
            for inputs, targets in reader.iter_blocks(samples):
                blocks = {"": inputs} if layout.autoregressive else {"x": inputs, "y": targets}
                for part, block in blocks.items():
                    if (split, part) not in arrays:
                        shape = (len(samples), *block.shape[1:])
                        arrays[split, part] = np.lib.format.open_memmap(
                            folder / array_name(split, part), mode="w+", dtype=np.float32, shape=shape
                        )
                    arrays[split, part][offset : offset + len(block)] = block
                    if split == "train":
                        stats[part].update(block)
                offset += len(inputs)
        moments = {part: stats[part].result() for part in parts}
        step = train.block_size()
        for (_split, part), array in arrays.items():
            mean, std = moments[part]
            for start in range(0, len(array), step):
                chunk = array[start : start + step]
                chunk[...] = (chunk - mean.astype(np.float32)) / std.astype(np.float32)
            array.flush()
        for split in SPLITS:
            for part in parts:
                if (split, part) not in arrays:  # an empty split (val_fraction 0)
                    shape = (0, *arrays["train", part].shape[1:])
                    np.save(folder / array_name(split, part), np.zeros(shape, np.float32))
        in_part, out_part = ("", "") if layout.autoregressive else ("x", "y")
        manifest = {
            "format": CACHE_FORMAT,
            "pde": task.pde,
            "autoregressive": layout.autoregressive,
            "grid": list(train.grid),
            "n_frames": train.n_frames,
            "in_channels": arrays["train", in_part].shape[-1],
            "out_channels": arrays["train", out_part].shape[-1],
            "sizes": {split: len(plan[split][1]) for split in SPLITS},
            "input_mean": moments[in_part][0].tolist(),
            "input_std": moments[in_part][1].tolist(),
            "target_mean": moments[out_part][0].tolist(),
            "target_std": moments[out_part][1].tolist(),
            "splits": {
                split: {
                    "file": str(reader.path),
                    "samples": [samples.start, samples.stop],
                    "carved": carved,
                }
                for split, (reader, samples, carved) in plan.items()
            },
            "source": {split: fingerprint(reader.path) for split, (reader, _, _) in plan.items()},
            "coordinates": train.coordinates(),
        }
    finally:
        for reader, _, _ in plan.values():
            reader.close()
    for path in folder.iterdir():
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    write_json_atomic(folder / MANIFEST, manifest)
