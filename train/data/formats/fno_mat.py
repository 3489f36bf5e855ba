"""The FNO paper's MATLAB files (docs/fno-mat.md): Burgers ``a -> u``, Darcy ``coeff -> sol``, Navier-Stokes ``u``.

Two containers hold them: MATLAB v5 (read with ``scipy.io.loadmat``) and MATLAB v7.3, which is HDF5 with a
512-byte user block (read lazily with h5py). MATLAB is column-major, so h5py sees every v7.3 array with its
axes reversed; reversing them back, as the FNO scripts' ``MatReader`` does, gives both containers one view:
``(N, spatial...)`` fields and ``(N, spatial..., T)`` trajectories. Values are cast to float32.

The container is told from the file's first bytes rather than by trying scipy and falling back to h5py on any
error (``MatReader``'s way), so that a damaged v5 file is reported as such instead of as "not HDF5".
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from train.atomic import atomic_path
from train.config import TaskConfig
from train.data.formats.pdebench import fit_times
from train.errors import DataError
from train.pdes import LAYOUTS

READ_BLOCK_BYTES = 64 << 20
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
V73_HEADER = b"MATLAB 7.3 MAT-file"
USERBLOCK = 512
NUMERIC_CLASSES = {
    "double",
    "single",
    "logical",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
}
MATLAB_CLASS = {
    np.dtype(np.float32): "single",
    np.dtype(np.float64): "double",
    np.dtype(np.bool_): "logical",
    **{
        np.dtype(t): np.dtype(t).name
        for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)
    },
}
FIX = "re-download it or write it again (docs/fno-mat.md)"


def mat_version(path: Path, needs: str = "") -> str:
    """The MAT-file version, "5" or "7.3", from the file's first bytes: the v7.3 user block's header or an HDF5
    signature, else the v5 header's endian mark at bytes 126-127. ``needs`` (the keys wanted) joins the messages."""
    needs = f"{needs}; " if needs else ""
    if not path.is_file():
        raise DataError(f"data file '{path}' not found; {needs}check the task's source and files.train_file/test_file")
    with open(path, "rb") as f:
        head = f.read(128)
    if head.startswith((V73_HEADER, HDF5_SIGNATURE)) or h5py.is_hdf5(path):
        return "7.3"
    if len(head) == 128 and head[126:128] in (b"IM", b"MI"):
        return "5"
    raise DataError(
        f"{path}: not a MATLAB file (no v5 header, no v7.3/HDF5 signature; {len(head)} bytes read "
        f"of the header); {needs}{FIX}"
    )


def _v5_end_check(path: Path, head: bytes, keys: list[str]) -> None:
    """Walk the v5 file's top-level elements: a truncated file ends inside one. scipy's ``whosmat`` silently lists
    only the variables before the cut, which would read as a missing key."""
    order = "<" if head[126:128] == b"IM" else ">"
    size, pos = path.stat().st_size, 128
    with open(path, "rb") as f:
        while pos < size:
            f.seek(pos)
            tag = f.read(8)
            if len(tag) < 8:  # cut inside an element's tag
                pos += 8
                break
            pos += 8 + struct.unpack(f"{order}II", tag)[1]
    if pos != size:
        raise DataError(
            f"{path}: truncated MATLAB v5 file ({size} bytes, its last variable needs {pos}); the "
            f"keys {keys} may be cut off; {FIX}"
        )


