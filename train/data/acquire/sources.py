"""The data stage: give every task a local file for each split, generated, found in place or downloaded.

A task's ``source`` is 'generate', one file, a local folder (``file://`` too), ``b2://bucket/prefix`` or an
``https://`` folder. Folders, buckets and servers are searched split by split as the task's Format says
(train.data.formats: PDEBench's templates, The Well's split folders, the neural-operator file names). The train
file is required; a missing val or test split is carved from the train file by the format's convention, and
the log and the run's report say so. Local files are used in place (the cache is the node-local copy); remote
ones are downloaded, verified and renamed into ``data/<task>/`` (PDEBench's as ``<split>.h5``).

Every task's files come with their provenance (where each split came from, what the stage warned about),
which the launcher writes into the run folder: a run can be traced without the data folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from train.atomic import sweep_stale_temporaries, write_json_atomic, write_text_atomic
from train.config import Config, TaskConfig
from train.data.acquire import download, generate
from train.data.acquire.generate_arrays import generate_arrays
from train.data.acquire.generate_fno import generate_fno
from train.data.acquire.generate_neuralop import generate_neuralop
from train.data.acquire.generate_pdearena import generate_pdearena
from train.data.acquire.generate_well import generate_gray_scott
from train.data.checksum import ALGORITHM
from train.data.formats import format_of
from train.data.node_lock import node_lock
from train.data.splits import SPLITS
from train.errors import ConfigError, DataError
from train.pdes import GENERATED, LAYOUTS
from train.stores import is_local, local_path, open_store
from train.stores.b2 import missing_b2_credentials
from train.stores.base import Store, check_name

log = logging.getLogger(__name__)

HDF5_SUFFIXES = (".h5", ".hdf5")
FILE_SUFFIXES = (*HDF5_SUFFIXES, ".mat", ".pt")
"""A source ending in one of these names one file rather than a folder."""


@dataclass(frozen=True)
class Provenance:
    """Where a task's split files came from and what the data stage warned about, JSON-ready.

    ``origins`` maps each split to a dict with ``origin`` ('b2', 'local', 'generated' or 'carved'), ``file``
    (the local file read) and the fields of its kind (docs/outputs.md); never a credential.
    """

    origins: dict[str, dict]
    warnings: tuple[str, ...] = ()

    def record(self, cache_manifest: dict) -> dict:
        """The task's ``data`` and ``data_warnings`` for inputs.json: each origin completed with what the cache
        stage learnt from the file (its sample range, its xxh3-128 checksum, so big files are hashed once)."""
        ranges, sums = cache_manifest.get("splits", {}), cache_manifest.get("source", {})
        data = {}
        for split, origin in self.origins.items():
            kind, samples = origin["origin"], ranges.get(split, {}).get("samples")
            head = {"origin": kind, "file": origin["file"], "samples": samples, "carved": kind == "carved"}
            checksum = {ALGORITHM: sums[split][ALGORITHM]} if ALGORITHM in sums.get(split, {}) else {}
            if "files" in origin:  # a folder of files: each file's checksum beside its own origin
                entries = sums.get(split, {}).get("files", [sums.get(split, {})])
                by_path = {e["path"]: e[ALGORITHM] for e in entries if ALGORITHM in e}
                files = [f | _checksum_of(f["file"], by_path) for f in origin["files"]]
                origin = origin | {"files": files}
            data[split] = head | origin | checksum
        return {"data": data, "data_warnings": list(self.warnings)}


def _checksum_of(file: str, by_path: dict[str, str]) -> dict:
    checksum = by_path.get(str(Path(file).resolve()))
    return {ALGORITHM: checksum} if checksum else {}


@dataclass(frozen=True)
class SplitFiles:
    """A task's local file per split; None means the split is carved from the train file."""

    train: Path | tuple[Path, ...]
    val: Path | tuple[Path, ...] | None = None
    test: Path | tuple[Path, ...] | None = None
    stats_file: Path | None = None
    """A Well dataset's stats.yaml, where it has one."""
    provenance: Provenance | None = field(default=None, compare=False, repr=False)
    """Set by stage_data (not in a dry run); files are equal whatever their provenance."""

    def get(self, split: str) -> Path | tuple[Path, ...] | None:
        return getattr(self, split)

    def paths(self, split: str) -> list[Path]:
        """The split's files: one, several (a folder of them), or none when it is carved from train."""
        value = self.get(split)
        return [] if value is None else [Path(value)] if isinstance(value, str | Path) else [Path(p) for p in value]


