"""Readers for PDEBench's two HDF5 storage styles (docs/data-formats.md, 'Single-file layout' and 'Grouped layout').

Everything is returned channels-last: autoregressive fields as (n, t, *space, c), steady (Darcy) pairs as
(n, *space, c). Files are opened lazily and read in blocks of samples: one h5py call per block is far faster
than one per sample for PDEBench's unchunked single-file datasets, and a group-per-seed file is read one whole
group per call because its lzf chunks must be decompressed whole anyway.

A pre-split file (``..._Train.hdf5`` / ``_Valid`` / ``_Test``) is a single-file style file holding one split:
read all of it with ``range(0, reader.n_samples)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from train.errors import DataError
from train.pdes import LAYOUTS, Layout

READ_BLOCK_BYTES = 64 << 20


class Strided:
    """The strided geometry of a reader whose one sample is ``raw_shape`` = [t, *space] before striding (t is 1
    for a steady pair); every reader of the seam whose samples are one array shares it."""

    raw_shape: tuple[int, ...]
    spatial_stride: int
    temporal_stride: int

    @property
    def grid(self) -> tuple[int, ...]:
        """Spatial grid after striding."""
        return tuple(len(range(0, n, self.spatial_stride)) for n in self.raw_shape[1:])

    @property
    def n_frames(self) -> int:
        """Recorded frames of a trajectory after the temporal stride; 1 for a steady pair."""
        return len(range(0, self.raw_shape[0], self.temporal_stride))


def fit_times(times, frames: int):
    """A recorded time axis (1-D) cut or extended, at its last spacing, to ``frames`` values: the times of a
    prediction that covers more or fewer frames than its input."""
    t = np.asarray(times, dtype=np.float64).ravel()
    if len(t) >= frames or len(t) < 2:
        return t[:frames]
    return np.concatenate([t, t[-1] + (t[-1] - t[-2]) * np.arange(1, frames - len(t) + 1)])


class _LazyHdf5(Strided):
    """What both PDEBench readers share: a lazily opened handle and the strided geometry of one sample."""

    std_floor = None  # a constant channel is left unscaled (train.data.formats: the reader seam)

    path: Path
    pde: str
    layout: Layout
    spatial_stride: int
    temporal_stride: int
    raw_shape: tuple[int, ...]  # one sample's [t, *space] before striding (no channel axis)
    _file: h5py.File | None

    def _setup(self, path: str | Path, pde: str, style: str, spatial_stride: int, temporal_stride: int) -> None:
        self.path = Path(path)
        self.layout = LAYOUTS[pde]
        if self.layout.style != style:
            raise ValueError(f"{pde} files are {self.layout.style}-style; open them with open_reader()")
        self.pde = pde
        self.spatial_stride = spatial_stride
        self.temporal_stride = temporal_stride if self.layout.autoregressive else 1
        self._file = None

    # h5py handles cannot cross fork(): open on first use, in whichever process uses it.
    @property
    def file(self) -> h5py.File:
        if self._file is None:
            self._file = open_hdf5(self.path)
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None}

    def parts(self, samples: range) -> Iterator[dict[str, np.ndarray]]:
        """The reader seam's blocks: {"": trajectories} or, for steady pairs, {"x": inputs, "y": targets}."""
        for inputs, targets in self.iter_blocks(samples):
            yield {"": inputs} if targets is None else {"x": inputs, "y": targets}

    def describe(self) -> dict:
        return {}

    def _check_stride(self) -> None:
        space = self.raw_shape[1:]
        for n in space:
            if n < self.spatial_stride:
                raise DataError(f"{self.path}: spatial stride {self.spatial_stride} exceeds the grid {space}")

    def _stride(self, block: np.ndarray, has_time: bool) -> np.ndarray:
        """Strides a block [sample, (t), *space, ...]; trailing axes (channels) are kept whole."""
        index = [slice(None)]
        if has_time:
            index.append(slice(None, None, self.temporal_stride))
        index += [slice(None, None, self.spatial_stride)] * self.layout.spatial_dims
        return block[tuple(index)]


