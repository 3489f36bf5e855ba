"""The data stage: give every task a local file for each split, generated, found in place or downloaded.

A task's ``source`` is 'generate', one HDF5 file, a local folder (``file://`` too) or ``b2://bucket/prefix``.
Folders and buckets are searched with the task's templates, split by split, first match wins. The train file
is required; a missing val or test file is carved from the train file by PDEBench's convention for the
file's family, and the log and the run's report say so. Local files are used in place (the cache is the
node-local copy); remote ones are downloaded, verified and renamed into ``data/<task>/<split>.h5``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from train.config import Config, TaskConfig
from train.data import download, generate
from train.data.pdebench import SPLITS
from train.errors import ConfigError, DataError
from train.pdes import GENERATED, LAYOUTS

log = logging.getLogger(__name__)

PDEBENCH_SPLIT_NAMES = {"train": "Train", "val": "Valid", "test": "Test"}
HDF5_SUFFIXES = (".h5", ".hdf5")


@dataclass(frozen=True)
class SplitFiles:
    """A task's local file per split; None means the split is carved from the train file."""

    train: Path
    val: Path | None = None
    test: Path | None = None

    def get(self, split: str) -> Path | None:
        return getattr(self, split)


def _generate(name: str, task: TaskConfig, data_dir: Path, dry_run: bool) -> SplitFiles:
    if task.pde not in GENERATED:
        raise ConfigError(
            f"tasks.{name}: pde '{task.pde}' has no local generator ({', '.join(GENERATED)} do); "
            f"set tasks.{name}.source to a PDEBench file, folder or b2:// location"
        )
    path = data_dir / name / generate.pdebench_filename(task.pde, task.coefficient)
    request = dict(n_samples=task.n_samples, resolution=task.resolution, coefficient=task.coefficient, seed=task.seed)
    if generate.generator_params(path) == {**request, "pde": task.pde, "version": generate.VERSION}:
        log.info("data %s: up to date at %s", name, path)
    elif dry_run:
        print(f"generate {task.n_samples} {task.pde} samples -> {path}")
    else:
        log.info("data %s: generating %d %s samples into %s", name, task.n_samples, task.pde, path)
        generate.generate(task.pde, path, **request)
    return SplitFiles(train=path)


def _single_file(name: str, task: TaskConfig, data_dir: Path, b2_api) -> tuple[SplitFiles, list]:
    """One file holding the whole dataset: used in place, or downloaded when it is remote."""
    if task.source.startswith("b2://"):
        folder, _, file_name = task.source.rpartition("/")
        store = download.open_store(folder, b2_api)
        if store.stat(file_name) is None:
            raise DataError(f"tasks.{name}.source: {task.source} not found")
        dest = data_dir / name / "train.h5"
        return SplitFiles(train=dest), [(store, file_name, dest)]
    path = Path(task.source.removeprefix("file://")).expanduser()
    if not path.is_file():
        raise DataError(f"tasks.{name}.source: data file '{path}' not found; fix the path or use 'generate'")
    log.info("data %s: using %s", name, path)
    return SplitFiles(train=path), []


def _downloaded_earlier(name: str, task: TaskConfig, data_dir: Path) -> SplitFiles | None:
    """Without B2 credentials, the files an earlier run downloaded from this source, if the train file is one."""
    folder = data_dir / name
    manifest = download.read_manifest(folder)
    found = {}
    for split in SPLITS:
        entry = manifest.get(f"{split}.h5")
        path = folder / f"{split}.h5"
        ok = entry and entry.get("source", "").startswith(task.source.rstrip("/") + "/") and path.is_file()
        found[split] = path if ok and path.stat().st_size == entry.get("size") else None
    if found["train"] is None:
        return None
    log.warning(
        "data %s: B2 credentials are not set; using the files downloaded earlier from %s (%s). Set "
        "B2_APPLICATION_KEY_ID and B2_APPLICATION_KEY to check them against the bucket.",
        name, task.source, ", ".join(s for s in SPLITS if found[s]),
    )  # fmt: skip
    return SplitFiles(**found)


def _search(name: str, task: TaskConfig, data_dir: Path, b2_api) -> tuple[SplitFiles, list]:
    """Find each split's file under a folder or bucket with the task's templates."""
    credentials = os.environ.get("B2_APPLICATION_KEY_ID") and os.environ.get("B2_APPLICATION_KEY")
    if task.source.startswith("b2://") and b2_api is None and not credentials:
        earlier = _downloaded_earlier(name, task, data_dir)
        if earlier is not None:
            return earlier, []
    store = download.open_store(task.source, b2_api)
    remote = task.source.startswith("b2://")
    found: dict[str, Path | None] = {}
    jobs = []
    for split in SPLITS:
        tried = []
        for template in task.templates:
            rel = download.check_name(template.format(task=name, split=split, Split=PDEBENCH_SPLIT_NAMES[split]))
            tried.append(f"{store.url.rstrip('/')}/{rel}")
            if store.stat(rel) is None:
                continue
            if remote:
                found[split] = data_dir / name / f"{split}.h5"
                jobs.append((store, rel, found[split]))
            else:
                found[split] = store.path(rel)  # a local file is read in place
            break
        else:
            found[split] = None
            where = "\n    ".join(tried)
            if split == "train":
                raise DataError(
                    f"tasks.{name}: no train file found; tried:\n    {where}\n  "
                    f"(fix tasks.{name}.source or tasks.{name}.templates)"
                )
            family = "single-file" if LAYOUTS[task.pde].test_first else "group-per-seed"
            position = "first" if LAYOUTS[task.pde].test_first else "last"
            log.warning(
                "data %s: no %s file (tried %s); carving it from the train file by PDEBench's %s convention "
                "(the %s samples)",
                name, split, ", ".join(tried), family, position,
            )  # fmt: skip
    assert found["train"] is not None
    return SplitFiles(train=found["train"], val=found["val"], test=found["test"]), jobs


def stage_data(cfg: Config, *, dry_run: bool = False, b2_api=None) -> dict[str, SplitFiles]:
    """Make every task's split files available locally; with ``dry_run`` only print what would be fetched."""
    data_dir = Path(cfg.run.data_dir)
    files, jobs = {}, []
    for name, task in cfg.tasks.items():
        if task.source == "generate":
            files[name] = _generate(name, task, data_dir, dry_run)
            continue
        single = task.source.lower().endswith(HDF5_SUFFIXES)
        files[name], task_jobs = (_single_file if single else _search)(name, task, data_dir, b2_api)
        jobs += task_jobs
    if dry_run:
        for line in download.describe(jobs) if jobs else ["nothing to download"]:
            print(line)
    elif jobs:
        download.fetch_all(jobs, lock_dir=data_dir)
    return files
