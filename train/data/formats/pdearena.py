"""PDEArena's Navier-Stokes 2D (smoke and buoyancy) HDF5 files: reading, locating and writing them (docs/pdearena.md).

One file per split and seed, ``NavierStokes2D_{train|valid|test}_{seed}_{buoyancy:.5f}[_{n}].h5``, whose root
group is the split word of its name. Under it, float64: ``u`` (smoke density), ``vx``, ``vy`` each
(n, nt, nx, ny); ``t`` (n, nt); ``x`` (n, nx); ``y`` (n, ny); ``dt``, ``dx``, ``dy``, ``buo_y`` (n,).

A split may be several files (one per seed): the reader concatenates their samples in the order given and
returns trajectories (n, t, nx', ny', 3) float32 with channels (u, vx, vy), the order of PDEArena's own reader
(``NavierStokesDatasetOpener``: the scalar field u, then the vector field (vx, vy)), unnormalised as there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from train.atomic import atomic_path
from train.config import TaskConfig
from train.data.formats.pdebench import Strided, fit_times, open_hdf5
from train.errors import DataError
from train.pdes import LAYOUTS

SPLIT_WORDS = {"train": "train", "val": "valid", "test": "test"}
"""The project's split name -> the word PDEArena puts in the file name and uses as the root group."""
FIELDS = LAYOUTS["pdearena_ns"].targets  # ("u", "vx", "vy"): the channels, in order
READ_BLOCK_BYTES = 64 << 20
FIX = "re-download the file, or re-generate it (train.data.acquire.generate_pdearena)"


def file_name(split: str, seed: int, buoyancy: float, n: int | None = None) -> str:
    """PDEArena's name of a split's file; its generator appends the sample count to train files only."""
    word = SPLIT_WORDS.get(split, split)
    if word not in SPLIT_WORDS.values():
        raise ValueError(f"split must be one of {sorted(SPLIT_WORDS)} or {sorted(SPLIT_WORDS.values())}, got {split!r}")
    name = f"NavierStokes2D_{word}_{seed}_{buoyancy:.5f}"
    return f"{name}_{n}.h5" if n is not None else f"{name}.h5"


def write_pdearena(path: str | Path, split: str, fields: dict[str, np.ndarray]) -> None:
    """Write ``fields`` as float64 datasets under the root group named by the split word, atomically.

    A complete file holds ``u``, ``vx``, ``vy`` (n, nt, nx, ny), ``t`` (n, nt), ``x`` (n, nx), ``y`` (n, ny) and
    ``dt``, ``dx``, ``dy``, ``buo_y`` (n,); exactly the keys given are written, so tests can make bad files.
    """
    word = SPLIT_WORDS.get(split, split)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        group = f.create_group(word)
        for key, value in fields.items():
            group.create_dataset(key, data=np.asarray(value, dtype=np.float64))


def _split_word(name: str) -> str | None:
    """The split word a file name carries, as PDEArena's filters test it (a substring); None if none or several."""
    words = [w for w in SPLIT_WORDS.values() if w in name]
    return words[0] if len(words) == 1 else None


def locate_pdearena(store, task: TaskConfig, split: str) -> list[str]:
    """The names of one split's files in ``store``: the configured train/test file when set (if the store has
    it), else every ``.h5`` file in the root whose file name contains the split word, sorted; [] when none."""
    if split not in SPLIT_WORDS:
        raise ValueError(f"split must be one of {sorted(SPLIT_WORDS)}, got {split!r}")
    configured = {"train": "train_file", "test": "test_file"}.get(split)
    name = getattr(task.files, configured, None) if configured and task.files is not None else None
    if name is not None:
        return [name] if store.stat(name) is not None else []
    word = SPLIT_WORDS[split]
    return sorted(n for n in store.list("") if n.endswith(".h5") and word in n.rsplit("/", 1)[-1])


def _root_group(f: h5py.File, path: Path) -> str:
    """The split group of a file: the one its name names, or the only split-named group of a renamed file."""
    groups = sorted(k for k in f if f.get(k, getclass=True) is h5py.Group)
    word = _split_word(path.name)
    candidates = [word] if word is not None else [w for w in SPLIT_WORDS.values() if w in groups]
    if len(candidates) == 1 and candidates[0] in groups:
        return candidates[0]
    wanted = f"'{word}'" if word is not None else "named train, valid or test"
    raise DataError(
        f"{path}: no root group {wanted} (root keys: {sorted(f.keys())}); a PDEArena file holds its datasets under "
        "the group named by the split word of its file name: rename the file to match its group, or " + FIX
    )


