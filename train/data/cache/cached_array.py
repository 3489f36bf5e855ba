"""One cached array as the model reads it: raw float32 bytes on disk, normalised per read.

A cache stores physical values and the statistics beside them, and every read returns ``(x - mean) / std``
(float32, the same arithmetic a normalising copy would have done). That is what lets a cache map a dataset
where it lies in the source HDF5 file instead of writing a second, normalised copy of it: an uncompressed,
contiguous float32 dataset is a plain array at a known byte offset, and ``np.memmap`` reads it as one.

The bytes come from either

- a ``.npy`` file in the cache folder (a strided, channels-last copy), or
- one or more *fields* in place in a source file: each an ``(N, *rest)`` float32 array at ``offset``, of which
  samples ``first..first + n`` belong to this array; several fields are stacked as channels, last, or
- the shards of a streamed split (train.data.stream): ``.npy`` files of consecutive samples in a node's shard
  cache, each mapped when a read first needs it (and fetched, if it is not on the node).

Nothing but paths and numbers survive pickling, so a DataLoader worker maps the files itself after any fork,
and every process shares the OS page cache: one copy in RAM whatever the number of ranks and workers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from train.disk import disk_full_error, reserve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Field:
    """A float32 dataset in place in a source file: ``shape`` is its whole (N, *rest) shape. ``channel``: the
    field is channel ``channel`` of a dataset whose last axis holds the channels (a generic array, channels
    last); None: the dataset is the field."""

    file: str
    offset: int
    shape: tuple[int, ...]
    channel: int | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample of the field, without the channel axis it shares with others."""
        return self.shape[1:] if self.channel is None else self.shape[1:-1]

    def pick(self, values: np.ndarray) -> np.ndarray:
        """The field's values out of the dataset's (whole rows read from ``shape``)."""
        return values if self.channel is None else values[..., self.channel]

    def record(self) -> dict:
        channel = {} if self.channel is None else {"channel": self.channel}
        return {"file": self.file, "offset": self.offset, "shape": list(self.shape), **channel}

    @classmethod
    def from_record(cls, record: dict) -> Field:
        return cls(record["file"], int(record["offset"]), tuple(record["shape"]), record.get("channel"))


@dataclass(frozen=True)
class Sharded:
    """A split's samples as shard files: ``names[i]`` holds ``counts[i]`` samples of ``sample_shape``, in order;
    ``cache.path(name, part)`` is a shard's file on this node (fetched when missing): ``part`` '' or, for a
    published file's constant channels, 'const'."""

    cache: Any
    names: tuple[str, ...]
    counts: tuple[int, ...]
    sample_shape: tuple[int, ...]
    part: str = ""

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)


