"""Generic arrays (pde: arrays): a solver's own output as it writes it, in HDF5, ``.npy`` or ``.npz`` files.

A split is one file holding trajectories ``(N, T, *X, C)`` (channels last) or ``(N, T, C, *X)`` (channels first),
or steady pairs ``(N, *X, C_in)`` -> ``(N, *X, C_out)`` under two keys, with 1 to 3 spatial axes and any number
of channels. What the arrays do not say, the task's ``arrays`` settings and ``fields`` / ``periodic`` do, or the
file's own attributes (HDF5 root attributes; arrays of those names in an ``.npz``): ``order``, ``fields``,
``periodic``, ``extent``, ``dt``. Where the file and the config both say, they must agree: a disagreement is a
DataError (exit 3) naming the file, the attribute and the setting. docs/arrays.md is the user's page.

A channels-last float32 array stored plainly (an uncompressed, contiguous HDF5 dataset, or a ``.npy`` file) is
mapped in place by the cache: each channel a field of the one array (train.data.cache.in_place).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from train.config import TaskConfig
from train.errors import DataError
from train.pdes import PERIODIC

READ_BLOCK_BYTES = 64 << 20
ATTRIBUTES = ("order", "fields", "periodic", "extent", "dt")
"""What a file may say of itself, as HDF5 root attributes or .npz arrays of these names."""
AXES = "xyz"
FIX = "fix the file or the task's arrays settings (docs/arrays.md)"


def _plain(value):
    """An attribute as Python values: strings decoded, arrays as lists, numpy scalars as numbers."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.ndim else _plain(value.item())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