class PdeArenaReader(Strided):
    """One split's PDEArena Navier-Stokes files, validated, strided and read in blocks (the reader seam)."""

    std_floor = None  # unnormalised in PDEArena; a constant channel keeps its scale, as for PDEBench
    block_bytes = READ_BLOCK_BYTES

    def __init__(self, paths: list[Path], spatial_stride: int = 1, temporal_stride: int = 1):
        if not paths:
            raise DataError("a PDEArena split needs at least one file; none were found (check the task's source)")
        self.paths = [Path(p) for p in paths]
        self.path = self.paths[0]
        self.spatial_stride = spatial_stride
        self.temporal_stride = temporal_stride
        self._handle: tuple[int, h5py.File] | None = None
        self._groups: list[str] = []
        self._counts: list[int] = []
        first: tuple[Path, tuple[int, ...]] | None = None
        for i, path in enumerate(self.paths):
            group, shape = self._check(i)
            self._groups.append(group)
            self._counts.append(shape[0])
            if first is None:
                first = (path, shape[1:])
            elif shape[1:] != first[1]:
                raise DataError(
                    f"{path}: '{group}/u' is (n, nt, nx, ny) = {shape}, but {first[0]} has (nt, nx, ny) = {first[1]}; "
                    "the files of one split must share grid and frames: list only files of one dataset"
                )
        self.raw_shape = first[1]  # (nt, nx, ny) before striding
        self.n_samples = sum(self._counts)
        for n in self.raw_shape[1:]:
            if n < spatial_stride:
                raise DataError(
                    f"{self.path}: spatial_stride {spatial_stride} exceeds the grid {self.raw_shape[1:]} of 'u', "
                    "'vx', 'vy'; lower the task's spatial_stride"
                )

    def _file(self, i: int) -> h5py.File:
        # h5py handles cannot cross fork(): opened on first use, in whichever process uses them. One file is open
        # at a time: a split of many seeds would otherwise hold a handle per file; blocks run file by file.
        if self._handle is None or self._handle[0] != i:
            self.close()
            self._handle = (i, open_hdf5(self.paths[i], FIX))
        return self._handle[1]

    def _check(self, i: int) -> tuple[str, tuple[int, ...]]:
        """The split group and the common (n, nt, nx, ny) of u, vx and vy in file i."""
        path, f = self.paths[i], self._file(i)
        group = _root_group(f, path)
        shapes = {}
        for key in FIELDS:
            ds = f[group].get(key)
            if not isinstance(ds, h5py.Dataset):
                raise DataError(
                    f"{path}: dataset '{group}/{key}' not found (keys of '{group}': {sorted(f[group].keys())}); "
                    f"a PDEArena Navier-Stokes file holds {list(FIELDS)}: {FIX}"
                )
            if ds.dtype.kind != "f":
                raise DataError(f"{path}: '{group}/{key}' must be floating-point, got {ds.dtype}; {FIX}")
            if ds.ndim != 4:
                raise DataError(
                    f"{path}: '{group}/{key}' has shape {ds.shape}, {ds.ndim} axes; a PDEArena field is "
                    f"(sample, t, x, y), 4 axes: {FIX}"
                )
            shapes[key] = ds.shape
        if len(set(shapes.values())) != 1:
            raise DataError(f"{path}: '{group}/u', 'vx', 'vy' must share one shape, got {shapes}; {FIX}")
        return group, shapes["u"]

    def close(self) -> None:
        """Close the open file, if any (files reopen on the next read)."""
        if self._handle is not None:
            self._handle[1].close()
            self._handle = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handle": None}

    def describe(self) -> dict:
        """The channel names, for the cache manifest."""
        return {"channels": list(FIELDS)}

    def coordinates(self) -> dict[str, list[float]]:
        """Strided x, y and t of the first sample of the first file (PDEArena stores them per sample)."""
        f, group = self._file(0), self._groups[0]
        if self._counts[0] == 0:
            return {}
        out = {}
        wanted = {"x": (self.raw_shape[1], self.spatial_stride), "y": (self.raw_shape[2], self.spatial_stride)}
        wanted["t"] = (self.raw_shape[0], self.temporal_stride)
        for key, (n, stride) in wanted.items():
            ds = f[group].get(key)
            if ds is None:
                continue
            if ds.ndim != 2 or ds.shape[1] != n:
                raise DataError(
                    f"{self.path}: '{group}/{key}' has shape {ds.shape}; it should be (sample, {n}) to match "
                    f"'{group}/u' {(self._counts[0], *self.raw_shape)}: {FIX}"
                )
            out[key] = ds[0][::stride].astype(float).tolist()
        return out

    def block_size(self) -> int:
        """Samples per block: the float32 output and one field's float64 read each stay within block_bytes."""
        nt, nx, ny = self.raw_shape
        out = 4 * self.n_frames * int(np.prod(self.grid)) * len(FIELDS)
        raw = 8 * nt * nx * ny
        return max(1, self.block_bytes // max(out, raw, 1))

    def parts(self, samples: range) -> Iterator[dict[str, np.ndarray]]:
        """Blocks {"": (n, t, nx', ny', 3) float32} of consecutive samples of ``samples``, in order; a block never
        spans two files."""
        if samples.step != 1:
            raise ValueError(f"samples must be a contiguous range, got {samples}")
        if samples.start < 0 or samples.stop > self.n_samples:
            raise DataError(f"{self.path}: samples {samples} outside the split's {self.n_samples} samples")
        step, offset = self.block_size(), 0
        for i, count in enumerate(self._counts):
            lo, hi = max(samples.start, offset), min(samples.stop, offset + count)
            for start in range(lo, hi, step):
                stop = min(start + step, hi)
                yield {"": self._read(i, start - offset, stop - offset)}
            offset += count

    def _read(self, i: int, start: int, stop: int) -> np.ndarray:
        """Samples start..stop of file i (local indices), strided, channels last."""
        path, group = self.paths[i], self._groups[i]
        s, ts = self.spatial_stride, self.temporal_stride
        out = np.empty((stop - start, self.n_frames, *self.grid, len(FIELDS)), np.float32)
        for c, key in enumerate(FIELDS):
            try:
                # One contiguous read per field, strided in memory: h5py's strided selections are far slower.
                block = self._file(i)[group][key][start:stop]
            except OSError as e:
                raise DataError(f"{path}: cannot read '{group}/{key}' samples {start}..{stop} ({e}); {FIX}") from None
            out[..., c] = block[:, ::ts, ::s, ::s]
        finite = np.isfinite(out).reshape(len(out), -1).all(axis=1)
        if not finite.all():
            bad = int(np.argmin(finite))
            key = next(k for c, k in enumerate(FIELDS) if not np.isfinite(out[bad, ..., c]).all())
            raise DataError(f"{path}: non-finite values (NaN/Inf) in '{group}/{key}' at sample {start + bad}; {FIX}")
        return out


def open_pdearena(paths: list[Path], task: TaskConfig) -> PdeArenaReader:
    """The reader of one split's PDEArena files (one per seed), samples concatenated in the given order."""
    return PdeArenaReader([Path(p) for p in paths], task.spatial_stride, task.temporal_stride)


def write_predictions(path: Path, reader: PdeArenaReader, inputs: np.ndarray, outputs: np.ndarray) -> None:
    """A rollout in PDEArena's layout under the input's root group (its split word): ``u``, ``vx``, ``vy`` (n, nt,
    nx, ny), the initial frames first, and every other dataset of the input files as it was (float64): ``x``,
    ``y`` and ``t`` per sample, ``dt``, ``dx``, ``dy`` and ``buo_y``. At a run's strides the coordinates are
    strided as the run read the fields and the spacings scaled; ``t`` is fitted to the frames written (extended at
    its last spacing when the rollout goes beyond the input's frames)."""
    s, ts, frames = reader.spatial_stride, reader.temporal_stride, outputs.shape[1]
    fields = {key: outputs[..., i] for i, key in enumerate(FIELDS)}
    others: dict[str, list[np.ndarray]] = {}
    for i in range(len(reader.paths)):
        group = reader._file(i)[reader._groups[i]]
        for key, ds in group.items():
            if key not in fields and isinstance(ds, h5py.Dataset):
                others.setdefault(key, []).append(ds[()])
    scale = {"x": (1, s), "y": (1, s), "t": (1, ts), "dx": (s, 1), "dy": (s, 1), "dt": (ts, 1)}
    for key, parts in others.items():
        if len(parts) != len(reader.paths):
            continue  # not in every file of the split: not a dataset of the samples written
        value = np.concatenate([np.atleast_1d(p) for p in parts])
        factor, stride = scale.get(key, (1, 1))
        if stride > 1 and value.ndim == 2:
            value = value[:, ::stride]
        if key == "t" and value.ndim == 2:
            value = np.stack([fit_times(row, frames) for row in value])
        fields[key] = value * factor if factor != 1 else value
    write_pdearena(path, reader._groups[0], fields)
