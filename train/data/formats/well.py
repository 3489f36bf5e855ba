"""The Well's HDF5 schema (docs/well.md): one split is a folder of files, each holding some trajectories.

Read as The Well's own ``WellDataset`` reads it: files in sorted path order, then trajectories in file order;
tensor fields flattened to channels (``velocity_x, velocity_y``; ``stress_xx, stress_xy, ...`` in
``itertools.product(spatial_dims, repeat=order)`` order), t0 then t1 then t2 fields, each group in its
``field_names`` order. Time-varying fields are the trajectory channels; fields constant in time and scalars
constant in time are the constant channels (fields first, then scalars, broadcast over the grid). Boundary
conditions become codes WALL=0, OPEN=1, PERIODIC=2 per axis and side, OPEN where no group says otherwise.

Every file is checked against the schema before a byte of data is read, and the files of a split against each
other; a violation is a DataError naming the file, the group or key, and the rule.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from train.data.formats.pdebench import READ_BLOCK_BYTES, open_hdf5
from train.errors import DataError

BOUNDARY_CODES = {"WALL": 0, "OPEN": 1, "PERIODIC": 2}
ROOT_ATTRIBUTES = ("dataset_name", "grid_type", "n_spatial_dims", "n_trajectories", "simulation_parameters")
FIELD_GROUPS = ("t0_fields", "t1_fields", "t2_fields")
STD_FLOOR = 1e-4
"""The Well's floor on a normalising standard deviation (its ZScoreNormalization's min_denom)."""


FOLDERS = {"train": "train", "val": "valid", "test": "test"}
"""Our split names -> The Well's folders under ``<dataset>/data/``."""
HDF5_SUFFIXES = (".h5", ".hdf5")


def locate(store, name: str, task, split: str) -> list[str]:
    """Every .hdf5/.h5 file of the split's folder, ``data/<train|valid|test>/``."""
    return [n for n in store.list(f"data/{FOLDERS[split]}") if n.lower().endswith(HDF5_SUFFIXES)]


def looks_for(name: str, task, split: str) -> list[str]:
    return [f"data/{FOLDERS[split]}/*.hdf5"]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _names(value) -> list[str]:
    return [_text(v) for v in np.atleast_1d(value)] if value is not None else []


AGREE = {
    "name": "dataset_name {} differs",
    "dims": "spatial dims {} differ",
    "sizes": "resolution {} differs",
    "n_time": "number of time steps {} differs",
    "fields": "fields (group, name, time-varying) {} differ",
    "scalars": "constant scalars, in order, {} differ",
    "boundary": "boundary conditions ([lower, upper] per axis: WALL=0, OPEN=1, PERIODIC=2) {} differ",
}
"""What every file of a dataset must share (a file that differs would be read with another file's channels,
boundary codes or scalars), and how each is named in a message."""


def _signature(info: dict) -> dict:
    return {
        "name": info["name"],
        "dims": info["dims"],
        "sizes": info["sizes"],
        "n_time": info["n_time"],
        "fields": [(fl.group, fl.name, fl.time_varying) for fl in info["fields"]],
        "scalars": [s.name for s in info["scalars"] if not s.time_varying],
        "boundary": info["boundary"],
    }


def _same_dataset(path: Path, theirs: dict, first: Path, ours: dict, what: str) -> None:
    for key, words in AGREE.items():
        if theirs[key] != ours[key]:
            raise DataError(
                f"{path}: {words.format(theirs[key])} from {ours[key]} in {first}; all files of a {what} must come "
                "from one dataset (replace the file, or move it out of the dataset's folder)"
            )


def check_splits_agree(splits: dict[str, list[Path]]) -> None:
    """Every file of every split against the train split's first file (the data stage's check: a test file of
    another dataset or boundary would otherwise be scored with train's channels and codes). DataError names both
    files and what differs."""
    readers = {split: WellReader(paths) for split, paths in splits.items() if paths}
    try:
        train = readers["train"]
        for split, reader in readers.items():
            if split != "train":
                _same_dataset(
                    reader.path,
                    _signature(reader.files_info[0]),
                    train.path,
                    _signature(train.files_info[0]),
                    "dataset's splits",
                )
    finally:
        for reader in readers.values():
            reader.close()