@dataclass
class _Found:
    """One task's data stage in progress: its files, the origins known before any download, its warnings and the
    downloads it needs."""

    files: SplitFiles
    origins: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    jobs: list[tuple[Store, str, Path]] = field(default_factory=list)


def iso_utc(ms: int | None) -> str | None:
    """Milliseconds since the epoch (B2's upload_timestamp) as ISO-8601 UTC, e.g. 2025-05-01T12:00:00.250Z."""
    if ms is None:
        return None
    moment = datetime.fromtimestamp(ms // 1000, timezone.utc).replace(microsecond=ms % 1000 * 1000)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _warn(warnings: list[str], message: str) -> None:
    log.warning("%s", message)
    warnings.append(message)


def _local_origin(path: Path) -> dict:
    st = path.stat()
    return {
        "origin": "local",
        "file": str(path.absolute()),
        "size": st.st_size,
        "modified": iso_utc(st.st_mtime_ns // 10**6),
    }


def _bucket_origin(dest: Path, entry: dict) -> dict:
    """A file downloaded from a bucket (b2:// or s3://), from a record shaped like the data folder's manifest
    entries."""
    url = entry["source"]
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return {
        "origin": scheme,
        "file": str(dest.absolute()),
        "url": url,
        "bucket": bucket,
        "key": key,
        "size": entry.get("size"),
        "sha1": entry.get("sha1"),
        "sha1_verified": entry.get("verified"),
        "uploaded": iso_utc(entry.get("uploaded")),
        "file_id": entry.get("version"),
        "sha256": entry.get("sha256"),
    }


def _fetched_origin(store: Store, result: download.FetchResult) -> dict:
    remote = result.remote
    if store.url.startswith(("https://", "http://")):
        return {
            "origin": "https",
            "file": str(result.dest.absolute()),
            "url": f"{store.url}/{remote.name}",
            "size": remote.size,
            "sha256": result.sha256,
            "sha1": result.sha1,
            "version": remote.version,
        }
    # A bucket's SHA1 (B2's, or an S3 object's sha1 metadata) was checked against the bytes (now, or at the
    # download the manifest vouches for) unless it had none
    entry = {
        "source": f"{store.url.rstrip('/')}/{remote.name}",
        "size": remote.size,
        "sha1": result.sha1,
        "verified": remote.sha1 is not None,
        "version": remote.version,
        "uploaded": remote.uploaded,
        "sha256": result.sha256,
    }
    return _bucket_origin(result.dest, entry)


def _carved_origin(task: TaskConfig, split: str, train: dict) -> dict:
    share = f"{split}_fraction={task.test_fraction if split == 'test' else task.val_fraction}"
    if split == "test" and task.files is not None and task.files.n_test:
        share = f"files.n_test={task.files.n_test}"
    return {
        "origin": "carved",
        "file": train["file"],
        "carved_from": train.get("url", train["file"]),
        "convention": f"{format_of(task.pde).carving}; {share}",
    }


def generated_path(data_dir: Path, name: str, task: TaskConfig) -> Path:
    """Where source 'generate' writes a task's file: ``<data_dir>/<task>/`` + generate.generated_filename."""
    settings = dict(n_samples=task.n_samples, resolution=task.resolution, coefficient=task.coefficient, seed=task.seed)
    return Path(data_dir) / name / generate.generated_filename(task.pde, **settings)


def _generate(name: str, task: TaskConfig, data_dir: Path, dry_run: bool) -> _Found:
    if task.pde not in GENERATED:
        raise ConfigError(
            f"tasks.{name}: pde '{task.pde}' has no local generator ({', '.join(GENERATED)} do); "
            f"set tasks.{name}.source to a PDEBench file, folder or b2:// location"
        )
    request = dict(n_samples=task.n_samples, resolution=task.resolution, coefficient=task.coefficient, seed=task.seed)
    path = generated_path(data_dir, name, task)
    # Launchers sharing the folder (a job array's tasks) generate the file once: a second writer would replace
    # it under the cache the first one is mapping. A dry run writes nothing, not even the lock.
    lock = node_lock(path.parent / ".generate.lock", f"another process to finish generating {path}")
    with contextlib.nullcontext() if dry_run else lock:
        params = generate.generator_params(path)
        if params == {**request, "pde": task.pde, "version": generate.VERSION}:
            log.info("data %s: up to date at %s", name, path)
        elif dry_run:
            print(f"generate {task.n_samples} {task.pde} samples -> {path}")
        else:
            log.info("data %s: generating %d %s samples into %s", name, task.n_samples, task.pde, path)
            params = generate.generate(task.pde, path, **request)
    origin = {"origin": "generated", "file": str(path.absolute()), "generator": params}
    return _Found(SplitFiles(train=path), {"train": origin})


def _single_file(name: str, task: TaskConfig, data_dir: Path, b2_api) -> _Found:
    """One file holding the whole dataset: used in place, or downloaded when it is remote."""
    if not is_local(task.source):
        folder, _, file_name = task.source.rpartition("/")
        store = open_store(folder, b2_api)
        if store.stat(file_name) is None:
            raise DataError(f"tasks.{name}.source: {task.source} not found")
        dest = data_dir / name / "train.h5"
        return _Found(SplitFiles(train=dest), jobs=[(store, file_name, dest)])
    path = local_path(task.source)
    if not path.is_file():
        raise DataError(f"tasks.{name}.source: data file '{path}' not found; fix the path or use 'generate'")
    log.info("data %s: using %s", name, path)
    return _Found(SplitFiles(train=path), {"train": _local_origin(path)})


def _downloaded_earlier(name: str, task: TaskConfig, data_dir: Path) -> _Found | None:
    """Without B2 credentials, the files an earlier run downloaded from this source, if the train file is one."""
    folder = data_dir / name
    manifest = download.read_manifest(folder)
    found, origins = {}, {}
    for split in SPLITS:
        entry = manifest.get(f"{split}.h5")
        path = folder / f"{split}.h5"
        ok = entry and entry.get("source", "").startswith(task.source.rstrip("/") + "/") and path.is_file()
        found[split] = path if ok and path.stat().st_size == entry.get("size") else None
        if found[split] is not None:
            origins[split] = _bucket_origin(path, entry)
    if found["train"] is None:
        return None
    result = _Found(SplitFiles(**found), origins)
    _warn(
        result.warnings,
        f"data {name}: B2 credentials are not set; using the files downloaded earlier from {task.source} "
        f"({', '.join(s for s in SPLITS if found[s])}). Set B2_APPLICATION_KEY_ID and B2_APPLICATION_KEY to check "
        "them against the bucket.",
    )
    return result


def _search(name: str, task: TaskConfig, location: str, data_dir: Path, b2_api) -> _Found:
    """Find each split's files under a folder, bucket or server by the task's Format; remote ones are downloaded
    into ``data/<task>/``, local ones used in place."""
    fmt = format_of(task.pde)
    if location.startswith("b2://") and b2_api is None and missing_b2_credentials() and not fmt.keeps_names:
        earlier = _downloaded_earlier(name, task, data_dir)
        if earlier is not None:
            return earlier
    store = open_store(location, b2_api)
    remote = not is_local(location)
    if fmt.archive is not None and not fmt.locate(store, name, task, "train"):
        packed = fmt.archive(task)
        if store.stat(packed) is not None:  # the published archive instead of the files: read what it holds
            location = _unpacked(name, store, packed, remote, data_dir, fmt)
            store, remote = open_store(location), False
    found: dict[str, Path | tuple[Path, ...] | None] = {}
    origins, warnings, jobs = {}, [], []
    for split in SPLITS:
        names = [check_name(n) for n in fmt.locate(store, name, task, split)]
        if not names:
            found[split] = None
            _no_file(name, task, split, store, warnings)
            continue
        if len(names) > 1 and not fmt.many_files:
            raise DataError(f"tasks.{name}: a {task.pde} {split} split is one file, found {names} in {store.url}")
        if remote:
            paths = [data_dir / name / (n if fmt.keeps_names else f"{split}.h5") for n in names]
            jobs += [(store, n, p) for n, p in zip(names, paths, strict=True)]
        else:
            paths = [store.path(n) for n in names]  # a local file is read in place
            origins[split] = _local_origin(paths[0])
            if fmt.many_files:
                folder = paths[0].parent
                origins[split] = {"origin": "local", "file": str(folder), "files": [_local_origin(p) for p in paths]}
        found[split] = tuple(paths) if fmt.many_files else paths[0]
    stats = None
    if fmt.stats_file and store.stat(fmt.stats_file) is not None:
        stats = data_dir / name / fmt.stats_file if remote else store.path(fmt.stats_file)
        if remote:
            jobs.append((store, fmt.stats_file, stats))
    log.info(
        "data %s: %s at %s (%s)",
        name,
        task.pde,
        location,
        ", ".join(f"{s}: {len(SplitFiles(**found).paths(s))} file(s)" for s in SPLITS),
    )
    files = SplitFiles(train=found["train"], val=found["val"], test=found["test"], stats_file=stats)
    return _Found(files, origins, warnings, jobs)


def _no_file(name: str, task: TaskConfig, split: str, store: Store, warnings: list[str]) -> None:
    """A split the store has no file of: the train split is an error listing where it was looked for; val under
    val_fraction 0 is no split at all; another is carved from the train file, with a warning where the format
    expected a file of its own."""
    fmt = format_of(task.pde)
    wanted = fmt.looks_for(name, task, split)
    tried = [f"{store.url.rstrip('/')}/{w}" for w in wanted or []]
    if split == "train":
        where = "\n    ".join(tried)
        raise DataError(
            f"tasks.{name}: no train file found; tried:\n    {where}\n  (fix tasks.{name}.source, "
            f"tasks.{name}.templates or tasks.{name}.files; the layout: {fmt.docs})"
        )
    if split == "val" and task.val_fraction == 0:  # asked for: no validation, nothing carved
        log.info("data %s: no val split (tasks.%s.val_fraction is 0): no validation", name, name)
    elif wanted is None:  # the format's convention: no file of this split, always carved
        log.info("data %s: the %s split is carved from the train file by %s", name, split, fmt.carving)
    else:
        message = f"data {name}: no {split} file (tried {', '.join(tried)}); carving it from the train file by "
        _warn(warnings, message + fmt.carving)


def _unpacked(name: str, store: Store, packed: str, remote: bool, data_dir: Path, fmt) -> str:
    """The folder under ``data/<task>/`` holding what a published archive holds (downloaded first when remote,
    verified as any download); unpacked once, later runs find its files there."""
    archive = data_dir / name / packed if remote else store.path(packed)
    if remote:
        download.fetch_all([(store, packed, archive)], lock_dir=data_dir)
    folder = data_dir / name / Path(packed).name.partition(".")[0]
    with node_lock(data_dir / name / ".unpack.lock", f"another process to finish unpacking {archive}"):
        if not (folder / ".unpacked").is_file():
            fmt.unpack(archive, folder)
            write_text_atomic(folder / ".unpacked", f"{archive}\n")  # last: the folder is complete
    log.info("data %s: %s unpacked into %s", name, archive, folder)
    return str(folder)


def _with_provenance(found: _Found, task: TaskConfig, fetched: dict[Path, tuple]) -> SplitFiles:
    origins, warnings = dict(found.origins), list(found.warnings)
    for split in SPLITS:
        paths = found.files.paths(split)
        if paths and all(p in fetched for p in paths):
            entries = [_fetched_origin(*fetched[p]) for p in paths]
            warnings += [w for p in paths for w in fetched[p][1].warnings]
            if isinstance(found.files.get(split), tuple):  # a folder of files (The Well)
                url = entries[0]["url"].rpartition("/")[0]
                origins[split] = {
                    "origin": entries[0]["origin"],
                    "file": str(paths[0].parent),
                    "url": url,
                    "files": entries,
                }
            else:
                origins[split] = entries[0]
    for split in SPLITS:
        if found.files.get(split) is None:
            no_val = split == "val" and task.val_fraction == 0
            origins[split] = {"origin": "none"} if no_val else _carved_origin(task, split, origins["train"])
    provenance = Provenance({split: origins[split] for split in SPLITS}, tuple(warnings))
    return replace(found.files, provenance=provenance)


DEMO_GENERATORS = {
    "well": lambda folder, t: sorted(generate_gray_scott(folder, seed=t.seed).rglob("*.hdf5")),
    "fno_mat": lambda folder, t: generate_fno(folder, t.pde, t.n_samples, t.resolution, t.seed),
    "neuralop_pt": lambda folder, t: generate_neuralop(folder, t.pde, t.n_samples, t.resolution, t.seed),
    # every solver step recorded: at the demo's coarse grid, the standard set's 6 time units between frames move
    # the smoke further than a small model learns from a few hundred trajectories (docs/pdearena.md)
    "pdearena": lambda folder, t: generate_pdearena(folder, t.n_samples, t.resolution, t.seed, sample_rate=1),
    "arrays": lambda folder, t: generate_arrays(
        folder, t.n_samples, t.resolution, t.seed, t.files.train_file, t.files.test_file
    ),
}
"""Storage style -> the demo dataset of source 'generate' written in that format into a folder, the paths it
wrote (PDEBench's families generate one file each: train.data.acquire.generate)."""
DEMO_RECORD = ".generated.json"
"""What a demo folder was generated with, and its files: written last, so a folder with it is complete."""


def _generate_demo(name: str, task: TaskConfig, data_dir: Path, dry_run: bool) -> str | None:
    """The folder source 'generate' writes a demo dataset of the task's format into (once for its settings: a
    run resumed or repeated finds the same files); None in a dry run."""
    folder = data_dir / name
    request = {"pde": task.pde, "n_samples": task.n_samples, "resolution": task.resolution, "seed": task.seed}
    if dry_run:
        print(f"generate a {task.pde} demo dataset -> {folder}")
        return None
    with node_lock(folder / ".generate.lock", f"another process to finish generating {folder}"):
        record = _read_json(folder / DEMO_RECORD)
        if record.get("request") != request:
            files = [str(p) for p in DEMO_GENERATORS[LAYOUTS[task.pde].style](folder, task)]
            for stale in set(record.get("files", [])) - set(files):  # found beside the new ones otherwise
                Path(stale).unlink(missing_ok=True)
            write_json_atomic(folder / DEMO_RECORD, {"request": request, "files": files})
            log.info("data %s: a %s demo dataset generated in %s", name, task.pde, folder)
    return str(folder)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _file_source(task: TaskConfig) -> tuple[str, TaskConfig]:
    """A neural-operator task whose source names one file: that file is the train file of its folder."""
    folder, _, file_name = task.source.rstrip("/").rpartition("/")
    return folder or ".", task.model_copy(update={"files": task.files.model_copy(update={"train_file": file_name})})


def stage_data(cfg: Config, *, dry_run: bool = False, b2_api=None) -> dict[str, SplitFiles]:
    """Make every task's split files available locally; with ``dry_run`` only print what would be fetched.
    A streamed task (Config.streamed) is left to train.data.stream and has no entry.

    Each task's SplitFiles carries its ``provenance`` (not in a dry run, which fetches nothing)."""
    data_dir = Path(cfg.run.data_dir)
    if not dry_run:
        for stale in sweep_stale_temporaries(data_dir):
            log.warning("removed %s, a partial file a killed writer left behind", stale)
    found: dict[str, _Found] = {}
    for name, task in cfg.tasks.items():
        if cfg.streamed(name):  # its shard set is read by train.data.stream, not fetched whole
            continue
        whole_file, location = format_of(task.pde).whole_file, task.location
        if whole_file and task.source == "generate":
            found[name] = _generate(name, task, data_dir, dry_run)
        elif whole_file and task.source.lower().endswith(HDF5_SUFFIXES):
            found[name] = _single_file(name, task, data_dir, b2_api)
        else:
            if location == "generate":
                location = _generate_demo(name, task, data_dir, dry_run)
                if location is None:  # a dry run writes nothing
                    found[name] = _Found(SplitFiles(train=()))
                    continue
            elif task.files is not None and task.source.lower().endswith(FILE_SUFFIXES):
                location, task = _file_source(task)
            found[name] = _search(name, task, location, data_dir, b2_api)
    jobs = [job for f in found.values() for job in f.jobs]
    if dry_run:
        for line in download.describe(jobs) if jobs else ["nothing to download"]:
            print(line)
        return {name: f.files for name, f in found.items()}
    results = download.fetch_all(jobs, lock_dir=data_dir) if jobs else []
    for name in found:
        check_splits = format_of(cfg.tasks[name].pde).check_splits
        if check_splits is not None:  # e.g. the files of every split are of one dataset, or nothing is cached
            check_splits({split: found[name].files.paths(split) for split in SPLITS})
    fetched = {result.dest: (store, result) for (store, _, _), result in zip(jobs, results, strict=True)}
    return {name: _with_provenance(f, cfg.tasks[name], fetched) for name, f in found.items()}
