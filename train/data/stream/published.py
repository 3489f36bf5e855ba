"""A dataset's files as published, streamed as its shards: no repacking.

A dataset published as many files a split (The Well's ``data/{train,valid,test}/*.hdf5``, each file some whole
trajectories) already is a shard set: a file is a shard. ``make shard PUBLISHED=1`` reads the files once, one at a
time where they lie (a remote one fetched into a temporary file, then removed: the dataset never needs the disk
it takes), and writes only the manifest, ``<out>/<task>/stream.json``: each training file's name, bytes, SHA1 and
trajectories, the val and test files, where the files lie, the task's preprocessing, and the cache description
with the train split's statistics, taken block by block in file order as a cache build takes them (the same
figures, to the bit). A node converts each file once fetched and verified (train.data.stream.convert).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from train.atomic import write_json_atomic
from train.config import TaskConfig
from train.data.cache.build import cache_manifest
from train.data.cache.running_stats import RunningStats
from train.data.checksum import ALGORITHM
from train.data.formats import format_of, open_reader
from train.data.formats.well_stats import published_moments
from train.data.splits import SPLITS
from train.data.stream.node_cache import Shard
from train.data.stream.shards import STREAM_FORMAT, STREAM_MANIFEST, ShardSet
from train.disk import human
from train.errors import ConfigError, DataError
from train.hashing import file_digest
from train.pdes import LAYOUTS
from train.stores import is_local, local_path, open_store
from train.stores.base import check_name

log = logging.getLogger(__name__)


def published_files(name: str, task: TaskConfig) -> dict[str, list[str]]:
    """Each split's files in the task's source, as its format finds them; a dataset whose files are not shards
    (one file holds a split, or a split has no files of its own) is a ConfigError saying to repack it."""
    fmt = format_of(task.pde)
    if not fmt.many_files or not LAYOUTS[task.pde].autoregressive:
        raise ConfigError(
            f"tasks.{name}: pde {task.pde} is not published as many files of whole trajectories (its files are no "
            "shards): write a shard set of it with make shard (without PUBLISHED=1), which repacks them"
        )
    store = open_store(task.location)
    files = {split: sorted(check_name(n) for n in fmt.locate(store, name, task, split)) for split in SPLITS}
    for split, names in files.items():
        if not names:
            wanted = ", ".join(fmt.looks_for(name, task, split) or [split])
            raise ConfigError(
                f"tasks.{name}: {task.location} has no {split} files of its own ({wanted}); streaming a dataset as "
                "published takes every split from its own files: write a repacked shard set (make shard)"
            )
    return files


def index_published(name: str, task: TaskConfig, out: Path, scratch: Path) -> ShardSet:
    """Write the manifest of task ``name``'s published files in ``out`` (``stream.json`` only); remote files are
    fetched one at a time into ``scratch`` and removed once read."""
    files = published_files(name, task)
    location = str(local_path(task.location).resolve()) if is_local(task.location) else task.location.rstrip("/")
    store = open_store(location)
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix=f".{name}-index.") as tmp:
        first = _local(store, files["train"][0], Path(tmp) / "first")  # kept to the end: it describes the set
        train = open_reader([first], task)
        try:
            index = _Index(store, task, train, Path(tmp), {files["train"][0]: first})
            listed = {split: [index.file(n, split) for n in names] for split, names in files.items()}
            stats, shapes = index.stats, index.shapes
            moments = {part: acc.result(train.std_floor) for part, acc in stats.items()}
            published = _stats_file(store, name, task, train, moments, Path(tmp))
            sizes = {split: sum(s.samples for s in listed[split]) for split in SPLITS}
            splits, source = {}, {}
            for split in SPLITS:
                splits[split] = {"file": f"{location}/{files[split][0]}", "samples": [0, sizes[split]], "carved": False}
                sums = [{"path": f"{location}/{f.name}", ALGORITHM: index.checksums[f.name]} for f in listed[split]]
                source[split] = {"files": sums}
            meta = cache_manifest(
                task,
                train,
                {(split, part): (sizes[split], *shape[1:]) for (split, part), shape in shapes.items()},
                published or moments,
                split_frames={split: shape[1] for (split, part), shape in shapes.items() if part == ""},
                sizes=sizes,
                statistics="stats.yaml" if published else "train split",
                in_place=None,
                splits=splits,
                source=source,
            )
        finally:
            train.close()
    shard_set = ShardSet(
        name,
        meta,
        listed["train"],
        listed["val"] + listed["test"],
        {"files": location, "splits": {s: files[s] for s in ("val", "test")}, "task": task.model_dump(mode="json")},
    )
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / STREAM_MANIFEST, {"format": STREAM_FORMAT, **shard_set.record()})
    log.info(
        "shard set of %s as published: %d files, %s, at %s",
        name,
        len(shard_set.shards),
        human(shard_set.nbytes),
        location,
    )
    return shard_set


def _local(store, name: str, dest: Path) -> Path:
    """The file ``name`` on this node: where it lies, or downloaded to ``dest``."""
    if hasattr(store, "path"):
        return store.path(name)
    store.download(name, dest)
    return dest


class _Index:
    """The pass over the files: each one's record, the training files' statistics and every part's shape."""

    def __init__(self, store, task: TaskConfig, train, tmp: Path, have: dict[str, Path]):
        self.store, self.task, self.train, self.tmp, self.have = store, task, train, tmp, have
        self.stats: dict[str, RunningStats] = {}
        self.shapes: dict[tuple[str, str], tuple[int, ...]] = {}
        self.checksums: dict[str, str] = {}

    def file(self, name: str, split: str) -> Shard:
        """One file's record, read where it lies or fetched into the scratch folder and removed once read."""
        path = self.have.get(name) or _local(self.store, name, self.tmp / "file")
        where = f"{self.store.url.rstrip('/')}/{name}"
        try:
            reader = open_reader([path], self.task)
            try:
                self._check(reader, where, split)
                for blocks in reader.parts(range(reader.n_samples)):
                    for part, block in blocks.items():
                        self.shapes.setdefault((split, part), block.shape)
                        if split == "train":
                            self.stats.setdefault(part, RunningStats()).update(block)
                samples = reader.n_samples
            finally:
                reader.close()
            digests = file_digest(path, "sha1", ALGORITHM)
            self.checksums[name] = digests[ALGORITHM]
            return Shard(name, path.stat().st_size, digests["sha1"], samples)
        finally:
            if path == self.tmp / "file":
                path.unlink(missing_ok=True)

    def _check(self, reader, where: str, split: str) -> None:
        train = self.train
        if reader.grid != train.grid or reader.describe() != train.describe():
            raise DataError(
                f"{where}: grid {reader.grid} and {reader.describe()} differ from the first training file's "
                f"({train.grid}, {train.describe()}): the files must come from one dataset"
            )
        if split == "train" and reader.n_frames != train.n_frames:
            raise DataError(
                f"{where}: {reader.n_frames} frames, the first training file's {train.n_frames}: the training "
                "files must hold trajectories of one length"
            )


def _stats_file(store, name: str, task: TaskConfig, train, moments: dict, tmp: Path) -> dict | None:
    """The dataset's own statistics (The Well's stats.yaml) where the task uses them and they agree with the
    train split's, as a cache build takes them; None: the train split's."""
    fmt = format_of(task.pde)
    if not (fmt.stats_file and task.well is not None and task.well.use_stats_file):
        return None
    if store.stat(fmt.stats_file) is None:
        return None
    return published_moments(_local(store, fmt.stats_file, tmp / "stats"), train, moments, moments)