class _Field:
    """One dataset of a field or scalar group, with its flags and the channels it flattens to."""

    def __init__(self, path: Path, group: str, name: str, ds: h5py.Dataset, order: int, dims: list[str]):
        where = f"{path}: '{group}/{name}'"
        flags = ("sample_varying", "time_varying") + (("dim_varying",) if group != "scalars" else ())
        for flag in flags:
            if flag not in ds.attrs:
                raise DataError(
                    f"{where} lacks the attribute '{flag}' (The Well's schema requires it on every {group[:-1]})"
                )
        self.name, self.group, self.order = name, group, order
        self.sample_varying = bool(ds.attrs["sample_varying"])
        self.time_varying = bool(ds.attrs["time_varying"])
        self.dim_varying = [bool(v) for v in np.atleast_1d(ds.attrs["dim_varying"])] if group != "scalars" else []
        if group != "scalars" and len(self.dim_varying) != len(dims):
            raise DataError(f"{where}: dim_varying has {len(self.dim_varying)} entries for {len(dims)} spatial dims")
        if ds.dtype.kind != "f":
            raise DataError(f"{where} must be floating-point, got {ds.dtype}")
        self.shape = ds.shape
        self.channels = [f"{name}_{''.join(c)}" if order else name for c in itertools.product(dims, repeat=order)]

    def check_shape(self, path: Path, n_traj: int, n_time: int, sizes: list[int]) -> None:
        """The schema's rule: [B if sample_varying] + [T if time_varying] + [N_i per dim_varying axis] + [d]*order;
        an axis that does not vary may also be stored as a singleton (as The Well's reader expects)."""
        lead = [n_traj] * self.sample_varying + [n_time] * self.time_varying
        tail = [len(sizes)] * self.order
        omitted = [n for n, v in zip(sizes, self.dim_varying, strict=True) if v]
        singleton = [n if v else 1 for n, v in zip(sizes, self.dim_varying, strict=True)]
        allowed = {tuple(lead + omitted + tail), tuple(lead + singleton + tail)}
        if self.shape not in allowed:
            flags = f"sample_varying={self.sample_varying}, time_varying={self.time_varying}"
            if self.group != "scalars":
                flags += f", dim_varying={self.dim_varying}"
            want = " or ".join(str(s) for s in sorted(allowed))
            raise DataError(
                f"{path}: '{self.group}/{self.name}' has shape {self.shape}, which contradicts its flags ({flags}); "
                f"the schema wants {want}"
            )

    def read(self, f: h5py.File, start: int, stop: int, n_time: int, grid: list[int]) -> np.ndarray:
        """Trajectories start..stop as (b, [T,] *grid, components) float32, broadcast where the field does not vary."""
        ds = f[self.group][self.name]
        data = np.asarray(ds[start:stop] if self.sample_varying else ds[()][None], dtype=np.float32)
        b, d = stop - start, len(grid)
        if self.group == "scalars":  # constant in time: one value per trajectory, over the whole grid
            return np.broadcast_to(data.reshape(data.shape[0], *([1] * d), 1), (b, *grid, 1))
        time = [n_time] if self.time_varying else []
        spatial = [n if v else 1 for n, v in zip(grid, self.dim_varying, strict=True)]
        data = data.reshape(data.shape[0], *time, *spatial, *([d] * self.order))
        data = np.broadcast_to(data, (b, *time, *grid, *([d] * self.order)))
        return data.reshape(b, *time, *grid, -1)


