"""neuraloperator's ``.pt`` files (docs/neuralop-pt.md): plain ``torch.save`` dicts of tensors, one per split.

A file ``{name}_{train|test}_{resolution}.pt`` holds ``x`` (N, *space) and ``y`` (N, *space') without a channel
axis. Darcy (``darcy``) and Navier-Stokes (``nsforcing``) are steady pairs x -> y on an r x r grid (Darcy's x is
bool); Burgers (``burgers``) keeps a whole trajectory in ``y`` (N, t, x), whose first frame is ``x``.

Files are loaded with ``torch.load(weights_only=True)`` only: a file holding pickled code is refused before any
of it runs, never executed. Zip-format files are memory-mapped, so a block of samples reads only its own pages;
the legacy (pre-1.6) format cannot be mapped and is read whole.
"""

from __future__ import annotations

import gzip
import io
import lzma
import pickle
import struct
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from train.atomic import atomic_path
from train.config import TaskConfig
from train.data.formats.pdebench import Strided
from train.errors import DataError
from train.pdes import LAYOUTS

NAMES = {"neuralop_darcy": "darcy", "neuralop_burgers": "burgers", "neuralop_ns": "nsforcing"}
"""Family -> neuraloperator's dataset name, the {name} of its file names."""

CHANNELS = {"neuralop_darcy": ["a"], "neuralop_burgers": ["u"], "neuralop_ns": ["w"]}
"""The one input channel of each family: Darcy's coefficient, Burgers' velocity, the vorticity."""

READ_BLOCK_BYTES = 64 << 20

RESAVE = (
    "re-save it as plain tensors where you trust its source: d = torch.load(path, weights_only=False); "
    "torch.save({'x': d['x'], 'y': d['y']}, path)"
)


def load_pt(path: Path) -> dict[str, torch.Tensor]:
    """The file's dict, loaded as tensors only (memory-mapped where the format allows); DataError otherwise."""
    if not path.is_file():
        raise DataError(f"data file '{path}' not found")
    try:
        # Only the zip format can be mapped; the legacy format raises on mmap=True.
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        # torch words a global it does not know ("Unsupported global: GLOBAL m.f was not an allowed global") and
        # one of a blocked module ("unsupported GLOBAL posix.system whose module posix is blocked") differently.
        detail = " ".join(line.strip() for line in str(e).splitlines() if "unsupported global" in line.lower())
        if not detail:  # garbage bytes parse as unknown pickle opcodes: a damaged file, not a refused one
            raise DataError(
                f"{path}: not a readable torch.save file (not a pickle of tensors); the file is truncated or of "
                "another format: download or write it again"
            ) from None
        raise DataError(
            f"{path}: refused, never executed: loading it needs objects other than tensors (pickled code: "
            f"{detail}); {RESAVE}. If the file is damaged instead, download it again"
        ) from None
    except Exception as e:  # torch reports a damaged file as RuntimeError, EOFError, KeyError, struct.error, ...
        raise DataError(
            f"{path}: not a readable torch.save file ({type(e).__name__}: {str(e)[:200]}); the file is truncated "
            "or of another format: download or write it again"
        ) from None
    if not isinstance(data, dict):
        raise DataError(
            f"{path}: holds a {type(data).__name__}, not a dict; neuraloperator's files are "
            "torch.save({'x': tensor, 'y': tensor}): save the tensors in such a dict"
        )
    if zipfile.is_zipfile(path):
        check_records(path)
    return data