class ArraysReader:
    """One split: one file, its arrays checked against what the task and the file say before anything is read."""

    std_floor = None  # a constant channel keeps its scale, as for PDEBench files

    def __init__(self, path: Path, task: TaskConfig):
        self.path, settings = Path(path), task.arrays
        self.suffix = self.path.suffix.lower()
        self.steady = settings.steady
        self.keys = (settings.input_key, settings.target_key) if self.steady else (settings.key,)
        self.spatial_stride = task.spatial_stride
        self.temporal_stride = 1 if self.steady else task.temporal_stride
        self._file: h5py.File | None = None
        self._npz: dict[str, np.ndarray] | None = None
        said = self._attributes()
        self.order = self._agree("order", settings.order, said, "tasks.<name>.arrays.order") or "channels_last"
        if self.order not in ("channels_last", "channels_first"):
            raise DataError(f"{self.path}: attribute order={self.order!r}: channels_last or channels_first; {FIX}")
        self.shapes = {key: self._shape(key) for key in self.keys}
        self._check_shapes()
        self.names = self._agree("fields", task.fields, said, "tasks.<name>.fields")
        self._check_names()
        self.periodic = self._agree(
            "periodic", _flags(task.periodic, len(self.raw_grid)), said, "tasks.<name>.periodic"
        )
        self.extent = self._agree("extent", settings.extent, said, "tasks.<name>.arrays.extent")
        self.dt = self._agree("dt", settings.dt, said, "tasks.<name>.arrays.dt")
        self._said = said

    # ------------------------------------------------------------------------------------------ metadata
    def _attributes(self) -> dict:
        if self.suffix == ".npy":
            return {}
        if self.suffix == ".npz":
            return {key: _plain(value) for key, value in self._arrays().items() if key in ATTRIBUTES}
        return {key: _plain(value) for key, value in self.file.attrs.items() if key in ATTRIBUTES}

    def _agree(self, name: str, setting, said: dict, where: str):
        """The value both the config and the file give (they must be equal), else whichever gives one."""
        if name not in said:
            return setting
        theirs = said[name]
        if setting is not None and _normal(setting) != _normal(theirs):
            raise DataError(
                f"{self.path}: attribute {name}={theirs!r} contradicts {where}={setting!r}; the file and the config "
                f"must agree: remove the setting or {FIX}"
            )
        return theirs

    def _shape(self, key: str) -> tuple[int, ...]:
        if self.suffix == ".npy":
            if self.steady:
                raise DataError(f"{self.path}: steady pairs are two arrays: write them to an .npz or HDF5 file")
            return tuple(self._npy().shape)
        arrays = self._arrays() if self.suffix == ".npz" else self.file
        if key not in arrays or not hasattr(arrays[key], "shape"):
            present = sorted(k for k in arrays if k not in ATTRIBUTES)
            raise DataError(f"{self.path}: no array '{key}' (arrays: {present}); {FIX}")
        dtype = arrays[key].dtype
        if dtype.kind not in "fiu":
            raise DataError(f"{self.path}: '{key}' holds {dtype}, not numbers; {FIX}")
        return tuple(int(n) for n in arrays[key].shape)

    def _check_shapes(self) -> None:
        leading = 1 if self.steady else 2  # N, or N and T
        form = "(N, *X, C)" if self.steady else "(N, T, *X, C)"
        if self.order == "channels_first":
            form = "(N, C, *X)" if self.steady else "(N, T, C, *X)"
        for key, shape in self.shapes.items():
            if not leading + 2 <= len(shape) <= leading + 4:
                raise DataError(
                    f"{self.path}: '{key}' has shape {shape}; a {'steady' if self.steady else 'time-dependent'} task "
                    f"needs {form} ({self.order}) with 1 to 3 spatial axes X and a channel axis C, even for one "
                    f"channel; {FIX}"
                )
            if 0 in shape:
                raise DataError(f"{self.path}: '{key}' has shape {shape}: no data; {FIX}")
        grids = {key: self._split_shape(shape) for key, shape in self.shapes.items()}
        first = self.keys[0]
        self.n_samples, self.raw_frames, self.raw_grid, _ = grids[first]
        for key in self.keys[1:]:
            n, _, grid, _ = grids[key]
            if (n, grid) != (self.n_samples, self.raw_grid):
                raise DataError(
                    f"{self.path}: '{first}' holds {self.n_samples} samples on grid {self.raw_grid}, '{key}' {n} on "
                    f"{grid}; inputs and targets pair sample for sample on one grid; {FIX}"
                )
        self.channels = {key: grids[key][3] for key in self.keys}
        if any(n < self.spatial_stride for n in self.raw_grid):
            raise DataError(f"{self.path}: spatial_stride {self.spatial_stride} exceeds the grid {self.raw_grid}")

    def _split_shape(self, shape: tuple[int, ...]) -> tuple[int, int, tuple[int, ...], int]:
        """(samples, frames, grid, channels) of an array's shape in the file's order."""
        n, rest = shape[0], list(shape[1:])
        frames = 1 if self.steady else rest.pop(0)
        channels = rest.pop(-1 if self.order == "channels_last" else 0)
        return n, frames, tuple(rest), channels

    def _check_names(self) -> None:
        count = sum(self.channels.values())
        if self.names is not None and len(self.names) != count:
            detail = " + ".join(f"'{key}' {n}" for key, n in self.channels.items())
            raise DataError(
                f"{self.path}: {len(self.names)} field name(s) {list(self.names)} for {count} channel(s) ({detail}, "
                f"{self.order}); give one name per channel, in order; {FIX}"
            )

    # ------------------------------------------------------------------------------------------ geometry
    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(len(range(0, n, self.spatial_stride)) for n in self.raw_grid)

    @property
    def n_frames(self) -> int:
        return 1 if self.steady else len(range(0, self.raw_frames, self.temporal_stride))

    # ------------------------------------------------------------------------------------------- reading
    # h5py handles cannot cross fork(): open on first use, in whichever process uses it.
    @property
    def file(self) -> h5py.File:
        if self._file is None:
            try:
                self._file = h5py.File(self.path, "r")
            except OSError as e:
                raise DataError(f"{self.path}: not a readable HDF5 file, truncated or damaged ({e}); {FIX}") from None
        return self._file

    def _arrays(self) -> dict[str, np.ndarray]:
        if self._npz is None:
            try:
                with np.load(self.path, allow_pickle=False) as archive:
                    self._npz = {key: archive[key] for key in archive.files}
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
                raise DataError(f"{self.path}: not a readable .npz file, truncated or damaged ({e}); {FIX}") from None
        return self._npz

    def _npy(self) -> np.ndarray:
        try:
            return np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{self.path}: not a readable .npy file, truncated or damaged ({e}); {FIX}") from None

    def _source(self, key: str):
        if self.suffix == ".npy":
            return self._npy()
        return self._arrays()[key] if self.suffix == ".npz" else self.file[key]

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        """Samples start..stop of ``key``, strided, float32, channels last: (n, t, *grid, c) or (n, *grid, c)."""
        s, dims = self.spatial_stride, len(self.raw_grid)
        space = [slice(None, None, s)] * dims
        channel_last = self.order == "channels_last"
        index = [slice(start, stop)] + ([] if self.steady else [slice(None, None, self.temporal_stride)])
        index += [*space, slice(None)] if channel_last else [slice(None), *space]
        try:
            block = np.asarray(self._source(key)[tuple(index)])
        except OSError as e:
            raise DataError(f"{self.path}: cannot read '{key}' samples {start}..{stop} ({e}); {FIX}") from None
        if not channel_last:
            block = np.moveaxis(block, 1 if self.steady else 2, -1)
        out = np.ascontiguousarray(block, dtype=np.float32)
        if not np.isfinite(out).all():
            bad = start + int(np.argwhere(~np.isfinite(out))[0][0])
            raise DataError(f"{self.path}: non-finite values (NaN/Inf) in '{key}' at sample {bad}; {FIX}")
        return out

    def parts(self, samples: range) -> Iterator[dict[str, np.ndarray]]:
        per_sample = 4 * int(np.prod(self.grid)) * self.n_frames * sum(self.channels.values())
        step = max(1, READ_BLOCK_BYTES // per_sample)
        for start in range(samples.start, samples.stop, step):
            stop = min(start + step, samples.stop)
            if self.steady:
                yield {"x": self._read(self.keys[0], start, stop), "y": self._read(self.keys[1], start, stop)}
            else:
                yield {"": self._read(self.keys[0], start, stop)}

    def coordinates(self) -> dict[str, list[float]]:
        """Each axis's points from ``extent`` (spacing L/n on a periodic axis, L/(n-1) on another) and the times
        from ``dt``, strided as the run reads them; unit length and unit steps where nothing says."""
        extent = list(self.extent) if self.extent is not None else [1.0] * len(self.raw_grid)
        periodic = self.periodic or [False] * len(self.raw_grid)
        out = {}
        for axis, (n, length, wraps) in enumerate(zip(self.raw_grid, extent, periodic, strict=False)):
            spacing = length / (n if wraps else max(n - 1, 1))
            out[AXES[axis]] = (np.arange(n)[:: self.spatial_stride] * spacing).tolist()
        if not self.steady:
            out["t"] = (np.arange(self.raw_frames)[:: self.temporal_stride] * (self.dt or 1.0)).tolist()
        return out

    def describe(self) -> dict:
        """The channels' names (a steady task's inputs, then its outputs) and, where the file says, which axes
        wrap around (boundary codes, as a Well file's)."""
        if self.names is not None:
            names = list(self.names)
        else:
            names = [name for key in self.keys for name in _default_names(key, self.channels[key])]
        described: dict = {"channels": names}
        if self.periodic is not None and "periodic" in self._said:  # the file's own record: the config must agree
            described["boundary"] = [[PERIODIC, PERIODIC] if wraps else [0, 0] for wraps in self.periodic]
        return described

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._npz = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None, "_npz": None}


