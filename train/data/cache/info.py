"""What a finished cache holds (CacheInfo, read from its manifest) and how its arrays are named: below the builder,
so that the model's side (task specs, fields, latent caches) and the data's side read a cache without
importing how one is built."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from train.data.cache.cached_array import CachedArray, Field, Sharded
from train.data.cache.in_place import file_identity, same_identity
from train.data.checksum import ALGORITHM
from train.data.stream.convert import Converted
from train.data.stream.node_cache import Shard, ShardCache

CACHE_FORMAT = 4  # 3: a split is a list of files, checksummed one by one; Well tasks. 4: raw values, in place
MANIFEST = "manifest.json"


def array_name(split: str, part: str = "") -> str:
    """File of one cached array: ``part`` is '' (trajectories), 'x' or 'y' (steady inputs/targets) or 'const'
    (a trajectory's constant channels)."""
    return f"{split}_{part}.npy" if part else f"{split}.npy"


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
    splits: dict[str, dict]
    const_channels: int = 0
    """Constant channels per trajectory (a Well task's constant fields and scalars), in ``<split>_const.npy``."""
    const_mean: tuple[float, ...] = ()
    const_std: tuple[float, ...] = ()
    channels: tuple[str, ...] = ()
    """Names of the trajectory channels, where the layout names them (The Well, generic arrays), then of the
    constant ones; a steady task's inputs, then its outputs."""
    boundary: tuple = ()
    """Per spatial axis, the [lower, upper] boundary codes (The Well: WALL=0, OPEN=1, PERIODIC=2); () unknown."""
    split_frames: dict[str, int] = field(default_factory=dict)
    """Frames of each split's trajectories where a val or test file's run longer than the training ones
    (scored to their end); {} or a split missing: ``n_frames``."""
    statistics: str = "train split"
    """Where the normalising statistics came from: 'train split' or the dataset's 'stats.yaml'."""
    in_place: dict | None = None
    """Arrays mapped where they lie in the source files (train.data.cache.in_place): {"arrays": {file name: where},
    "identity": {source: [size, mtime_ns, inode, ctime_ns]}}; None: every array is a .npy file of the cache."""
    stream: dict | None = None
    """A streamed task's training split (train.data.stream): {"url": where the shards lie, "folder": the node's
    shard cache, "shards": the manifest's shards, "sample_shapes": {part: one sample's shape} of the parts read
    from shards, "limit": bytes, "wait_s", "convert": how a published file is converted (absent: repacked
    shards)}; None: not streamed."""

    def shard_cache(self) -> ShardCache:
        """The node's cache of a streamed task's shards."""
        assert self.stream is not None, "only a streamed task has shards"
        s = self.stream
        shards = [Shard.from_record(r) for r in s["shards"]]
        convert = Converted.from_record(s["convert"]) if s.get("convert") else None
        return ShardCache(s["url"], s["folder"], shards, s["limit"], s["wait_s"], convert)

    def frames(self, split: str) -> int:
        """Saved frames of a trajectory of ``split`` (a val or test file's may exceed the training ones')."""
        return self.split_frames.get(split, self.n_frames)

    def moments(self, part: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The mean and std that normalise ``part``: inputs ('' and 'x'), targets ('y') or constants."""
        if part == "const":
            return self.const_mean, self.const_std
        return (self.target_mean, self.target_std) if part == "y" else (self.input_mean, self.input_std)

    def array(self, split: str, part: str = "") -> CachedArray:
        """One array, normalised as it is read: ``part`` is '' (trajectories), 'x' or 'y' (steady inputs/targets)
        or 'const'. Indexing reads only the samples it selects; ``np.asarray`` reads all."""
        shapes = (self.stream or {}).get("sample_shapes", {})
        if split == "train" and part in shapes:
            shards = self.stream["shards"]
            names, counts = tuple(r["name"] for r in shards), tuple(r["samples"] for r in shards)
            sharded = Sharded(self.shard_cache(), names, counts, tuple(shapes[part]), part)
            return CachedArray(*self.moments(part), shards=sharded)
        name = array_name(split, part)
        where = (self.in_place or {}).get("arrays", {}).get(name)
        if where is None:
            return CachedArray(*self.moments(part), npy=self.path / name)
        fields = tuple(Field.from_record(f) for f in where["fields"])
        return CachedArray(*self.moments(part), fields=fields, first=where["first"], count=where["count"])

    @classmethod
    def load(cls, path: Path, cache_format: int | None = None) -> CacheInfo | None:
        """The cache in ``path``; None where it is missing, of another format than ``cache_format`` (this
        package's, :data:`CACHE_FORMAT`, by default: the builder passes the one it writes) or maps a source file
        that changed since."""
        try:
            meta = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if meta.get("format") != (CACHE_FORMAT if cache_format is None else cache_format):
            return None
        fields = {k: meta[k] for k in cls.__dataclass_fields__ if k != "path" and k in meta}
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        for source, identity in (meta.get("in_place") or {}).get("identity", {}).items():
            try:
                if not same_identity(identity, file_identity(source)):
                    return None  # the mapped file changed since: its bytes are not the ones this cache describes
            except OSError:
                return None
        return cls(path=path, **fields)

    def source_checksums(self) -> dict[str, str]:
        """Every source file this cache was built from (resolved path) with its content checksum: what a run
        trained on it records in each checkpoint, and checks before it continues."""
        meta = json.loads((self.path / MANIFEST).read_text())
        return {
            e["path"]: e[ALGORITHM] for record in meta.get("source", {}).values() for e in record.get("files", [record])
        }

    def changed_mapped_sources(self) -> list[str]:
        """The source files this cache maps in place that were rewritten since it was built (see
        :func:`changed_mapped_sources`)."""
        return _changed((self.in_place or {}).get("identity", {}))

    def trajectories(self, split: str, index: np.ndarray) -> np.ndarray:
        """Trajectories ``index`` of ``split`` as the model reads them: (b, t, *grid, in_channels), every frame
        followed by the trajectory's constant channels (none for PDEBench tasks)."""
        traj = self.array(split)[index]
        if not self.const_channels:
            return traj
        const = self.array(split, "const")[index]
        return with_constants(traj, const)


def with_constants(frames: np.ndarray, const: np.ndarray) -> np.ndarray:
    """(b, t, *grid, c) frames and (b, *grid, c_const) constants -> (b, t, *grid, c + c_const)."""
    const = np.broadcast_to(const[:, None], (*frames.shape[:-1], const.shape[-1]))
    return np.concatenate([frames, const], axis=-1)


def changed_mapped_sources(folder: Path) -> list[str]:
    """The source files the cache in ``folder`` maps in place that were rewritten since it was built, each said
    with its size then and now: reading through the map then reads other bytes, or past a shrunken end dies
    with SIGBUS. Read from the manifest, whatever the files are now."""
    try:
        meta = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    return _changed((meta.get("in_place") or {}).get("identity", {}))


def _changed(identity: dict[str, list[int]]) -> list[str]:
    changed = []
    for source, recorded in identity.items():
        size = recorded[0]
        try:
            now = file_identity(source)
        except OSError as e:
            changed.append(f"{source} ({e.strerror or e}; {size} bytes were mapped)")
            continue
        if not same_identity(recorded, now):
            verb = "shrank" if now[0] < size else "was rewritten"
            changed.append(f"{source} ({verb}: {size} bytes mapped, {now[0]} bytes now)")
    return changed
