"""Readers for PDEBench's single-file HDF5 style (see PDEBENCH.md section 1A).

Everything is returned channels-last: autoregressive fields as (n, t, *space, c), steady (Darcy) pairs as
(n, *space, c). Files are opened lazily and read in contiguous blocks of samples: one h5py call per block
is far faster than one per sample for PDEBench's unchunked datasets.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from train.errors import DataError

READ_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class Layout:
    """Which HDF5 keys hold a family's fields and how a sample is formed from them."""

    inputs: tuple[str, ...]
    targets: tuple[str, ...]
    spatial_dims: int
    autoregressive: bool


LAYOUTS = {
    "advection1d": Layout(("tensor",), ("tensor",), 1, True),
    "burgers1d": Layout(("tensor",), ("tensor",), 1, True),
    "darcy2d": Layout(("nu",), ("tensor",), 2, False),
    "cfd1d": Layout(("density", "pressure", "Vx"), ("density", "pressure", "Vx"), 1, True),
    "cfd2d": Layout(("density", "pressure", "Vx", "Vy"), ("density", "pressure", "Vx", "Vy"), 2, True),
}

SPLITS = ("train", "val", "test")


def split_ranges(n: int, test_fraction: float, val_fraction: float) -> dict[str, range]:
    """PDEBench's single-file convention: test is the FIRST share of samples; val follows; train is the rest."""
    n_test = max(1, round(n * test_fraction))
    n_val = round(n * val_fraction)
    if n - n_test - n_val < 1:
        raise DataError(f"{n} samples are too few to split into test={n_test}, val={n_val} and a training set")
    return {
        "test": range(0, n_test),
        "val": range(n_test, n_test + n_val),
        "train": range(n_test + n_val, n),
    }


class SingleFileReader:
    """Validated, strided access to one PDEBench single-file dataset."""

    def __init__(self, path: str | Path, pde: str, spatial_stride: int = 1, temporal_stride: int = 1):
        self.path = Path(path)
        self.layout = LAYOUTS[pde]
        self.pde = pde
        self.spatial_stride = spatial_stride
        self.temporal_stride = temporal_stride if self.layout.autoregressive else 1
        self._file: h5py.File | None = None
        self._check()

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
        space = self.raw_shape[1:]
        for n in space:
            if n < self.spatial_stride:
                raise DataError(f"{self.path}: spatial stride {self.spatial_stride} exceeds the grid {space}")

    @property
    def grid(self) -> tuple[int, ...]:
        """Spatial grid after striding."""
        return tuple(len(range(0, n, self.spatial_stride)) for n in self.raw_shape[1:])

    @property
    def n_frames(self) -> int:
        return len(range(0, self.raw_shape[0], self.temporal_stride)) if self.layout.autoregressive else 1

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

    def _stride(self, block: np.ndarray, has_time: bool) -> np.ndarray:
        index = [slice(None)]
        if has_time:
            index.append(slice(None, None, self.temporal_stride))
        index += [slice(None, None, self.spatial_stride)] * self.layout.spatial_dims
        return block[tuple(index)]

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
        out = np.stack(fields, axis=-1)
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


def open_hdf5(path: Path) -> h5py.File:
    if not path.is_file():
        raise DataError(f"data file '{path}' not found")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path}: not a readable HDF5 file ({e}); re-create or re-download it") from None