class CachedArray:
    """Read-only, normalising, lazily mapped (n, ..., c) float32 array; indexing reads only what it selects."""

    def __init__(
        self,
        mean: np.ndarray | tuple,
        std: np.ndarray | tuple,
        npy: Path | None = None,
        fields: tuple[Field, ...] = (),
        first: int = 0,
        count: int = 0,
        shards: Sharded | None = None,
    ):
        assert (npy is not None) + bool(fields) + (shards is not None) == 1, "one place the bytes lie"
        self.mean = np.asarray(mean, np.float32)
        self.std = np.asarray(std, np.float32)
        self.npy, self.fields, self.first, self.shards = npy, tuple(fields), first, shards
        if npy is not None:
            self._shape = tuple(np.load(npy, mmap_mode="r").shape)
        elif shards is not None:
            self._shape = (sum(shards.counts), *shards.sample_shape)
        else:
            self._shape = (count, *fields[0].sample_shape, len(fields))
        self._maps: tuple[np.ndarray, ...] | None = None
        self._shard_maps: dict[int, np.ndarray] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self._shape))

    @property
    def in_place(self) -> bool:
        """The bytes are the source file's own: no copy of them exists in the cache."""
        return bool(self.fields)

    def __len__(self) -> int:
        return self._shape[0]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None, "_shard_maps": {}}

    def _mapped(self) -> tuple[np.ndarray, ...]:
        if self._maps is None:
            if self.npy is not None:
                self._maps = (np.load(self.npy, mmap_mode="r"),)
            else:
                self._maps = tuple(
                    np.memmap(f.file, dtype="<f4", mode="r", offset=f.offset, shape=f.shape) for f in self.fields
                )
        return self._maps

    def raw(self, index=slice(None)) -> np.ndarray:
        """The physical values at ``index`` (a copy, never a view of the map)."""
        if self.shards is not None:
            return self._sharded(*(index if isinstance(index, tuple) else (index,)))
        maps = self._mapped()
        if self.npy is not None:
            return _owned(maps[0][index])
        first, *rest = index if isinstance(index, tuple) else (index,)
        if first is Ellipsis or len(rest) >= self.ndim - 1:  # an index reaching the channel axis: take it after
            return _owned(self.raw(slice(None))[index])
        rows = _shift(first, self.first, len(self))
        picked = [f.pick(m[(rows, *rest)]) for f, m in zip(self.fields, maps, strict=True)]
        return _owned(picked[0][..., None]) if len(picked) == 1 else np.stack(picked, axis=-1)

    def _sharded(self, first, *rest) -> np.ndarray:
        """Samples ``first`` (an int, a slice or an index array: one sample per row) of the shards, ``rest``
        indexing within each (arrays of it row by row with ``first``), one gather per shard touched."""
        rows = np.arange(len(self))[first]
        one = rows.ndim == 0
        rows = np.atleast_1d(rows)
        n = len(rows)
        starts = self.shards.starts
        which = np.searchsorted(starts, rows.reshape(n, -1)[:, 0], side="right") - 1
        out = None
        for shard in np.unique(which):
            picked = np.flatnonzero(which == shard)
            sub = tuple(r[picked] if isinstance(r, np.ndarray) and r.ndim == rows.ndim else r for r in rest)
            part = self._shard_map(int(shard))[(rows[picked] - starts[shard], *sub)]
            if out is None:
                out = np.empty((n, *part.shape[1:]), np.float32)
            out[picked] = part
        if out is None:  # no rows selected
            out = np.empty((0, *self._shape[1:]), np.float32)[(slice(None), *rest)]
        # Only this read's shards stay mapped: an evicted shard's disk space is freed once no map holds it.
        read = set(which.tolist())
        self._shard_maps = {s: m for s, m in self._shard_maps.items() if s in read}
        return out[0] if one else out

    def _shard_map(self, shard: int) -> np.ndarray:
        if shard not in self._shard_maps:
            path = self.shards.cache.path(self.shards.names[shard], self.shards.part)
            self._shard_maps[shard] = np.load(path, mmap_mode="r")
        return self._shard_maps[shard]

    def __getitem__(self, index) -> np.ndarray:
        out = self.raw(index)
        np.subtract(out, self.mean, out=out)
        np.divide(out, self.std, out=out)
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


class NpyWriter:
    """A float32 .npy file of ``shape`` written front to back with plain writes, its blocks allocated first.

    Plain writes, not a writable memory map: dirty pages of a map count in the builder's resident memory, which
    then grows with the file, while written pages are the page cache's to drop. The reservation makes a full
    disk fail here with a DiskFullError naming the file and the bytes it needs."""

    def __init__(self, path: Path, shape: tuple[int, ...]):
        header = mapped_array(path, shape)  # the header, the size and the reservation
        del header  # unmapped: the bytes go in with plain writes
        self.path, self.shape = path, shape
        self._file = open(path, "r+b")  # noqa: SIM115 - closed by close()
        self._file.seek(path.stat().st_size - 4 * int(np.prod(shape)))

    def write(self, block: np.ndarray) -> None:
        self._file.write(memoryview(np.ascontiguousarray(block, dtype=np.float32)).cast("B"))

    def close(self) -> None:
        self._file.close()


def _owned(array: np.ndarray) -> np.ndarray:
    """A contiguous float32 array of its own: a slice of a read-only map is copied, a gather's result is not."""
    out = np.ascontiguousarray(array, dtype=np.float32)
    return out if out.flags.writeable and out.base is None else out.copy()


def _shift(index, first: int, count: int):
    """An index into this array's ``count`` samples, as the same samples of a field that starts ``first`` earlier."""
    if isinstance(index, slice):
        start, stop, step = index.indices(count)
        return slice(first + start, first + stop, step) if step > 0 else first + np.arange(start, stop, step)
    if isinstance(index, int | np.integer):
        if not -count <= index < count:
            raise IndexError(f"index {index} is out of bounds for {count} samples")
        return first + index % count
    index = np.asarray(index)
    if index.dtype == bool:
        return first + np.flatnonzero(index)
    if index.size and (index.min() < -count or index.max() >= count):
        raise IndexError(f"an index is out of bounds for {count} samples")
    return first + index % count


def mapped_array(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    """A float32 .npy file of ``shape``, memory-mapped for writing, its blocks allocated first: a write through
    the map to a full disk would kill the process with SIGBUS, while the reservation fails with a DiskFullError
    naming the file and the bytes it needs."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
    try:
        reserve(path)
    except OSError as e:
        full = disk_full_error(e, path, needed=path.stat().st_size)
        if full is None:  # a file system that cannot allocate ahead: written as it comes, as before
            log.debug("cache: %s could not be allocated ahead (%s)", path, e)
            return array
        del array
        raise full from e
    return array