def _flags(periodic, dims: int):
    """tasks.<name>.periodic as one flag per axis (None stays None)."""
    if periodic is None or isinstance(periodic, list):
        return periodic
    return [bool(periodic)] * dims


def _normal(value):
    """A value compared as data: numbers as floats, sequences as lists."""
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    if isinstance(value, bool | str) or value is None:
        return value
    return float(value)


def _default_names(key: str, channels: int) -> list[str]:
    return [key] if channels == 1 else [f"{key}_{i}" for i in range(channels)]


def open_arrays(paths: list[Path], task: TaskConfig) -> ArraysReader:
    """The reader of one split: exactly one file."""
    if len(paths) != 1:
        raise DataError(
            f"a split of generic arrays is one file, got {len(paths)}: {[str(p) for p in paths]}; name one file in "
            "the task's files.train_file / val_file / test_file"
        )
    return ArraysReader(Path(paths[0]), task)


def locate_arrays(store, task: TaskConfig, split: str) -> list[str]:
    """The split's file in ``store`` as the task's ``files`` name it; [] where it names none or the store lacks it."""
    name = {"train": task.files.train_file, "val": task.files.val_file, "test": task.files.test_file}.get(split)
    return [name] if name and store.stat(name) is not None else []


def plain_channels(path: Path, keys: tuple[str, ...], task: TaskConfig) -> list[tuple] | None:
    """Each channel of the one array ``keys`` names as a field in place, when that array is channels-last plain
    little-endian float32 (a contiguous, unfiltered HDF5 dataset, or a .npy file); None: the cache copies."""
    if len(keys) != 1 or task.arrays.order == "channels_first":
        return None
    suffix = Path(path).suffix.lower()
    if suffix == ".npy":
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        if array.dtype != np.dtype("<f4") or not array.flags.c_contiguous:
            return None
        offset, shape = array.offset, array.shape
    elif suffix in (".h5", ".hdf5", ".hdf"):
        with h5py.File(path, "r") as f:
            if f.attrs.get("order", b"channels_last") not in ("channels_last", b"channels_last"):
                return None
            ds = f[keys[0]]
            plain = ds.chunks is None and ds.compression is None and ds.dtype == np.dtype("<f4")
            offset = ds.id.get_offset() if plain and ds.id.get_create_plist().get_nfilters() == 0 else None
            if offset is None:
                return None
            shape = ds.shape
    else:
        return None
    return [(str(path), int(offset), tuple(shape), channel) for channel in range(shape[-1])]


def parts_keys(task: TaskConfig) -> dict[str, tuple[str, ...]]:
    """The cache's parts and the array each is read from."""
    settings = task.arrays
    return {"x": (settings.input_key,), "y": (settings.target_key,)} if settings.steady else {"": (settings.key,)}


def write_predictions(path: Path, reader: ArraysReader, inputs: np.ndarray, outputs: np.ndarray) -> None:
    """``predict``'s output as the input is laid out: an HDF5 file with the predictions under the input's key (the
    target key for steady pairs) in its channel order, and the attributes the input file and task said."""
    key = reader.keys[-1]
    values = outputs if reader.order == "channels_last" else np.moveaxis(outputs, -1, 1 if reader.steady else 2)
    with h5py.File(path, "w") as f:
        f.create_dataset(key, data=np.ascontiguousarray(values, dtype=np.float32))
        f.attrs["order"] = reader.order
        for name in ("fields", "periodic", "extent", "dt"):
            value = getattr(reader, "names" if name == "fields" else name)
            if value is not None:
                f.attrs[name] = value
