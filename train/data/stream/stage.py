"""A streamed task on the launcher's side: its shard set's manifest read from the store, its val and test files
fetched whole (verified; a published set's converted) into a local stream folder with a cache manifest the ranks
read like any other, and the cache plan: the node's limit against the task's working set, refused before training
when it cannot hold it."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from train.atomic import atomic_dir, write_json_atomic
from train.config import Config
from train.data.cache.build import building_caches, window_span, write_window_index
from train.data.cache.info import CACHE_FORMAT, MANIFEST, CacheInfo, array_name
from train.data.stream.convert import PARTS, Converted, convert, task_config
from train.data.stream.node_cache import Shard, ShardCache
from train.data.stream.shards import STREAM_MANIFEST, ShardSet
from train.disk import free_bytes, human
from train.errors import ConfigError, DataError, PreflightError, StoreUnavailable, TrainError
from train.stores import is_local, local_path, open_store
from train.stores.base import UNREACHABLE

log = logging.getLogger(__name__)

SHARDS = "shards"  # the node's shard cache, inside the task's stream folder
HEADROOM = 0.9  # the default limit: this share of what the cache disk has free


def read_shard_set(location: str) -> ShardSet:
    """The shard set manifest at ``location`` (any store the package reads)."""
    where = f"{location.rstrip('/')}/{STREAM_MANIFEST}"
    if is_local(location):
        path = local_path(location) / STREAM_MANIFEST
        if not path.is_file():
            raise DataError(f"{path}: no shard set here (make shard CONFIG=... OUT=folder writes one)")
        return ShardSet.parse(path.read_text(), where)
    store = open_store(location)
    if store.stat(STREAM_MANIFEST) is None:
        raise DataError(f"{where}: no shard set manifest there (make shard writes one; upload the whole folder)")
    with tempfile.TemporaryDirectory() as tmp:
        store.download(STREAM_MANIFEST, Path(tmp) / STREAM_MANIFEST)
        return ShardSet.parse((Path(tmp) / STREAM_MANIFEST).read_text(), where)


def working_set(cfg: Config, shard_set: ShardSet) -> int:
    """Bytes the node must hold for the task at any moment: per canonical stream, the block being read, the one
    before it and the blocks fetched ahead, each ``block_shards`` of the largest shard (and, for a published
    set, the largest file's download while it is converted)."""
    d = cfg.data
    streams = min(d.canonical_nodes, len(shard_set.shards))
    blocks = min(2 + d.prefetch_blocks, -(-len(shard_set.shards) // (streams * d.block_shards)))
    held = min(streams * d.block_shards * blocks * shard_set.largest, sum(map(shard_set.held, shard_set.shards)))
    return held + shard_set.download


def cache_limit(cfg: Config, folder: Path) -> tuple[int, str]:
    """The node's shard cache limit in bytes and where it came from."""
    if cfg.data.limit_bytes is not None:
        return cfg.data.limit_bytes, f"data.cache_limit={cfg.data.cache_limit}"
    held = sum(p.stat().st_size for p in folder.glob("*.npy")) if folder.is_dir() else 0
    free = free_bytes(folder)
    if free is None:
        raise ConfigError(f"the free space of {folder} cannot be read: set data.cache_limit (bytes, e.g. 200GB)")
    return int((free + held) * HEADROOM), f"{HEADROOM:.0%} of the free space of {folder}'s disk"


def plan_stream(name: str, cfg: Config, shard_set: ShardSet, folder: Path) -> int:
    """The task's cache limit, checked against its working set (ConfigError, exit 2, with the figures)."""
    need = working_set(cfg, shard_set)
    limit, why = cache_limit(cfg, folder)
    if limit < need:
        d = cfg.data
        raise ConfigError(
            f"task {name}: the shard cache limit {human(limit)} ({why}) is below the {human(need)} the stream reads "
            f"at once (data.canonical_nodes={d.canonical_nodes} x data.block_shards={d.block_shards} x (2 + "
            f"data.prefetch_blocks={d.prefetch_blocks}) blocks of shards up to {human(shard_set.largest)}): raise "
            "data.cache_limit or lower block_shards or prefetch_blocks"
        )
    return limit


def disk_need(cfg: Config, name: str) -> int:
    """Bytes a streamed task takes on the cache disk, without touching the network (the doctor's disk plan): its
    cache limit, or where the limit is left to the disk, the working set of a set this node can read (local, or
    prepared by an earlier launch) and the files it fetched whole; 0 for a remote set not seen yet."""
    location = cfg.tasks[name].location
    if is_local(location):
        try:
            return cfg.data.limit_bytes or working_set(cfg, read_shard_set(location))
        except TrainError:
            return cfg.data.limit_bytes or 0  # the data check says what is wrong with it
    seen = sorted((Path(cfg.run.cache_dir) / name).glob(f"stream-*/{MANIFEST}"), key=lambda p: p.stat().st_mtime)
    if not seen:
        return cfg.data.limit_bytes or 0
    meta = json.loads(seen[-1].read_text())
    stream = meta.get("stream", {})
    shards = [Shard.from_record(r) for r in stream.get("shards", [])]
    published = {"files": stream["url"]} if stream.get("convert") else None
    return cfg.data.limit_bytes or (working_set(cfg, ShardSet(name, meta, shards, [], published)) if shards else 0)


def describe_stream(name: str, cfg: Config) -> list[str]:
    """What DRY_RUN=1 says of a streamed task: shards, bytes and the cache plan (nothing is fetched)."""
    task = cfg.tasks[name]
    shard_set = read_shard_set(task.location)
    folder = _folder(cfg, name, shard_set) / SHARDS
    need = working_set(cfg, shard_set)
    limit, why = cache_limit(cfg, folder)
    whole = sum(s.bytes for s in shard_set.whole)
    local = is_local(task.location) and not shard_set.published
    where = "read in place (a local shard set is never evicted)" if local else f"cached in {folder}"
    files = f"the files as published at {shard_set.published['files']}" if shard_set.published else task.location
    return [
        f"{name}: streamed from {files}: {len(shard_set.shards)} shards, {human(shard_set.nbytes)} of training "
        f"data, {where}",
        f"{name}: val and test fetched whole: {human(whole)} in {len(shard_set.whole)} file(s)"
        + (", converted on the node" if shard_set.published else ""),
        f"{name}: cache limit {human(limit)} ({why}); working set {human(need)}"
        + ("" if limit >= need else " - REFUSED: the limit is below the working set"),
    ]


def _folder(cfg: Config, name: str, shard_set: ShardSet) -> Path:
    key = hashlib.sha256(json.dumps([s.record() for s in shard_set.shards + shard_set.whole]).encode()).hexdigest()
    return Path(cfg.run.cache_dir) / name / f"stream-{key[:16]}"


def prepare_stream(name: str, cfg: Config) -> CacheInfo:
    """The local stream folder of task ``name`` (fetched once, then found), its plan checked for this launch."""
    task = cfg.tasks[name]
    shard_set = read_shard_set(task.location)
    folder = _folder(cfg, name, shard_set)
    limit = plan_stream(name, cfg, shard_set, folder / SHARDS)
    root = Path(cfg.run.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with building_caches(root):
        if not (folder / MANIFEST).is_file():
            with atomic_dir(folder) as tmp:
                _fetch_whole(task.location, shard_set, tmp)
                write_json_atomic(tmp / MANIFEST, shard_set.cache)
        meta = json.loads((folder / MANIFEST).read_text())
        meta["stream"] = _record(cfg, task.location, shard_set, folder, limit)
        write_json_atomic(folder / MANIFEST, meta)
        info = CacheInfo.load(folder, CACHE_FORMAT)
        if info is None:
            raise DataError(
                f"{task.location}: the shard set was written by a version with another cache format than this "
                f"one's ({CACHE_FORMAT}): write it again (make shard)"
            )
        if info.n_frames >= window_span(task.initial_step, 1, task.window_stride):
            write_window_index(info, task.initial_step, stride=task.window_stride)
    log.info(
        "stream %s: %d shards (%s) from %s; node cache limit %s, working set %s",
        name,
        len(shard_set.shards),
        human(shard_set.nbytes),
        task.location,
        human(limit),
        human(working_set(cfg, shard_set)),
    )
    return info


def _record(cfg: Config, location: str, shard_set: ShardSet, folder: Path, limit: int) -> dict:
    meta = shard_set.cache
    const = meta.get("const_channels", 0)
    shapes = {"": [meta["n_frames"], *meta["grid"], meta["in_channels"] - const]}
    record = {
        "url": location,
        "folder": str((folder / SHARDS).resolve()),
        "shards": [s.record() for s in shard_set.shards],
        "sample_shapes": shapes,
        "limit": limit,
        "wait_s": cfg.data.store_wait_s,
    }
    if shard_set.published:  # each file converted on the node, its constant channels too (no whole train_const)
        if const:
            shapes["const"] = [*meta["grid"], const]
        parts = tuple(p for p in PARTS if p in shapes)
        convert = Converted(shard_set.published["task"], parts, shard_set.sample_bytes)
        record.update(url=shard_set.published["files"], convert=convert.record())
    return record


def _fetch_whole(location: str, shard_set: ShardSet, folder: Path) -> None:
    """The val and test files (and constant channels) into ``folder``, each checked against the manifest; a
    published set's converted as the cache holds them, their downloads removed."""
    published = shard_set.published
    if is_local(location) and not published:
        for f in shard_set.whole:
            (folder / f.name).symlink_to((local_path(location) / f.name).resolve())
        return
    files = published["files"] if published else location
    downloads = folder / ".downloads" if published else folder
    cache = ShardCache(files, downloads, shard_set.whole, limit=2**62, wait_s=0)
    try:
        cache.fetch([f.name for f in shard_set.whole])
    except StoreUnavailable as e:  # before any rank started: nothing to checkpoint, the network's problem
        raise PreflightError(f"{files}: the store does not answer; {UNREACHABLE}") from e
    if published:
        task = task_config(published["task"])
        parts = ["", "const"] if shard_set.cache.get("const_channels") else [""]
        for split, names in published["splits"].items():
            convert(task, [cache.path(n) for n in names], {p: folder / array_name(split, p) for p in parts})
        shutil.rmtree(downloads, ignore_errors=True)
