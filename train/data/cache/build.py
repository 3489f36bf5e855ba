"""Training caches: strided, channels-last float32 arrays, opened memory-mapped and normalised as they are read.

An array is a ``.npy`` file of the cache, or, where the run reads a PDEBench dataset whole from plain storage,
the dataset itself where it lies in the source file (train.data.cache.in_place): no second copy of the data. Either
way the cache holds physical values and the train split's statistics, and reads normalise per batch
(train.data.cache.cached_array). A cache never lives in /dev/shm: every rank and DataLoader worker maps the same
files and shares the OS page cache, one copy in RAM whatever the number of processes. A cache folder is named
by a hash of everything that determines its contents; it is built in a temporary folder and renamed into
place, so a folder under a final name is always complete and a stale cache is simply never looked up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from train.atomic import atomic_dir, atomic_path, write_json_atomic
from train.config import TaskConfig
from train.data.acquire.sources import SplitFiles
from train.data.cache import in_place
from train.data.cache.cached_array import NpyWriter
from train.data.cache.in_place import ChannelStats, Placed, file_identity
from train.data.cache.info import CACHE_FORMAT, MANIFEST, CacheInfo, array_name, changed_mapped_sources
from train.data.cache.running_stats import RunningStats
from train.data.checksum import ALGORITHM, ChecksumMemo
from train.data.formats import format_of, open_reader
from train.data.formats.well_stats import published_moments
from train.data.node_lock import node_lock
from train.data.splits import SPLITS
from train.errors import DataError, StopRequested

log = logging.getLogger(__name__)

CHECKSUMS = ".checksums.json"  # remembered source checksums, in the cache root
LOCK = ".lock"


def _as_files(source: Path | SplitFiles) -> SplitFiles:
    return source if isinstance(source, SplitFiles) else SplitFiles(train=Path(source))


def _source_paths(source: Path | SplitFiles) -> dict[str, list[Path]]:
    files = _as_files(source)
    paths = {split: files.paths(split) for split in SPLITS if files.get(split) is not None}
    for split, group in paths.items():
        for path in group:
            if not path.is_file():
                raise DataError(f"{split} data file '{path}' does not exist; run 'python -m train data' first")
    return paths


def _uses_stats(task: TaskConfig, files: SplitFiles) -> bool:
    """A Well dataset's stats.yaml is consulted (it is used only when it agrees with the train split)."""
    return files.stats_file is not None and task.well is not None and task.well.use_stats_file


