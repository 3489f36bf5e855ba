"""A shard set: a task's training trajectories as shards of whole trajectories, its val and test splits as
whole files, and ``stream.json``, the manifest that lists them.

``make shard`` writes one from the task's cache (the bytes a local run trains on: physical values, strided,
channels last), so a streamed run reads exactly what the same run reads from local disk. Any store the package
reads can hold the folder as it is written (``b2 sync``, ``aws s3 sync``, a web server's folder).

stream.json::

    {"format": 1, "task": name, "cache": {what the cache's manifest says: grid, frames, channels, statistics,
     sizes, splits, sources and their checksums}, "shards": [{"name", "bytes", "sha1", "samples"}, ...],
     "whole": [{"name", "bytes", "sha1"}, ...]}
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train.atomic import atomic_dir, atomic_path, write_json_atomic
from train.data.cache.info import MANIFEST, CacheInfo, array_name
from train.data.splits import SPLITS
from train.data.stream.node_cache import Shard
from train.disk import human
from train.errors import ConfigError, DataError
from train.hashing import file_digest

log = logging.getLogger(__name__)

STREAM_FORMAT = 1
STREAM_MANIFEST = "stream.json"
DEFAULT_SHARD_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ShardSet:
    """A shard set's manifest, read and checked."""

    task: str
    cache: dict
    """The cache manifest of the data it was written from (format, grid, statistics, sizes, sources)."""
    shards: list[Shard]
    whole: list[Shard]
    """Files fetched whole: the val and test splits (and constant channels), ``samples`` 0."""
    published: dict | None = None
    """A dataset's files as published (train.data.stream.published): {"files": where they lie, "splits": {"val":
    [names], "test": [names]}, "task": the task's settings they were read with}; None: repacked shards beside
    the manifest."""

    @property
    def nbytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def sample_bytes(self) -> int:
        """Bytes of one training trajectory as the cache holds it (its constant channels included)."""
        c = self.cache
        return (
            4
            * int(np.prod(c["grid"]))
            * (c["n_frames"] * (c["in_channels"] - c["const_channels"]) + c["const_channels"])
        )

    def held(self, shard: Shard) -> int:
        """Bytes a shard takes on a node: a published file's conversion, a repacked shard itself."""
        return shard.samples * self.sample_bytes if self.published else shard.bytes

    @property
    def largest(self) -> int:
        return max(self.held(s) for s in self.shards)

    @property
    def download(self) -> int:
        """Bytes beside the held shards while a node converts a published file (one at a time); 0: repacked."""
        return max(s.bytes for s in self.shards) if self.published else 0

    def record(self) -> dict:
        """The manifest's entries (without its format)."""
        return {
            "task": self.task,
            "cache": self.cache,
            "shards": [s.record() for s in self.shards],
            "whole": [{k: v for k, v in s.record().items() if k != "samples"} for s in self.whole],
            **({"published": self.published} if self.published else {}),
        }

    @classmethod
    def parse(cls, text: str, where: str) -> ShardSet:
        """The manifest ``text`` read from ``where``; a malformed one is a DataError naming the key."""
        try:
            meta = json.loads(text)
        except ValueError as e:
            raise DataError(f"{where}: not JSON ({e}); write the shard set again (make shard)") from None
        if not isinstance(meta, dict) or meta.get("format") != STREAM_FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise DataError(
                f"{where}: shard set format {found!r}, this package reads format {STREAM_FORMAT}: write the shard "
                "set again with this version (make shard)"
            )
        try:
            shards = [Shard.from_record(r) for r in meta["shards"]]
            whole = [Shard.from_record({"samples": 0, **r}) for r in meta["whole"]]
            cache, task = dict(meta["cache"]), str(meta["task"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: a shard set manifest without a valid {e} entry: write it again") from None
        if not shards:
            raise DataError(f"{where}: the shard set lists no training shards")
        return cls(task, cache, shards, whole, meta.get("published"))


def write_shard_set(
    name: str, info: CacheInfo, out: Path, shard_bytes: int = DEFAULT_SHARD_BYTES, counts: list[int] | None = None
) -> ShardSet:
    """Write task ``name``'s cache ``info`` as a shard set in ``out`` (a new folder, complete or absent): shards of
    about ``shard_bytes``, or of ``counts`` trajectories each, in order."""
    if not info.autoregressive:
        raise ConfigError(
            f"task {name}: streaming is for time-dependent tasks; a steady one ({info.pde}) trains from pairs that "
            "fit a disk: leave it unstreamed (tasks.<name>.stream: false)"
        )
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists: give the shard set a new folder (OUT=...), or remove the old one first")
    train = info.array("train")
    if counts is None:
        per_trajectory = train.nbytes // max(len(train), 1)
        per_shard = min(max(1, shard_bytes // max(per_trajectory, 1)), len(train))
        counts = [min(per_shard, len(train) - first) for first in range(0, len(train), per_shard)]
    if sum(counts) != len(train) or min(counts) < 1:
        raise ConfigError(f"shards of {counts} trajectories do not cover the {len(train)} of task {name}")
    with atomic_dir(out) as tmp:
        shards = []
        for i, (first, count) in enumerate(zip(np.cumsum([0, *counts[:-1]]), counts, strict=True)):
            shards.append(_write(tmp / f"train-{i:05d}.npy", train.raw(slice(first, first + count)), count))
        whole = []
        for split in SPLITS:
            parts = ["const"] if split == "train" else ["", "const"]
            for part in parts if info.const_channels else [p for p in parts if p != "const"]:
                whole.append(_write(tmp / array_name(split, part), info.array(split, part).raw(), 0))
        cache = json.loads((info.path / MANIFEST).read_text())
        cache["in_place"] = None
        shard_set = ShardSet(name, cache, shards, whole)
        write_json_atomic(tmp / STREAM_MANIFEST, {"format": STREAM_FORMAT, **shard_set.record()})
    log.info(
        "shard set of %s: %d shards of up to %d trajectories (%s) and %d whole files in %s",
        name,
        len(shards),
        max(counts),
        human(shard_set.nbytes),
        len(whole),
        out,
    )
    return shard_set


def _write(path: Path, values: np.ndarray, samples: int) -> Shard:
    with atomic_path(path, needed=values.nbytes + 128) as tmp, open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(values, dtype=np.float32))
    return Shard(path.name, path.stat().st_size, file_digest(path, "sha1")["sha1"], samples)