class _Stub:
    """Whatever a pickle builds besides tensors and storages (an OrderedDict of hooks): read, never run."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __setstate__(self, state):
        pass


_ITEMSIZE = {
    **{"Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "ComplexFloat": 8, "ComplexDouble": 16},
    **{"Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1, "Bool": 1, "Untyped": 1},
}
"""Bytes per element of each storage class a pickle names (torch.FloatStorage ...)."""


class _RecordScan(pickle.Unpickler):
    """Reads a zip-format file's ``data.pkl`` for the storage records its tensors need (key, bytes), building
    nothing: its globals resolve to stubs (the file was already loaded with ``weights_only=True``, which refuses
    code; this pass only learns sizes)."""

    def __init__(self, file):
        super().__init__(file)
        self.needed: dict[str, int] = {}

    def find_class(self, module: str, name: str):
        if module == "torch" and name.endswith("Storage"):
            return _ITEMSIZE.get(name[: -len("Storage")], 1)
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, *rest: storage
        return _Stub

    def persistent_load(self, pid):
        _, itemsize, key, _, numel = pid
        itemsize = itemsize if isinstance(itemsize, int) else 1
        self.needed[str(key)] = max(self.needed.get(str(key), 0), int(numel) * itemsize)
        return str(key)


def check_records(path: Path) -> None:
    """Every storage record of a zip-format ``.pt`` file holds the bytes its pickle says: a memory-mapped load
    (which takes a record's offset from the file and its length from the pickle) would otherwise read past a
    short record into the next one. DataError (exit 3) naming the file, the key and the record."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pickled = next((n for n in names if n.endswith("data.pkl")), None)
        if pickled is None:
            raise DataError(f"{path}: no data.pkl in the archive; not a torch.save file: download or write it again")
        prefix = pickled[: -len("data.pkl")]
        scan = _RecordScan(io.BytesIO(archive.read(pickled)))
        try:
            top = scan.load()
        except Exception as e:
            raise DataError(
                f"{path}: its data.pkl cannot be read ({type(e).__name__}: {e}); download it again"
            ) from None
        sizes = {info.filename: info.file_size for info in archive.infolist()}
    for key, needed in scan.needed.items():
        record = f"{prefix}data/{key}"
        have = sizes.get(record)
        if have is None or have < needed:
            owner = [k for k, v in top.items() if v == key] if isinstance(top, dict) else []
            what = f"'{owner[0]}'" if owner else f"a tensor (record {key})"
            got = "is missing" if have is None else f"holds {have} bytes"
            raise DataError(
                f"{path}: {what} needs {needed} bytes of storage record {record}, which {got}: the file is "
                "damaged (cut or edited); download or write it again"
            )


def _tensor(path: Path, data: dict, key: str, pde: str) -> torch.Tensor:
    if key not in data:
        raise DataError(
            f"{path}: key '{key}' not found (keys: {sorted(map(str, data))}); a {pde} file holds "
            f"{sorted(set(LAYOUTS[pde].inputs + LAYOUTS[pde].targets))}: save them under these names"
        )
    value = data[key]
    if not isinstance(value, torch.Tensor):
        raise DataError(f"{path}: '{key}' is a {type(value).__name__}, not a tensor; save it as a torch.Tensor")
    bool_ok = pde == "neuralop_darcy" and key == "x"
    if not (value.is_floating_point() or (bool_ok and value.dtype == torch.bool)):
        allowed = "bool or floating-point" if bool_ok else "floating-point"
        raise DataError(f"{path}: '{key}' has dtype {value.dtype}; a {pde} '{key}' must be {allowed}")
    return value


class NeuralopPtReader(Strided):
    """Validated, strided access to one neuraloperator ``.pt`` file (the reader seam of train.data.formats)."""

    std_floor = None

    def __init__(self, path: Path, pde: str, spatial_stride: int = 1, temporal_stride: int = 1):
        if pde not in NAMES:
            raise ValueError(f"pde must be one of {sorted(NAMES)}, got {pde!r}")
        self.path = Path(path)
        self.pde = pde
        self.layout = LAYOUTS[pde]
        self.spatial_stride = spatial_stride
        self.temporal_stride = temporal_stride if self.layout.autoregressive else 1
        self._data: dict[str, torch.Tensor] | None = None
        self._check()

    # Mapped tensors cannot cross fork() as pickles: load on first use, in whichever process uses them.
    @property
    def data(self) -> dict[str, torch.Tensor]:
        """The file's tensors, loaded on first use."""
        if self._data is None:
            self._data = load_pt(self.path)
        return self._data

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_data": None}

    def close(self) -> None:
        """Drop the tensors (and with them the file's mapping)."""
        self._data = None

    def _check(self) -> None:
        d = self.layout.spatial_dims
        if self.layout.autoregressive:
            y = _tensor(self.path, self.data, "y", self.pde)
            if y.ndim != 2 + d:
                raise DataError(
                    f"{self.path}: 'y' has shape {tuple(y.shape)}; a {self.pde} 'y' is (sample, t, x), "
                    "the whole trajectory: write it with these axes"
                )
            x = self.data.get("x")
            # x repeats y's first frame and is not read, but a count that disagrees marks a mixed-up file.
            if isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] != y.shape[0]:
                raise DataError(
                    f"{self.path}: 'x' holds {x.shape[0]} samples but 'y' {y.shape[0]}; write both from one set"
                )
            self.raw_shape = tuple(y.shape[1:])
        else:
            x = _tensor(self.path, self.data, "x", self.pde)
            y = _tensor(self.path, self.data, "y", self.pde)
            for key, value in (("x", x), ("y", y)):
                if value.ndim != 1 + d:
                    raise DataError(
                        f"{self.path}: '{key}' has shape {tuple(value.shape)}; a {self.pde} '{key}' is "
                        f"(sample, {', '.join('xyz'[:d])}) with no channel axis: write it with these axes"
                    )
            if x.shape[0] != y.shape[0]:
                raise DataError(
                    f"{self.path}: 'x' holds {x.shape[0]} samples but 'y' {y.shape[0]}; write both from one set"
                )
            if x.shape[1:] != y.shape[1:]:
                raise DataError(
                    f"{self.path}: 'x' grid {tuple(x.shape[1:])} differs from 'y' grid {tuple(y.shape[1:])}; "
                    "inputs and targets must share one grid"
                )
            self.raw_shape = (1, *x.shape[1:])
        self.n_samples = int(y.shape[0])
        if self.n_samples == 0:
            raise DataError(f"{self.path}: 'y' holds no samples; write the file again")
        space = self.raw_shape[1:]
        if any(n < self.spatial_stride for n in space):
            raise DataError(f"{self.path}: spatial stride {self.spatial_stride} exceeds the grid {space}")

    def coordinates(self) -> dict[str, list[float]]:
        """None: the files hold fields only."""
        return {}

    def describe(self) -> dict:
        """The cache manifest's channel name."""
        return {"channels": list(CHANNELS[self.pde])}

    def block_size(self) -> int:
        """Samples per block read: about READ_BLOCK_BYTES of float32 output."""
        per_sample = 4 * int(np.prod(self.raw_shape)) * (1 if self.layout.autoregressive else 2)
        return max(1, READ_BLOCK_BYTES // per_sample)

    def _read(self, key: str, start: int, stop: int) -> np.ndarray:
        index = [slice(start, stop)]
        if self.layout.autoregressive:
            index.append(slice(None, None, self.temporal_stride))
        index += [slice(None, None, self.spatial_stride)] * self.layout.spatial_dims
        view = self.data[key][tuple(index)]  # strided views of a mapped file read only what they touch
        # Always a copy: a view of the mapping must not be written by normalisation in place.
        out = np.array(view.numpy(), dtype=np.float32, order="C", copy=True)[..., None]
        if not np.isfinite(out).all():
            bad = start + int(np.argwhere(~np.isfinite(out))[0][0])
            raise DataError(f"{self.path}: non-finite values (NaN/Inf) in '{key}' at sample {bad}")
        return out

    def parts(self, samples: range) -> Iterator[dict[str, np.ndarray]]:
        """Blocks of consecutive samples: {"": (n, t, x, 1)} for Burgers, {"x", "y": (n, *grid, 1)} otherwise."""
        if samples.step != 1 or samples.start < 0 or samples.stop > self.n_samples:
            raise ValueError(f"{self.path}: samples {samples} outside 0..{self.n_samples} or not consecutive")
        step = self.block_size()
        for start in range(samples.start, samples.stop, step):
            stop = min(start + step, samples.stop)
            if self.layout.autoregressive:
                yield {"": self._read("y", start, stop)}
            else:
                yield {"x": self._read("x", start, stop), "y": self._read("y", start, stop)}


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each uncompressed zip member's (first byte of its data in the file, size): torch.save stores every
    storage as such a member, its bytes as they are in memory."""
    out = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            local = f.read(30)  # the local header: its name and extra field lengths can differ from the directory's
            name_length, extra_length = struct.unpack("<HH", local[26:30])
            out[info.filename] = (info.header_offset + 30 + name_length + extra_length, info.file_size)
    return out


def plain_tensors(path: Path, keys: tuple[str, ...], task: TaskConfig) -> list[tuple[str, int, tuple]] | None:
    """Where each of ``keys``' samples lie in a zip-format ``.pt`` file, when every one is a contiguous float32
    tensor (neuraloperator's NS fields; not Darcy's bool inputs or Burgers' float64), so the cache maps them
    in place; None otherwise. The file is loaded memory-mapped: each storage is a slice of one map of the whole
    file, so a tensor's address less the map's start is its offset in the file; the map's start is the one
    that puts every storage on a zip member of its size (none, or several: copied)."""
    if sys.byteorder != "little" or not zipfile.is_zipfile(path):
        return None
    data, members = load_pt(path), _data_offsets(path)
    tensors = [data.get(key) for key in keys]
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return None
    # Every tensor of the file takes part: members of one size are told apart by where the others lie.
    every = [t for t in data.values() if isinstance(t, torch.Tensor)]
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in every}
    first, size = min(storages)
    spans = set(members.values())
    bases = [first - start for start, n in spans if n == size]  # the map's start, if the first is that member
    bases = [base for base in bases if all((ptr - base, n) in spans for ptr, n in storages)]
    if len(bases) != 1:
        return None
    return [(str(path), t.data_ptr() - bases[0], tuple(t.shape)) for t in tensors]


def open_neuralop_pt(paths: list[Path], task: TaskConfig) -> NeuralopPtReader:
    """The reader of one split's file for a neuralop_* task."""
    if len(paths) != 1:
        raise DataError(f"a {task.pde} split is one .pt file, got {len(paths)}: {[str(p) for p in paths]}")
    return NeuralopPtReader(Path(paths[0]), task.pde, task.spatial_stride, task.temporal_stride)


def split_filename(task: TaskConfig, split: str) -> str:
    """The file name of a split: the task's ``files.train_file``/``test_file``, else neuraloperator's name."""
    files = task.files
    resolution = (files.resolution if files else None) or LAYOUTS[task.pde].reference["resolution"]
    chosen = (files.train_file if split == "train" else files.test_file) if files else None
    return chosen or f"{NAMES[task.pde]}_{split}_{resolution}.pt"


def locate_neuralop_pt(store, task: TaskConfig, split: str) -> list[str]:
    """The store's file of a split ("train", "test"; [] for "val", which neuraloperator does not ship), or []."""
    if split not in ("train", "test"):
        return []
    name = split_filename(task, split)
    return [name] if store.stat(name) is not None else []


def _check_member(archive: Path, member: tarfile.TarInfo) -> None:
    parts = PurePosixPath(member.name).parts
    if member.name.startswith("/") or ".." in parts or "\\" in member.name:
        raise DataError(
            f"{archive}: refusing member '{member.name}': an absolute name or '..' would write outside the "
            "destination folder; use the archive as published or extract its .pt files yourself"
        )
    if member.issym() or member.islnk():
        raise DataError(
            f"{archive}: refusing member '{member.name}': a link (to '{member.linkname}'); the published archives "
            "hold regular .pt files only: use the archive as published"
        )
    if not (member.isfile() or member.isdir()):
        raise DataError(
            f"{archive}: refusing member '{member.name}': not a regular file or folder; use the archive as published"
        )


def unpack_archive(archive: Path, dest: Path) -> list[Path]:
    """Extract the regular ``.pt`` members of a ``{name}_{res}.tgz`` archive under ``dest``; the extracted paths.

    Every member is checked before anything is written, and each file appears under its final name only
    once complete.
    """
    archive, dest = Path(archive), Path(dest)
    if not archive.is_file():
        raise DataError(f"archive '{archive}' not found")
    out = []
    try:
        with tarfile.open(archive, "r:*") as tar:
            # The whole listing first (one pass over the stream): a refused member stops the archive before
            # any of its files is written.
            members = tar.getmembers()
            for member in members:
                _check_member(archive, member)
            for member in members:
                if not (member.isfile() and member.name.endswith(".pt")):
                    continue
                final = dest / member.name
                source = tar.extractfile(member)
                with atomic_path(final, needed=member.size) as tmp, open(tmp, "wb") as f:
                    while chunk := source.read(1 << 20):
                        f.write(chunk)
                out.append(final)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError) as e:
        raise DataError(f"{archive}: not a readable tar archive ({type(e).__name__}: {e}); download it again") from None
    return out


def write_pt(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """``torch.save`` the tensors at ``path``, appearing only once complete."""
    path = Path(path)
    with atomic_path(path) as tmp:
        torch.save(tensors, tmp)
    return path


def write_predictions(path: Path, reader: NeuralopPtReader, inputs: np.ndarray, outputs: np.ndarray) -> None:
    """Predictions as neuraloperator's dict: ``y`` the predictions in the input's ``y`` dtype (a steady pair's
    solution (N, *grid); a Burgers rollout (N, t, x), its first frames the input's), ``x`` the input's own as it
    was (its dtype kept: Darcy's bool), and every other key of the input (Burgers' ``visc``) copied as it was. At a
    run's spatial stride, ``x`` is strided as the run read it. ``inputs``/``outputs`` are channels-last."""
    data, s = reader.data, reader.spatial_stride
    y_dtype = data["y"].dtype if data["y"].is_floating_point() else torch.float32
    tensors = {key: value.clone() for key, value in data.items() if key not in ("x", "y")}
    x = data.get("x")
    if isinstance(x, torch.Tensor) and x.ndim == 1 + reader.layout.spatial_dims:
        tensors["x"] = x[(slice(None), *[slice(None, None, s)] * reader.layout.spatial_dims)].clone()
    elif not LAYOUTS[reader.pde].autoregressive:
        tensors["x"] = torch.from_numpy(np.ascontiguousarray(inputs[..., 0]))
    tensors["y"] = torch.from_numpy(np.ascontiguousarray(outputs[..., 0])).to(y_dtype)
    write_pt(path, tensors)