def cache_key(task: TaskConfig, checksums: dict[str, list[str]]) -> str:
    """Hash of everything that decides a cache's bytes: the format, the preprocessing, the sources' contents."""
    recipe = {
        "format": CACHE_FORMAT,
        "pde": task.pde,
        "spatial_stride": task.spatial_stride,
        "temporal_stride": task.temporal_stride,
        "test_fraction": task.test_fraction,
        "val_fraction": task.val_fraction,
        "source": checksums,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _checksums(cache_root: Path, paths: dict[str, list[Path]]) -> dict[str, list[str]]:
    """Each split's files' content checksums, in the files' order."""
    memo = ChecksumMemo(cache_root / CHECKSUMS)
    start = time.perf_counter()
    sums = {split: [memo.checksum(path) for path in group] for split, group in paths.items()}
    memo.save()
    if memo.hashed_bytes:
        seconds = time.perf_counter() - start
        log.info("cache: checksummed %.2f GB of source in %.1f s", memo.hashed_bytes / 1e9, seconds)
    return sums


@contextlib.contextmanager
def building_caches(cache_root: Path) -> Iterator[None]:
    """One builder per cache folder: other processes on the node wait, then find the cache built."""
    with node_lock(Path(cache_root) / LOCK, f"another process to finish building caches in {cache_root}"):
        yield


def build_cache(name: str, task: TaskConfig, source: Path | SplitFiles, cache_root: Path) -> CacheInfo:
    """Return the valid cache for this task, building it first if needed (a no-op when it exists).

    Also writes the window index for ``task.initial_step`` (autoregressive tasks), so ranks only read.
    """
    paths = _source_paths(source)
    if _uses_stats(task, _as_files(source)) and _as_files(source).stats_file.is_file():
        paths["stats"] = [_as_files(source).stats_file]  # its content decides the normalisation: part of the key
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    with building_caches(cache_root):
        checksums = _checksums(cache_root, paths)
        final = cache_root / name / cache_key(task, checksums)
        info = CacheInfo.load(final, CACHE_FORMAT) or _repoint(final, paths)
        if info is not None:
            log.info("cache %s: up to date at %s", name, final)
        else:
            _say_why_rebuilt(name, final)
            info = _build(name, task, _as_files(source), checksums, final)
        if info.autoregressive and info.n_frames >= window_span(task.initial_step, 1, task.window_stride):
            write_window_index(info, task.initial_step, stride=task.window_stride)
    return info


def _repoint(final: Path, paths: dict[str, list[Path]]) -> CacheInfo | None:
    """A cache in place whose source files were moved or touched, their content unchanged (the checksums in its
    key say so): the same bytes lie at the same offsets, so it maps the files where they are now."""
    try:
        meta = json.loads((final / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != CACHE_FORMAT or not meta.get("in_place"):
        return None
    for name, where in meta["in_place"]["arrays"].items():
        split = name.split("_")[0].removesuffix(".npy")
        source = str(paths.get(split, paths["train"])[0].resolve())
        for field in where["fields"]:
            field["file"] = source
    files = {f["file"] for where in meta["in_place"]["arrays"].values() for f in where["fields"]}
    meta["in_place"]["identity"] = {file: file_identity(file) for file in sorted(files)}
    write_json_atomic(final / MANIFEST, meta)
    log.info("cache %s: its source files moved or were touched, their content unchanged; mapped where they are", final)
    return CacheInfo.load(final, CACHE_FORMAT)


def _say_why_rebuilt(name: str, final: Path) -> None:
    """A cache of an older format beside the one about to be built: say that the format changed."""
    for other in final.parent.glob("*/" + MANIFEST) if final.parent.is_dir() else ():
        try:
            old = json.loads(other.read_text()).get("format")
        except (OSError, ValueError):
            continue
        if old != CACHE_FORMAT:
            log.info(
                "cache %s: the cache format changed (%s -> %s), so the cache is rebuilt; the old one at %s can be "
                "removed",
                name,
                old,
                CACHE_FORMAT,
                other.parent,
            )
            return


def _build(name: str, task: TaskConfig, files: SplitFiles, checksums: dict[str, str], final: Path) -> CacheInfo:
    if final.exists():
        log.warning("cache %s: %s is incomplete or of an old format; rebuilding", name, final)
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # Under the node lock, a temporary folder can only be the leftover of a killed build.
    for stale in final.parent.glob(".*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    start = time.perf_counter()
    with atomic_dir(final) as tmp:
        _write(tmp, task, files, checksums)
    info = CacheInfo.load(final, CACHE_FORMAT)
    if info is None:  # only a mapped source rewritten during the build makes a fresh cache unreadable
        changed = "; ".join(changed_mapped_sources(final)) or "its manifest is unreadable"
        shutil.rmtree(final, ignore_errors=True)
        raise DataError(
            f"cache {name}: the source changed while its cache was being built ({changed}); another process "
            f"rewrote it: let that process finish, then run again"
        )
    log.info(
        "cache %s: built %s in %.1f s (%s)",
        name,
        final,
        time.perf_counter() - start,
        ", ".join(f"{k}={v}" for k, v in info.sizes.items()),
    )
    return info


def window_index_name(split: str, initial_step: int, horizon: int = 1, stride: int = 1) -> str:
    horizon_part, stride_part = f"_h{horizon}" if horizon > 1 else "", f"_s{stride}" if stride > 1 else ""
    return f"{split}_windows_k{initial_step}{horizon_part}{stride_part}.npy"


def window_span(initial_step: int, horizon: int = 1, stride: int = 1) -> int:
    """Saved frames one window covers: ``initial_step + horizon`` frames, ``stride`` apart."""
    return (initial_step + horizon - 1) * stride + 1


def write_window_index(info: CacheInfo, initial_step: int, horizon: int = 1, stride: int = 1) -> None:
    """The (trajectory, start frame) pair of every training window of ``initial_step`` frames + ``horizon``
    target frames.

    Kept beside the arrays (one small int32 file per split and initial_step, so changing initial_step never
    rebuilds the arrays); datasets look windows up in it instead of deriving them, so a split can exclude
    windows (e.g. frames a solver marked invalid) without any change to the readers.
    """
    assert info.autoregressive and info.n_frames >= window_span(initial_step, horizon, stride), "checked by the caller"
    for split in SPLITS:
        path = info.path / window_index_name(split, initial_step, horizon, stride)
        if path.is_file():
            continue
        per_sample = info.frames(split) - window_span(initial_step, horizon, stride) + 1  # a longer split: more
        sample, start = np.divmod(np.arange(info.sizes[split] * per_sample, dtype=np.int64), per_sample)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.save(f, np.stack([sample, start], axis=1).astype(np.int32))


def _plan(task: TaskConfig, files: SplitFiles) -> dict[str, tuple[Any, range, bool]]:
    """Each split's reader and sample range; splits without files of their own are carved from train."""
    train = open_reader(files.paths("train"), task)
    carve_test, carve_val = files.test is None, files.val is None
    ranges = format_of(task.pde).ranges(task, train.n_samples, carve_val, carve_test)
    plan = {"train": (train, ranges["train"], False)}
    for split, carve in (("val", carve_val), ("test", carve_test)):
        if carve:
            plan[split] = (train, ranges[split], True)
        else:
            reader = open_reader(files.paths(split), task)
            # a val or test trajectory may run longer than the training ones (scored to its end), not shorter
            longer = train.n_frames > 1 and reader.n_frames >= train.n_frames
            if reader.grid != train.grid or not (longer or reader.n_frames == train.n_frames):
                raise DataError(
                    f"{reader.path}: grid {reader.grid} x {reader.n_frames} frames differs from the train file "
                    f"{train.path} ({train.grid} x {train.n_frames} frames); the splits must come from one dataset "
                    "(on the same grid; val and test trajectories may be longer than the training ones, not shorter)"
                )
            theirs, ours = reader.describe(), train.describe()
            for key in sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)):
                raise DataError(
                    f"{reader.path}: {key} {theirs.get(key)}, but {ours.get(key)} in the train file {train.path}; "
                    "the splits must come from one dataset"
                )
            plan[split] = (reader, format_of(task.pde).own_range(task, split, reader.n_samples), False)
    return plan


def _copy(
    folder: Path, plan: dict, shapes: dict, whole: dict[str, RunningStats] | None = None
) -> dict[str, RunningStats]:
    """Every split's blocks, as the readers give them, written raw; the train split's statistics taken on the
    way (val/test never leak into them). ``whole``: also the statistics of the train files whole, the splits
    carved from them included (what a dataset's own stats.yaml describes)."""
    stats: dict[str, RunningStats] = {}
    writers: dict[tuple[str, str], NpyWriter] = {}
    try:
        for split in SPLITS:
            reader, samples, carved = plan[split]
            for blocks in reader.parts(samples):
                StopRequested.check()
                for part, block in blocks.items():
                    if (split, part) not in writers:
                        shapes[split, part] = (len(samples), *block.shape[1:])
                        writers[split, part] = NpyWriter(folder / array_name(split, part), shapes[split, part])
                    if split == "train":
                        stats.setdefault(part, RunningStats()).update(block)
                    if whole is not None and (split == "train" or carved):
                        whole.setdefault(part, RunningStats()).update(block)
                    writers[split, part].write(block)
    finally:
        for writer in writers.values():
            writer.close()
    return stats


def _map_in_place(plan: dict, task: TaskConfig, shapes: dict) -> tuple[dict[str, ChannelStats], dict] | None:
    """Where every split's fields lie in their files, when all of them can be mapped in place
    (train.data.cache.in_place); then one read of them takes the train split's statistics. None: copy."""
    keys = format_of(task.pde).array_keys(task)
    placed: dict[tuple[str, str], Placed] = {}
    for split in SPLITS:
        reader, samples, _ = plan[split]
        for part, part_keys in keys.items():
            fields = in_place.locate(reader.path, part_keys, task)
            if fields is None:
                return None
            if len(fields) != len(part_keys):  # channels of one array: named by key and channel
                part_keys = tuple(f"{part_keys[0]}[..., {f.channel}]" for f in fields)
            placed[split, part] = Placed(fields, samples.start, len(samples), part_keys)
    stats = {part: ChannelStats(len(placed["train", part].fields)) for part in keys}
    for (split, part), where in placed.items():
        in_place.scan(where, stats[part] if split == "train" else None)
        shapes[split, part] = (where.count, *where.fields[0].sample_shape, len(where.fields))
    files = {f.file for where in placed.values() for f in where.fields}
    record = {
        "arrays": {array_name(split, part): where.record() for (split, part), where in placed.items()},
        "identity": {file: file_identity(file) for file in sorted(files)},
    }
    return stats, record


def _write(folder: Path, task: TaskConfig, files: SplitFiles, checksums: dict[str, list[str]]) -> None:
    plan = _plan(task, files)
    train = plan["train"][0]
    try:
        shapes: dict[tuple[str, str], tuple[int, ...]] = {}
        mapped = _map_in_place(plan, task, shapes)
        # A split carved from the train files leaves train smaller than what the dataset's stats.yaml describes:
        # that file is then compared with the train files whole.
        whole = {} if _uses_stats(task, files) and any(carved for _, _, carved in plan.values()) else None
        stats, in_place_record = mapped if mapped is not None else (_copy(folder, plan, shapes, whole), None)
        if not stats or not all(shapes.get(("train", part), (0,))[0] for part in stats):
            raise DataError(f"{train.path}: the train split holds no samples")
        moments = {part: acc.result(train.std_floor) for part, acc in stats.items()}
        described = {part: acc.result(train.std_floor) for part, acc in whole.items()} if whole else moments
        published = published_moments(files.stats_file, train, moments, described) if _uses_stats(task, files) else None
        moments = published or moments
        parts = list(moments)
        for split in SPLITS:
            for part in parts:
                if (split, part) not in shapes:  # an empty split (val_fraction 0)
                    shapes[split, part] = (0, *shapes["train", part][1:])
                    np.save(folder / array_name(split, part), np.zeros(shapes[split, part], np.float32))
        manifest = cache_manifest(
            task,
            train,
            shapes,
            moments,
            split_frames={split: reader.n_frames for split, (reader, _, _) in plan.items()},
            sizes={split: len(plan[split][1]) for split in SPLITS},
            statistics="stats.yaml" if published else "train split",
            in_place=in_place_record,
            splits={
                split: {"file": str(reader.path), "samples": [samples.start, samples.stop], "carved": carved}
                for split, (reader, samples, carved) in plan.items()
            },
            source={s: _source_record(files.paths(s), checksums[s]) for s in SPLITS if s in checksums},
        )
    finally:
        for reader, _, _ in plan.values():
            reader.close()
    write_json_atomic(folder / MANIFEST, manifest)  # last: a folder with a manifest is complete


def cache_manifest(
    task: TaskConfig,
    train,
    shapes: dict[tuple[str, str], tuple[int, ...]],
    moments: dict[str, tuple[np.ndarray, np.ndarray]],
    **recorded,
) -> dict:
    """A cache's manifest: what the train split's reader describes, the arrays' ``shapes`` by (split, part), the
    normalising ``moments`` by part, and ``recorded`` (split_frames, sizes, statistics, in_place, splits,
    source) as given."""
    parts = list(moments)
    in_part, out_part = ("", "") if "" in parts else ("x", "y")
    const = shapes["train", "const"][-1] if "const" in parts else 0
    described = train.describe()
    return {
        "format": CACHE_FORMAT,
        "pde": task.pde,
        "autoregressive": in_part == "",
        "grid": list(train.grid),
        "n_frames": train.n_frames,
        "split_frames": recorded.pop("split_frames"),
        "in_channels": shapes["train", in_part][-1] + const,
        "out_channels": shapes["train", out_part][-1],
        "sizes": recorded.pop("sizes"),
        "input_mean": moments[in_part][0].tolist(),
        "input_std": moments[in_part][1].tolist(),
        "target_mean": moments[out_part][0].tolist(),
        "target_std": moments[out_part][1].tolist(),
        "const_channels": const,
        "const_mean": moments["const"][0].tolist() if const else [],
        "const_std": moments["const"][1].tolist() if const else [],
        "channels": described.get("channels", []) + described.get("constant_channels", []),
        "boundary": described.get("boundary", []),
        **recorded,
        "coordinates": train.coordinates(),
        **({"well": described} if described else {}),
    }


def _source_record(paths: list[Path], sums: list[str]) -> dict:
    """One split's sources in the manifest: the file and its checksum, or each file's for a folder of files."""
    entries = [{"path": str(Path(p).resolve()), ALGORITHM: c} for p, c in zip(paths, sums, strict=True)]
    return entries[0] if len(entries) == 1 else {"files": entries}