class FnoMatReader:
    """One split of an FNO family: one ``.mat`` file, validated from its metadata, read in blocks of samples."""

    std_floor = None  # a constant channel is left unscaled, as for PDEBench files

    def __init__(self, path: Path, task: TaskConfig):
        self.path = Path(path)
        self.pde = task.pde
        self.layout = LAYOUTS[task.pde]
        if self.layout.style != "fno_mat":
            raise ValueError(f"{task.pde} files are {self.layout.style}-style, not FNO .mat files")
        self.spatial_stride = task.spatial_stride
        self.temporal_stride = task.temporal_stride if self.layout.autoregressive else 1
        self.keys = list(dict.fromkeys(self.layout.inputs + self.layout.targets))
        self.version = mat_version(self.path, self._what())
        self._file: h5py.File | None = None
        self._arrays: dict[str, np.ndarray] | None = None
        self._check()

    # ------------------------------------------------------------------------------------------ metadata
    def _what(self) -> str:
        return f"a {self.pde} file needs {self.keys}"

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """Each key's shape in the reader's axis order, after checking it is a numeric array."""
        if self.version == "5":
            import scipy.io  # imported here: it costs every launcher's start otherwise

            with open(self.path, "rb") as f:
                _v5_end_check(self.path, f.read(128), self.keys)
            try:
                found = {name: (shape, cls) for name, shape, cls in scipy.io.whosmat(self.path)}
            except Exception as e:  # scipy raises IndexError, OSError, ValueError, zlib.error... on damaged files
                raise DataError(
                    f"{self.path}: damaged MATLAB v5 file ({type(e).__name__}: {e}); {self._what()}; {FIX}"
                ) from None
            present = sorted(found)
        else:
            found = {}
            for key in self.keys:
                if key in self.file:
                    ds = self.file[key]
                    if not isinstance(ds, h5py.Dataset):
                        raise DataError(
                            f"{self.path}: a v7.3 file without the expected layout: '{key}' is a "
                            f"{type(ds).__name__}, not an array; {self._what()}; {FIX}"
                        )
                    # MATLAB tags each array with its class; a plain HDF5 array is taken by its dtype alone
                    cls = ds.attrs.get("MATLAB_class", b"double")
                    cls = cls.decode() if isinstance(cls, bytes) else str(cls)
                    found[key] = (ds.shape[::-1], cls if ds.dtype.kind in "fiub" else f"{ds.dtype} array")
            present = sorted(k for k in self.file if not k.startswith("#"))  # "#refs#", "#subsystem#": MATLAB's own
        shapes = {}
        for key in self.keys:
            if key not in found:
                raise DataError(
                    f"{self.path}: key '{key}' not found (keys: {present}); {self._what()}; check "
                    "the task's pde and files settings, or write the file again"
                )
            shape, cls = found[key]
            if cls not in NUMERIC_CLASSES:
                raise DataError(f"{self.path}: '{key}' is a MATLAB {cls}, not a numeric array; {self._what()}; {FIX}")
            shapes[key] = tuple(int(n) for n in shape)
        return shapes

    def _check(self) -> None:
        shapes = self._shapes()
        d = self.layout.spatial_dims
        want = 1 + d + self.layout.autoregressive
        axes = f"(N, {', '.join('s' * d)}{', T' if self.layout.autoregressive else ''})"
        for key, shape in shapes.items():
            if len(shape) != want:
                what = (
                    "a v7.3 file without the expected layout"
                    if self.version == "7.3"
                    else (f"a grid not matching {self.pde}'s {d} spatial axes")
                )
                raise DataError(f"{self.path}: {what}: '{key}' has shape {shape}, {self.pde} needs {axes}; {FIX}")
        first, *rest = self.keys
        for key in rest:
            if shapes[key][0] != shapes[first][0]:
                raise DataError(
                    f"{self.path}: '{first}' holds {shapes[first][0]} samples but '{key}' "
                    f"{shapes[key][0]}; input and target must pair sample for sample; {FIX}"
                )
            if shapes[key][1:] != shapes[first][1:]:
                raise DataError(
                    f"{self.path}: '{first}' has grid {shapes[first][1:]} but '{key}' "
                    f"{shapes[key][1:]}; input and target must share one grid; {FIX}"
                )
        self.n_samples, *space = shapes[first]
        self.raw_frames = 1
        if self.layout.autoregressive:
            *space, self.raw_frames = space
        self.raw_grid = tuple(space)
        if self.n_samples == 0 or 0 in shapes[first]:
            raise DataError(f"{self.path}: '{first}' has shape {shapes[first]}: no data; {FIX}")
        if any(n < self.spatial_stride for n in self.raw_grid):
            raise DataError(
                f"{self.path}: spatial_stride {self.spatial_stride} exceeds the grid {self.raw_grid} "
                f"of '{first}'; lower the task's spatial_stride"
            )

    # ------------------------------------------------------------------------------------------ geometry
    @property
    def grid(self) -> tuple[int, ...]:
        """Spatial grid after striding every axis by ``spatial_stride`` (421 -> 85 at stride 5)."""
        return tuple(len(range(0, n, self.spatial_stride)) for n in self.raw_grid)

    @property
    def n_frames(self) -> int:
        """Recorded frames of a trajectory after ``temporal_stride``; 1 for steady pairs."""
        return len(range(0, self.raw_frames, self.temporal_stride)) if self.layout.autoregressive else 1

    # ------------------------------------------------------------------------------------------- reading
    # h5py handles cannot cross fork(): open on first use, in whichever process uses it.
    @property
    def file(self) -> h5py.File:
        """The v7.3 file's HDF5 handle, opened on first use."""
        if self._file is None:
            try:
                self._file = h5py.File(self.path, "r")
            except OSError as e:
                raise DataError(
                    f"{self.path}: truncated or damaged MATLAB v7.3 (HDF5) file ({e}); {self._what()}; {FIX}"
                ) from None
        return self._file

    def _loaded(self) -> dict[str, np.ndarray]:
        """The v5 file's arrays: scipy reads a variable whole, so they are loaded once and kept until close()."""
        if self._arrays is None:
            import scipy.io

            try:
                data = scipy.io.loadmat(self.path, variable_names=self.keys)
            except Exception as e:  # as whosmat's: scipy has no one exception for a damaged file
                raise DataError(f"{self.path}: cannot read {self.keys} from this MATLAB v5 file ({e}); {FIX}") from None
            self._arrays = {key: data[key] for key in self.keys}
        return self._arrays

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        """Samples start..stop of ``key``, strided, float32, as (n, t, *grid, 1) or (n, *grid, 1)."""
        index = (slice(start, stop), *[slice(None, None, self.spatial_stride)] * len(self.raw_grid))
        if self.layout.autoregressive:
            index += (slice(None, None, self.temporal_stride),)
        try:
            # v7.3 stores the axes reversed: select in their order, then reverse the result
            block = self._loaded()[key][index] if self.version == "5" else np.transpose(self.file[key][index[::-1]])
        except OSError as e:
            raise DataError(f"{self.path}: cannot read '{key}' samples {start}..{stop} ({e}); {FIX}") from None
        if self.layout.autoregressive:  # (n, *grid, T) -> (n, T, *grid): time before space, as every reader
            block = np.moveaxis(block, -1, 1)
        out = np.ascontiguousarray(block, dtype=np.float32)[..., None]
        if not np.isfinite(out).all():
            bad = start + int(np.argwhere(~np.isfinite(out))[0][0])
            raise DataError(f"{self.path}: non-finite values (NaN/Inf) in '{key}' at sample {bad}; {FIX}")
        return out

    def parts(self, samples: range) -> Iterator[dict[str, np.ndarray]]:
        """Blocks of consecutive samples: {"": (n, T, *grid, 1)} for Navier-Stokes, {"x", "y": (n, *grid, 1)}
        for Burgers and Darcy; about READ_BLOCK_BYTES each, so a big v7.3 file streams."""
        per_sample = 4 * int(np.prod(self.grid)) * self.n_frames * len(self.keys)
        step = max(1, READ_BLOCK_BYTES // per_sample)
        (inputs,), (targets,) = self.layout.inputs, self.layout.targets
        for start in range(samples.start, samples.stop, step):
            stop = min(start + step, samples.stop)
            if self.layout.autoregressive:
                yield {"": self._read(targets, start, stop)}
            else:
                yield {"x": self._read(inputs, start, stop), "y": self._read(targets, start, stop)}

    def coordinates(self) -> dict[str, list[float]]:
        """The recorded times ``t`` of a Navier-Stokes file, strided; the files hold no spatial coordinates."""
        if not self.layout.autoregressive:
            return {}
        try:
            if self.version == "5":
                import scipy.io

                t = scipy.io.loadmat(self.path, variable_names=["t"]).get("t")
            else:
                t = self.file["t"][()] if isinstance(self.file.get("t"), h5py.Dataset) else None
        except Exception:  # a damaged ``t`` is left out below, as one that does not fit
            t = None
        # ``t`` is not part of the task: one that does not fit the frames is left out rather than fail the file
        if t is None or np.asarray(t).dtype.kind not in "fiu" or np.size(t) != self.raw_frames:
            return {}
        return {"t": np.ravel(t)[:: self.temporal_stride].astype(float).tolist()}

    def describe(self) -> dict:
        """The input channel's name: the key it is read from."""
        return {"channels": list(self.layout.inputs)}

    def close(self) -> None:
        """Drop the HDF5 handle and the loaded v5 arrays."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._arrays = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None, "_arrays": None}


def open_fno_mat(paths: list[Path], task: TaskConfig) -> FnoMatReader:
    """The reader of one split of an FNO family: exactly one ``.mat`` file."""
    if len(paths) != 1:
        raise DataError(
            f"a {task.pde} split is one .mat file, got {len(paths)}: {[str(p) for p in paths]}; "
            "name one file in the task's files.train_file / files.test_file"
        )
    return FnoMatReader(Path(paths[0]), task)


def locate_fno_mat(store, task: TaskConfig, split: str) -> list[str]:
    """The split's file in ``store``: the train file for "train", the test file (where the family has one) for
    "test", none for "val" (carved from the train file by the caller); [] where the store lacks it."""
    name = {"train": task.files.train_file, "test": task.files.test_file}.get(split)
    return [name] if name and store.stat(name) is not None else []


def _v73_header() -> bytes:
    text = V73_HEADER + b", Platform: GLNXA64, HDF5 schema 1.00 ."
    # 116 bytes of text, 8 of subsystem offset, version 0x0200 and the endian mark: MATLAB's 128-byte header
    return text.ljust(116, b" ") + b"\0" * 8 + b"\x00\x02" + b"IM" + b"\0" * (USERBLOCK - 128)


def write_mat(path: Path, arrays: dict[str, np.ndarray], version: str = "5") -> Path:
    """Write ``arrays`` as a MATLAB file at ``path`` (atomically): version "5" with scipy.io.savemat, "7.3" as
    MATLAB does, HDF5 with a 512-byte user block, each array's axes reversed and a ``MATLAB_class`` attribute.
    A 1-D array is stored as a (1, n) row in both, as MATLAB has no 1-D arrays."""
    if version not in ("5", "7.3"):
        raise ValueError(f"write_mat: version must be '5' or '7.3', got {version!r}")
    arrays = {key: np.asarray(value) for key, value in arrays.items()}
    arrays = {key: value[None] if value.ndim == 1 else value for key, value in arrays.items()}
    path = Path(path)
    with atomic_path(path) as tmp:
        if version == "5":
            import scipy.io

            with open(tmp, "wb") as f:
                scipy.io.savemat(f, arrays)
        else:
            with h5py.File(tmp, "w", userblock_size=USERBLOCK) as f:
                for key, value in arrays.items():
                    if value.dtype not in MATLAB_CLASS:
                        raise ValueError(f"write_mat: '{key}' has dtype {value.dtype}, not a MATLAB numeric class")
                    stored = value.astype(np.uint8) if value.dtype == np.bool_ else value
                    ds = f.create_dataset(key, data=np.ascontiguousarray(np.transpose(stored)))
                    ds.attrs["MATLAB_class"] = np.bytes_(MATLAB_CLASS[value.dtype])
            with open(tmp, "r+b") as f:  # h5py leaves the user block zeroed: MATLAB's header goes there
                f.write(_v73_header())
    return path


def _all_arrays(reader: FnoMatReader) -> dict[str, np.ndarray]:
    """Every numeric variable of the reader's file, as it was (its dtype kept), in the reader's axis order."""
    if reader.version == "5":
        import scipy.io

        data = scipy.io.loadmat(reader.path)
        return {k: v for k, v in data.items() if not k.startswith("__") and np.asarray(v).dtype.kind in "fiub"}
    return {
        key: np.transpose(ds[()])
        for key, ds in reader.file.items()
        if isinstance(ds, h5py.Dataset) and ds.dtype.kind in "fiub"
    }


def write_predictions(path: Path, reader: FnoMatReader, inputs: np.ndarray, outputs: np.ndarray) -> None:
    """Predictions in the input's own layout and container (v5 or v7.3): a steady pair's target key (N,
    spatial...) and a Navier-Stokes rollout's ``u`` (N, s, s, T), the initial frames first, float32 (MATLAB single).
    Every other variable of the input is copied as it was (its dtype kept): a steady pair's input key, Navier-Stokes'
    ``a`` (the initial vorticity) and ``t``. At a run's strides, arrays on the grid are strided as the run read
    it, and ``t`` is strided and fitted to the frames written (extended at its last spacing when the rollout goes
    beyond the input's frames). ``inputs``/``outputs`` are channels-last as the reader gives them."""
    layout, s = reader.layout, reader.spatial_stride
    grid_axes = len(reader.raw_grid)
    arrays = {}
    for key, value in _all_arrays(reader).items():
        if key in layout.targets:
            continue
        if (
            value.ndim >= 1 + grid_axes
            and value.shape[0] == reader.n_samples
            and value.shape[1:][:grid_axes] == reader.raw_grid
        ):
            value = value[(slice(None), *[slice(None, None, s)] * grid_axes)]
        elif key == "t" and layout.autoregressive and np.size(value) == reader.raw_frames:
            value = fit_times(np.ravel(value)[:: reader.temporal_stride], outputs.shape[1])[None].astype(value.dtype)
        arrays[key] = value
    if layout.autoregressive:
        arrays[layout.targets[0]] = np.moveaxis(outputs[..., 0], 1, -1)
    else:
        arrays[layout.targets[0]] = outputs[..., 0]
        arrays.setdefault(layout.inputs[0], inputs[..., 0])
    write_mat(path, arrays, reader.version)