class SingleFileReader(_LazyHdf5):
    """Validated, strided access to one PDEBench single-file dataset."""

    def __init__(self, path: str | Path, pde: str, spatial_stride: int = 1, temporal_stride: int = 1):
        self._setup(path, pde, "single", spatial_stride, temporal_stride)
        self._check()

    def _check(self) -> None:
        keys = dict.fromkeys(self.layout.inputs + self.layout.targets)
        shapes = {}
        for key in keys:
            if key not in self.file:
                raise DataError(
                    f"{self.path}: key '{key}' not found (keys: {sorted(self.file.keys())}); "
                    f"a {self.pde} file needs {list(keys)}"
                )
            ds = self.file[key]
            if not isinstance(ds, h5py.Dataset) or ds.dtype.kind != "f":
                raise DataError(f"{self.path}: '{key}' must be a floating-point dataset, got {ds}")
            shapes[key] = ds.shape
        d = self.layout.spatial_dims
        if self.layout.autoregressive:
            want = 2 + d
            for key, shape in shapes.items():
                if len(shape) != want:
                    raise DataError(
                        f"{self.path}: '{key}' has shape {shape}; a {self.pde} field is [sample, t, {d}D space]"
                    )
        else:
            (inp,), (tgt,) = self.layout.inputs, self.layout.targets
            if len(shapes[inp]) != 1 + d or shapes[tgt] != (shapes[inp][0], 1, *shapes[inp][1:]):
                raise DataError(
                    f"{self.path}: expected '{inp}' [sample, x, y] and '{tgt}' [sample, 1, x, y] of the same "
                    f"size, got {shapes[inp]} and {shapes[tgt]}"
                )
        if self.layout.autoregressive and len(set(shapes.values())) != 1:
            raise DataError(f"{self.path}: fields must share one shape, got {shapes}")
        self.n_samples = shapes[self.layout.targets[0]][0]
        self.raw_shape = shapes[self.layout.targets[0]][1:]
        self._check_stride()

    def coordinates(self) -> dict[str, list[float]]:
        """Strided coordinates from the file. PDEBench's t-coordinate carries one spurious extra entry."""
        out = {}
        for axis, name in zip("xyz", ("x-coordinate", "y-coordinate", "z-coordinate"), strict=True):
            if name in self.file:
                out[axis] = self.file[name][:: self.spatial_stride].astype(float).tolist()
        if self.layout.autoregressive and "t-coordinate" in self.file:
            t = self.file["t-coordinate"][: self.raw_shape[0]]
            out["t"] = t[:: self.temporal_stride].astype(float).tolist()
        return out

    def _read(self, keys: tuple[str, ...], start: int, stop: int, has_time: bool) -> np.ndarray:
        fields = []
        for key in keys:
            try:
                block = self.file[key][start:stop]
            except OSError as e:
                raise DataError(f"{self.path}: cannot read '{key}' samples {start}..{stop}: {e}") from None
            if block.ndim == 1 + self.layout.spatial_dims + 1 and not self.layout.autoregressive:
                block = block[:, 0]  # Darcy's singleton time axis
            block = self._stride(block, has_time and self.layout.autoregressive)
            fields.append(np.asarray(block, dtype=np.float32))
        # One field: a channel axis on a contiguous array, no copy; normalisation works on it in place.
        out = np.ascontiguousarray(fields[0])[..., None] if len(fields) == 1 else np.stack(fields, axis=-1)
        if not np.isfinite(out).all():
            bad = start + int(np.argwhere(~np.isfinite(out))[0][0])
            raise DataError(f"{self.path}: non-finite values (NaN/Inf) in {list(keys)} at sample {bad}")
        return out

    def block_size(self) -> int:
        per_sample = 4 * int(np.prod(self.raw_shape)) * len(set(self.layout.inputs + self.layout.targets))
        return max(1, READ_BLOCK_BYTES // per_sample)

    def iter_blocks(self, samples: range) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Yield (inputs, targets) blocks over a contiguous range; targets is None for autoregressive data."""
        step = self.block_size()
        for start in range(samples.start, samples.stop, step):
            stop = min(start + step, samples.stop)
            if self.layout.autoregressive:
                yield self._read(self.layout.targets, start, stop, True), None
            else:
                yield (
                    self._read(self.layout.inputs, start, stop, False),
                    self._read(self.layout.targets, start, stop, False),
                )


class GroupReader(_LazyHdf5):
    """Validated, strided access to one PDEBench group-per-seed file: sample i is the i-th group in sorted order."""

    def __init__(self, path: str | Path, pde: str, spatial_stride: int = 1, temporal_stride: int = 1):
        self._setup(path, pde, "groups", spatial_stride, temporal_stride)
        self._check()

    def _check(self) -> None:
        # Metadata only: reading every lzf-compressed group up front would cost as much as a full pass.
        f = self.file
        self._keys = sorted(key for key in f if f.get(key, getclass=True) is h5py.Group)
        if not self._keys:
            raise DataError(
                f"{self.path}: no sample groups (keys: {sorted(f.keys())}); a {self.pde} file holds one group "
                "per seed ('0000', '0001', ...), each with a 'data' dataset"
            )
        d, c = self.layout.spatial_dims, self.layout.channels
        first = None
        for key in self._keys:
            # h5py's high-level wrappers cost ~0.3 ms per group; the low-level open is ~4x cheaper at 10000 groups.
            try:
                ds = h5py.h5d.open(f.id, f"{key}/data".encode())
            except KeyError:
                raise DataError(
                    f"{self.path}: group '{key}' has no 'data' dataset (keys: {sorted(f[key].keys())})"
                ) from None
            if ds.dtype.kind != "f":
                raise DataError(f"{self.path}: '{key}/data' must be floating-point, got {ds.dtype}")
            if first is None:
                if len(ds.shape) != 2 + d or ds.shape[-1] != c:
                    raise DataError(
                        f"{self.path}: '{key}/data' has shape {ds.shape}; a {self.pde} sample is "
                        f"[t, {d}D space, {c} channel(s)]"
                    )
                first = (key, ds.shape)
            elif ds.shape != first[1]:
                raise DataError(
                    f"{self.path}: '{key}/data' has shape {ds.shape} but '{first[0]}/data' has {first[1]}; "
                    "every group must share one shape"
                )
        self.n_samples = len(self._keys)
        self.raw_shape = first[1][:-1]
        self._check_stride()

    @property
    def group_names(self) -> list[str]:
        """The samples' group names, in sample order."""
        return list(self._keys)

    def coordinates(self) -> dict[str, list[float]]:
        """Strided coordinates from the first group's ``grid``; every seed shares one grid."""
        grid = self.file[self._keys[0]].get("grid")
        out = {}
        for axis in "xyz":
            if grid is not None and axis in grid:
                out[axis] = grid[axis][:: self.spatial_stride].astype(float).tolist()
        if grid is not None and "t" in grid:
            out["t"] = grid["t"][: self.raw_shape[0]][:: self.temporal_stride].astype(float).tolist()
        return out

    def block_size(self) -> int:
        per_sample = 4 * int(np.prod(self.raw_shape)) * self.layout.channels
        return max(1, READ_BLOCK_BYTES // per_sample)

    def _read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, self.n_frames, *self.grid, self.layout.channels), np.float32)
        for i in range(start, stop):
            key = self._keys[i]
            try:
                raw = self.file[key]["data"][()]
            except OSError as e:
                raise DataError(f"{self.path}: cannot read '{key}/data' (sample {i}): {e}") from None
            out[i - start] = self._stride(raw[None], True)[0]
            if not np.isfinite(out[i - start]).all():
                raise DataError(f"{self.path}: non-finite values (NaN/Inf) in 'data' at sample {i} (group '{key}')")
        return out

    def iter_blocks(self, samples: range) -> Iterator[tuple[np.ndarray, None]]:
        """Yield (inputs, None) blocks over a contiguous range of sorted groups."""
        step = self.block_size()
        for start in range(samples.start, samples.stop, step):
            yield self._read(start, min(start + step, samples.stop)), None