class WellReader:
    """One split of a Well dataset: its files (sorted as The Well sorts them), checked, read in blocks of
    trajectories; ``parts`` yields "" (the time-varying channels) and "const" (the constant channels)."""

    std_floor = STD_FLOOR  # the reader seam's rule for a normalising std

    def __init__(self, paths: list[Path], spatial_stride: int = 1):
        if not paths:
            raise DataError("a Well split needs at least one .hdf5 file")
        self.paths = sorted((Path(p) for p in paths), key=lambda p: str(p.absolute()))
        self.path = self.paths[0]
        self.spatial_stride = spatial_stride
        self._files: dict[Path, h5py.File] = {}
        self.files_info = [self._check(p) for p in self.paths]
        self._check_consistent()
        first = self.files_info[0]
        self.dataset_name, self.spatial_dims, self.raw_grid = first["name"], first["dims"], first["sizes"]
        self.fields = first["fields"]
        self.channels = [c for fld in self.fields if fld.time_varying for c in fld.channels]
        const = [fld for fld in self.fields if not fld.time_varying]
        scalars = [s for s in first["scalars"] if not s.time_varying]
        self.constant_channels = [c for fld in const for c in fld.channels] + [s.name for s in scalars]
        self.constant_scalars = [s.name for s in scalars]
        self.counts = [info["n_traj"] for info in self.files_info]
        self.n_samples = sum(self.counts)
        self.n_frames = first["n_time"]
        self.boundary = first["boundary"]
        if not self.channels:
            raise DataError(
                f"{self.path}: no time-varying field in t0_fields, t1_fields or t2_fields; nothing to predict"
            )
        for n in self.raw_grid:
            if n < spatial_stride:
                raise DataError(f"{self.path}: spatial stride {spatial_stride} exceeds the grid {self.raw_grid}")

    # h5py handles cannot cross fork(): each process opens what it reads.
    def file(self, path: Path) -> h5py.File:
        if path not in self._files:
            self._files[path] = open_hdf5(path)
        return self._files[path]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(len(range(0, n, self.spatial_stride)) for n in self.raw_grid)

    def _check(self, path: Path) -> dict:
        f = self.file(path)
        missing = [a for a in ROOT_ATTRIBUTES if a not in f.attrs]
        if missing:
            raise DataError(
                f"{path}: root attribute(s) {missing} missing; The Well's schema requires {list(ROOT_ATTRIBUTES)}"
            )
        for group in ("dimensions", "boundary_conditions", "scalars", *FIELD_GROUPS):
            if not isinstance(f.get(group), h5py.Group):
                raise DataError(f"{path}: group '{group}' missing; The Well's schema requires it in every file")
        grid_type = _text(f.attrs["grid_type"])
        if grid_type != "cartesian":
            raise DataError(f"{path}: grid_type '{grid_type}' is not supported yet (only 'cartesian' grids are)")
        n_dims, n_traj = int(f.attrs["n_spatial_dims"]), int(f.attrs["n_trajectories"])
        dims_group = f["dimensions"]
        if "spatial_dims" not in dims_group.attrs:
            raise DataError(f"{path}: 'dimensions' lacks the attribute 'spatial_dims'")
        dims = _names(dims_group.attrs["spatial_dims"])
        if len(dims) != n_dims:
            raise DataError(f"{path}: 'dimensions' names {len(dims)} spatial dims {dims}, n_spatial_dims is {n_dims}")
        for key in ("time", *dims):
            if key not in dims_group:
                raise DataError(
                    f"{path}: 'dimensions/{key}' missing; The Well's schema requires 'time' and each spatial dim"
                )
        n_time = dims_group["time"].shape[-1]
        sizes = [dims_group[d].shape[-1] for d in dims]
        fields = []
        for order, group in enumerate(FIELD_GROUPS):
            for name in self._group_names(path, f, group):
                fld = _Field(path, group, name, f[group][name], order, dims)
                fld.check_shape(path, n_traj, n_time, sizes)
                fields.append(fld)
        scalars = []
        for name in self._group_names(path, f, "scalars"):
            s = _Field(path, "scalars", name, f["scalars"][name], 0, dims)
            s.check_shape(path, n_traj, n_time, [])
            scalars.append(s)
        for param in _names(f.attrs["simulation_parameters"]):
            if param not in f["scalars"]:
                raise DataError(f"{path}: simulation parameter '{param}' has no dataset under 'scalars/'")
        return {
            "name": _text(f.attrs["dataset_name"]),
            "dims": dims,
            "sizes": sizes,
            "n_traj": n_traj,
            "n_time": n_time,
            "fields": fields,
            "scalars": scalars,
            "boundary": self._boundary(path, f, dims),
        }

    @staticmethod
    def _group_names(path: Path, f: h5py.File, group: str) -> list[str]:
        if "field_names" not in f[group].attrs:
            raise DataError(f"{path}: group '{group}' lacks the attribute 'field_names'")
        names = _names(f[group].attrs["field_names"])
        for name in names:
            if not isinstance(f[group].get(name), h5py.Dataset):
                raise DataError(f"{path}: '{group}' lists '{name}' in field_names but holds no dataset of that name")
        return names

    @staticmethod
    def _boundary(path: Path, f: h5py.File, dims: list[str]) -> list[list[int]]:
        """Per spatial dim, [lower, upper] codes; groups in file order, a later one overriding an earlier one."""
        out = [[BOUNDARY_CODES["OPEN"]] * 2 for _ in dims]
        for name, bc in f["boundary_conditions"].items():
            where = f"{path}: 'boundary_conditions/{name}'"
            for key in ("bc_type", "associated_dims"):
                if key not in bc.attrs:
                    raise DataError(f"{where} lacks the attribute '{key}'")
            kind = _text(bc.attrs["bc_type"]).upper()
            if kind not in BOUNDARY_CODES:
                raise DataError(f"{where}: bc_type '{kind.lower()}' is none of periodic, wall, open")
            if "mask" not in bc:
                raise DataError(f"{where} lacks its 'mask' dataset")
            associated = _names(bc.attrs["associated_dims"])
            mask = np.asarray(bc["mask"][()])
            if mask.ndim != len(associated):
                raise DataError(f"{where}: mask has {mask.ndim} axes for associated_dims {associated}")
            agg = np.min if kind == "WALL" else np.max
            for dim in associated:
                if dim not in dims:
                    raise DataError(f"{where}: associated dim '{dim}' is not a spatial dim {dims}")
                axis = associated.index(dim)
                for side, index in enumerate((0, -1)):
                    if agg(np.take(mask, index, axis=axis)):
                        out[dims.index(dim)][side] = BOUNDARY_CODES[kind]
        return out

    def _check_consistent(self) -> None:
        for path, info in zip(self.paths[1:], self.files_info[1:], strict=True):
            _same_dataset(path, _signature(info), self.paths[0], _signature(self.files_info[0]), "split")

    def _stride(self, block: np.ndarray, space_at: int) -> np.ndarray:
        if self.spatial_stride == 1:
            return block
        index = [slice(None)] * space_at + [slice(None, None, self.spatial_stride)] * len(self.raw_grid)
        return block[tuple(index)]

    def block_size(self) -> int:
        per_traj = 4 * self.n_frames * int(np.prod(self.raw_grid)) * (len(self.channels) + len(self.constant_channels))
        return max(1, READ_BLOCK_BYTES // max(1, per_traj))

    def _read(self, path: Path, info: dict, start: int, stop: int) -> dict[str, np.ndarray]:
        f, grid = self.file(path), self.raw_grid
        try:
            series = [fl.read(f, start, stop, info["n_time"], grid) for fl in self.fields if fl.time_varying]
            const = [fl.read(f, start, stop, info["n_time"], grid) for fl in self.fields if not fl.time_varying]
            const += [s.read(f, start, stop, info["n_time"], grid) for s in info["scalars"] if not s.time_varying]
        except OSError as e:
            raise DataError(f"{path}: cannot read trajectories {start}..{stop}: {e}") from None
        out = {"": self._stride(np.concatenate(series, axis=-1), 2)}
        if const:  # a dataset without constant fields or scalars has no "const" part
            out["const"] = self._stride(np.concatenate(const, axis=-1), 1)
        for part, block in out.items():
            if not np.isfinite(block).all():
                bad = start + int(np.argwhere(~np.isfinite(block))[0][0])
                raise DataError(f"{path}: non-finite values (NaN/Inf) in trajectory {bad} ({part or 'fields'})")
        return {part: np.ascontiguousarray(block, dtype=np.float32) for part, block in out.items()}

    def parts(self, samples: range) -> Iterator[dict[str, np.ndarray]]:
        """Blocks of trajectories ``samples`` (indices over all files in order): "" (b, T, *grid, C) and, when the
        dataset has constant channels, "const" (b, *grid, C_const); float32, raw."""
        step, offset = self.block_size(), 0
        for path, info in zip(self.paths, self.files_info, strict=True):
            lo, hi = max(samples.start, offset), min(samples.stop, offset + info["n_traj"])
            for start in range(lo, hi, step):
                yield self._read(path, info, start - offset, min(start + step, hi) - offset)
            offset += info["n_traj"]

    def coordinates(self) -> dict[str, list[float]]:
        """Strided coordinates of the first file (the first trajectory's, where they vary by sample)."""
        dims = self.file(self.path)["dimensions"]
        out = {}
        for name in [*self.spatial_dims, "time"]:
            values = np.asarray(dims[name][()])
            values = values[0] if values.ndim > 1 else values
            out["t" if name == "time" else name] = (
                (values if name == "time" else values[:: self.spatial_stride]).astype(float).tolist()
            )
        return out

    def describe(self) -> dict:
        """What the cache manifest records of a Well split besides its arrays."""
        return {
            "dataset_name": self.dataset_name,
            "channels": self.channels,
            "constant_channels": self.constant_channels,
            "boundary": self.boundary,
            "spatial_dims": self.spatial_dims,
        }
