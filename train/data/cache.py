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

import numpy as np

from train.atomic import fsync_dir, write_json_atomic
from train.config import TaskConfig
from train.data.pdebench import LAYOUTS, SPLITS, SingleFileReader, split_ranges
from train.errors import DataError

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
MANIFEST = "manifest.json"


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

    def array(self, split: str, part: str = "") -> np.ndarray:
        """Memory-map one array: ``part`` is '' (trajectories), 'x' or 'y' (steady inputs/targets)."""
        name = f"{split}_{part}.npy" if part else f"{split}.npy"
        return np.load(self.path / name, mmap_mode="r")

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


def cache_key(task: TaskConfig, source: Path) -> str:
    recipe = {
        "format": CACHE_FORMAT,
        "pde": task.pde,
        "spatial_stride": task.spatial_stride,
        "temporal_stride": task.temporal_stride,
        "test_fraction": task.test_fraction,
        "val_fraction": task.val_fraction,
        "source": fingerprint(source),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(cache_root: Path, name: str, task: TaskConfig, source: Path) -> Path:
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


def build_cache(name: str, task: TaskConfig, source: Path, cache_root: Path) -> CacheInfo:
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
        _write(tmp, task, source)
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


def _write(folder: Path, task: TaskConfig, source: Path) -> None:
    layout = LAYOUTS[task.pde]
    reader = SingleFileReader(source, task.pde, task.spatial_stride, task.temporal_stride)
    try:
        ranges = split_ranges(reader.n_samples, task.test_fraction, task.val_fraction)
        parts = [""] if layout.autoregressive else ["x", "y"]
        stats = {part: _RunningStats() for part in parts}
        arrays: dict[tuple[str, str], np.ndarray] = {}
        # Training split first: its statistics normalise every split, so val/test never leak into them.
        for split in ("train", "val", "test"):
            offset = 0
            for inputs, targets in reader.iter_blocks(ranges[split]):
                blocks = {"": inputs} if layout.autoregressive else {"x": inputs, "y": targets}
                for part, block in blocks.items():
                    if (split, part) not in arrays:
                        name = f"{split}_{part}.npy" if part else f"{split}.npy"
                        shape = (len(ranges[split]), *block.shape[1:])
                        arrays[split, part] = np.lib.format.open_memmap(
                            folder / name, mode="w+", dtype=np.float32, shape=shape
                        )
                    arrays[split, part][offset : offset + len(block)] = block
                    if split == "train":
                        stats[part].update(block)
                offset += len(inputs)
        moments = {part: stats[part].result() for part in parts}
        for (_split, part), array in arrays.items():
            mean, std = moments[part]
            for start in range(0, len(array), reader.block_size()):
                chunk = array[start : start + reader.block_size()]
                chunk[...] = (chunk - mean.astype(np.float32)) / std.astype(np.float32)
            array.flush()
        for split in SPLITS:
            for part in parts:
                if (split, part) not in arrays:  # an empty split (val_fraction 0)
                    name = f"{split}_{part}.npy" if part else f"{split}.npy"
                    channels = len(layout.targets) if part != "x" else len(layout.inputs)
                    extra = (reader.n_frames,) if layout.autoregressive else ()
                    np.save(folder / name, np.zeros((0, *extra, *reader.grid, channels), np.float32))
        in_part, out_part = ("", "") if layout.autoregressive else ("x", "y")
        manifest = {
            "format": CACHE_FORMAT,
            "pde": task.pde,
            "autoregressive": layout.autoregressive,
            "grid": list(reader.grid),
            "n_frames": reader.n_frames,
            "in_channels": len(layout.inputs),
            "out_channels": len(layout.targets),
            "sizes": {split: len(ranges[split]) for split in SPLITS},
            "input_mean": moments[in_part][0].tolist(),
            "input_std": moments[in_part][1].tolist(),
            "target_mean": moments[out_part][0].tolist(),
            "target_std": moments[out_part][1].tolist(),
            "source": fingerprint(source),
            "coordinates": reader.coordinates(),
        }
    finally:
        reader.close()
    for path in folder.iterdir():
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    write_json_atomic(folder / MANIFEST, manifest)