Reader = SingleFileReader | GroupReader


def pdebench_reader(path: str | Path, pde: str, spatial_stride: int = 1, temporal_stride: int = 1) -> Reader:
    """The reader of one PDEBench file for the family's storage style (``LAYOUTS[pde].style``)."""
    cls = GroupReader if LAYOUTS[pde].style == "groups" else SingleFileReader
    return cls(path, pde, spatial_stride, temporal_stride)


def _one_file(cls):
    def open_(paths: list[Path], task) -> Reader:
        if len(paths) != 1:
            raise DataError(f"a {task.pde} split is one file, got {len(paths)}: {[str(p) for p in paths]}")
        return cls(paths[0], task.pde, task.spatial_stride, task.temporal_stride)

    return open_


open_single = _one_file(SingleFileReader)
open_groups = _one_file(GroupReader)

SPLIT_NAMES = {"train": "Train", "val": "Valid", "test": "Test"}
"""Our split names -> PDEBench's, the {Split} of a template."""


def candidates(name: str, task, split: str) -> list[str]:
    """A split's file names under a folder or bucket, from the task's templates, in the order they are tried (the
    store refuses a name that climbs out of it)."""
    return [t.format(task=name, split=split, Split=SPLIT_NAMES[split]) for t in task.templates]


def locate(store, name: str, task, split: str) -> list[str]:
    """The first of the task's templates that names a file in the store, or []."""
    return next(([rel] for rel in candidates(name, task, split) if store.stat(rel) is not None), [])


looks_for = candidates


Place = tuple[str, int, tuple[int, ...]]
"""Where one field's float32 samples lie in a file: (file, byte offset, whole shape, samples first)."""


def plain_fields(path: Path, keys: tuple[str, ...], task) -> list[Place] | None:
    """Where each of ``keys`` lies in a single-file PDEBench dataset, when all are stored plain (contiguous,
    unfiltered, little-endian float32); None when one is not and the cache must copy."""
    layout, fields = LAYOUTS[task.pde], []
    with h5py.File(path, "r") as f:
        for key in keys:
            ds = f[key]
            plain = ds.chunks is None and ds.compression is None and ds.dtype == np.dtype("<f4")
            offset = ds.id.get_offset() if plain and ds.id.get_create_plist().get_nfilters() == 0 else None
            if offset is None:
                return None
            shape = ds.shape
            if not layout.autoregressive and len(shape) == 2 + layout.spatial_dims:
                shape = (shape[0], *shape[2:])  # Darcy's singleton time axis: the same bytes without it
            fields.append((str(path), int(offset), tuple(shape)))
    return fields


def open_hdf5(path: Path, fix: str = "re-create or re-download it") -> h5py.File:
    """``path`` opened for reading; a missing or unreadable file (a truncated download fails here too: h5py
    finds the end of the file before the superblock's size) is a DataError saying ``fix``."""
    if not path.is_file():
        raise DataError(f"data file '{path}' not found; {fix}")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path}: not a readable HDF5 file ({e}); {fix}") from None
