"""The Format table: one row per storage style (``pdes.Layout.style``), everything the pipeline asks of a format.

A row says how to find a split's files in a store (:attr:`Format.locate`), how to open them (a reader, below),
which samples of a file each split takes and how a missing split is carved from the train file, whether a
source can be mapped in place, how many channels to assume before a file is read (the doctor's capacity
plan), which metrics evaluation reports, whether ``predict`` writes predictions back in the format (or what to
use instead), and its docs page. The data stage, the cache, the doctor, evaluation, the report and predict
ask this table; adding a format touches its own module, its row here and its docs page (docs/layout.md).

A reader covers one split's files. The cache stage sees only this interface:

- ``n_samples``, ``grid``, ``n_frames``: how many trajectories (or steady pairs), their strided grid and frames;
- ``parts(samples)``: blocks of samples as ``{part: float32 array}``, channels last; "" holds trajectories
  (n, t, *grid, c), "x"/"y" steady inputs/targets, "const" per-trajectory constant channels (n, *grid, c);
- ``std_floor``: None (a constant channel keeps its scale) or the floor on a normalising std (The Well);
- ``coordinates()``, ``describe()`` (what the cache manifest records beyond its arrays), ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from train.config import TaskConfig
from train.data.formats import arrays, fno_mat, neuralop_pt, pdearena, pdebench, well
from train.data.splits import split_ranges
from train.errors import DataError
from train.pdes import LAYOUTS, Layout


class Reader(Protocol):
    path: Path
    n_samples: int
    std_floor: float | None

    @property
    def grid(self) -> tuple[int, ...]: ...

    @property
    def n_frames(self) -> int: ...

    def parts(self, samples: range) -> Iterator[dict[str, np.ndarray]]: ...

    def coordinates(self) -> dict[str, list[float]]: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


def layout_keys(task: TaskConfig) -> dict[str, tuple[str, ...]]:
    """The cache's parts and the keys each is read from, as the registry says: {"": targets} for trajectories,
    {"x": inputs, "y": targets} for steady pairs."""
    layout = LAYOUTS[task.pde]
    return {"": layout.targets} if layout.autoregressive else {"x": layout.inputs, "y": layout.targets}


Locate = Callable[["object", str, TaskConfig, str], list[str]]
"""(store, task name, task, split) -> the split's file names in the store, relative to its root; [] if none."""


@dataclass(frozen=True)
class Format:
    """What the pipeline needs to know of one storage style (the fields are its questions)."""

    open: Callable[[list[Path], TaskConfig], Reader]
    """One split's local files -> their reader."""
    locate: Locate
    """Where a split's files are in a folder, bucket or server (``source``)."""
    looks_for: Callable[[str, TaskConfig, str], list[str] | None]
    """(task name, task, split) -> the names or patterns ``locate`` tries, for messages; None where the format's
    convention has no file of that split (carving it is then no cause for a warning)."""
    carving: str
    """How a split missing from the source is carved from the train file, for the log and the provenance."""
    ranges: Callable[[TaskConfig, int, bool, bool], dict[str, range]]
    """(task, samples in the train file, carve val, carve test) -> each split's samples of the train file."""
    own_range: Callable[[TaskConfig, str, int], range] = lambda task, split, n: range(n)
    """(task, split, samples in the split's own file) -> the samples of it the split takes."""
    whole_file: bool = False
    """A source may be one file holding the whole dataset, every split carved from it (PDEBench's); source
    'generate' then writes one such file (train.data.acquire.generate)."""
    many_files: bool = False
    """A split may be several files (read in sorted order); downloads keep the files' own names."""
    keeps_names: bool = True
    """A downloaded file keeps its relative name under data/<task>/ (False: PDEBench's ``<split>.h5``)."""
    stats_file: str | None = None
    """A file of the dataset's statistics beside its split folders, fetched with them (The Well's stats.yaml)."""
    check_splits: Callable[[dict[str, list[Path]]], None] | None = None
    """Checks the files of every split together once they are local (The Well's: one dataset, one schema)."""
    archive: Callable[[TaskConfig], str] | None = None
    """The published archive that holds the split files, where the format has one (neuraloperator's
    ``{name}_{res}.tgz``): used when the files themselves are not in the source."""
    unpack: Callable[[Path, Path], list[Path]] | None = None
    """(archive, folder) -> the split files extracted into the folder, checked member by member."""
    assumed_channels: Callable[[Layout], tuple[int, int]] = lambda layout: (len(layout.inputs), len(layout.targets))
    """Input and output channels as far as the registry tells before a file is read (the doctor's capacity plan,
    the model's parameter estimate)."""
    in_place: Callable[[Path, tuple[str, ...], TaskConfig], list[pdebench.Place] | None] | None = None
    """(file, keys, task) -> where each key's samples lie in the file when its bytes are what the cache would hold
    (plain float32, samples first), so the cache maps them instead of copying (train.data.cache.in_place);
    None: always copied."""
    array_keys: Callable[[TaskConfig], dict[str, tuple[str, ...]]] = layout_keys
    """(task) -> the cache's parts and the keys they are read from, for mapping them in place (the registry's;
    a generic-array task's from its settings)."""
    metrics: tuple[str, ...] = ("pdebench",)
    """The metric families evaluation reports: "pdebench" (PDEBench's metrics and the relative L2,
    train.engine.metrics) for every format, "well" (The Well's VRMSE, windowed and rolled out) for its datasets."""
    write_back: Callable[[Path, Reader, np.ndarray, np.ndarray], None] | None = None
    """(output, the input's reader, its inputs, the predictions: channels last, whole) -> ``predict``'s output
    file in the input's format; None: predict's HDF5 writer of PDEBench's layouts (train.use.predict)."""
    predicts: str | None = None
    """None: ``predict`` writes predictions in this format; else why not and what to use instead."""
    docs: str = "docs/data-formats.md"


def _pdebench_ranges(test_first: bool):
    def ranges(task: TaskConfig, n: int, carve_val: bool, carve_test: bool) -> dict[str, range]:
        return split_ranges(
            n, task.test_fraction if carve_test else 0.0, task.val_fraction if carve_val else 0.0, test_first
        )

    return ranges


def counted_ranges(task: TaskConfig, n: int, carve_val: bool, carve_test: bool) -> dict[str, range]:
    """The neural-operator convention (the FNO paper's scripts): train is the file's first ``files.n_train``
    samples, a carved test split its last ``files.n_test``. A carved val split (``val_fraction`` of the training
    count) takes the samples the reference leaves unused between them, as many as there are up to that count,
    so the published training set stays whole; only where none is unused does it come off train's end."""
    files = task.files
    n_test = (files.n_test or max(1, round(n * task.test_fraction))) if carve_test else 0
    available = n - n_test
    n_train = min(files.n_train or available, available)
    n_val = round(n_train * task.val_fraction) if carve_val else 0
    if available > n_train:
        n_val = min(n_val, available - n_train)
    else:
        n_train -= n_val
    if n_train < 1:
        raise DataError(
            f"{n} samples are too few for test={n_test}, val={n_val} and a training set; lower "
            f"tasks.<name>.files.n_test or val_fraction"
        )
    return {"train": range(0, n_train), "val": range(n_train, n_train + n_val), "test": range(n - n_test, n)}


def _first_n(task: TaskConfig, split: str, n: int) -> range:
    """A split from its own file: the first ``files.n_test`` (test) or ``files.n_train`` (train) samples."""
    count = task.files.n_test if split == "test" else task.files.n_train if split == "train" else None
    return range(min(count or n, n))


def _any_name(locate: Callable[[object, TaskConfig, str], list[str]]) -> Locate:
    """A ``locate`` that does not need the task's name."""
    return lambda store, name, task, split: locate(store, task, split)


def _named(split_file: Callable[[TaskConfig, str], str | None]) -> Callable[[str, TaskConfig, str], list | None]:
    """A ``looks_for`` from the one name (or pattern) a format gives each split, None where it has none."""
    return lambda name, task, split: [file] if (file := split_file(task, split)) else None


_OPERATOR = dict(
    ranges=counted_ranges,
    own_range=_first_n,
    carving="the neural-operator convention: train the first files.n_train samples, test the last "
    "files.n_test, val the unused ones between them (else train's last)",
)

FORMATS: dict[str, Format] = {
    "single": Format(
        open=pdebench.open_single,
        locate=pdebench.locate,
        looks_for=pdebench.looks_for,
        carving="PDEBench's single-file convention: test, val, train in sample order",
        ranges=_pdebench_ranges(True),
        whole_file=True,
        keeps_names=False,
        in_place=pdebench.plain_fields,
        docs="docs/data-formats.md",
    ),
    "groups": Format(
        open=pdebench.open_groups,
        locate=pdebench.locate,
        looks_for=pdebench.looks_for,
        carving="PDEBench's group-per-seed convention: train, val, test in sorted group order",
        ranges=_pdebench_ranges(False),
        whole_file=True,
        keeps_names=False,
        docs="docs/data-formats.md",
        assumed_channels=lambda layout: (layout.channels or 1, layout.channels or 1),
    ),
    "well": Format(
        open=lambda paths, task: well.WellReader(paths, task.spatial_stride),
        locate=well.locate,
        looks_for=well.looks_for,
        carving="the train files' last trajectories",
        ranges=_pdebench_ranges(False),
        many_files=True,
        stats_file="stats.yaml",
        check_splits=well.check_splits_agree,
        metrics=("pdebench", "well"),
        docs="docs/well.md",
        assumed_channels=lambda layout: (4, 4),  # in the files: a guess for the estimates
        predicts="a Well split is a folder of files, predict writes one file; use the Python API (Surrogate.rollout)",
    ),
    "fno_mat": Format(
        open=fno_mat.open_fno_mat,
        locate=_any_name(fno_mat.locate_fno_mat),
        looks_for=_named(lambda task, split: {"train": task.files.train_file, "test": task.files.test_file}.get(split)),
        write_back=fno_mat.write_predictions,
        docs="docs/fno-mat.md",
        **_OPERATOR,
    ),
    "neuralop_pt": Format(
        open=neuralop_pt.open_neuralop_pt,
        locate=_any_name(neuralop_pt.locate_neuralop_pt),
        looks_for=_named(lambda task, split: neuralop_pt.split_filename(task, split) if split != "val" else None),
        archive=lambda task: f"{neuralop_pt.NAMES[task.pde]}_{task.files.resolution}.tgz",
        unpack=neuralop_pt.unpack_archive,
        in_place=neuralop_pt.plain_tensors,
        write_back=neuralop_pt.write_predictions,
        docs="docs/neuralop-pt.md",
        **_OPERATOR,
    ),
    "pdearena": Format(
        open=pdearena.open_pdearena,
        locate=_any_name(pdearena.locate_pdearena),
        looks_for=_named(lambda task, split: f"*{pdearena.SPLIT_WORDS[split]}*.h5"),
        many_files=True,
        write_back=pdearena.write_predictions,
        docs="docs/pdearena.md",
        **_OPERATOR,
    ),
    "arrays": Format(
        open=arrays.open_arrays,
        locate=_any_name(arrays.locate_arrays),
        looks_for=_named(
            lambda task, split: {
                "train": task.files.train_file,
                "val": task.files.val_file,
                "test": task.files.test_file,
            }.get(split)
        ),
        carving="the train file's samples in order: train, val, test (val_fraction, test_fraction)",
        ranges=_pdebench_ranges(False),
        in_place=arrays.plain_channels,
        array_keys=arrays.parts_keys,
        assumed_channels=lambda layout: (4, 4),  # said per task or in the files: a guess for the estimates
        write_back=arrays.write_predictions,
        docs="docs/arrays.md",
    ),
}
"""Storage style (``pdes.Layout.style``) -> its Format."""


def format_of(pde: str) -> Format:
    """The Format of an equation family."""
    return FORMATS[LAYOUTS[pde].style]


def open_reader(paths: Path | list[Path], task: TaskConfig) -> Reader:
    """The reader of one split's files for the task's family."""
    paths = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
    return format_of(task.pde).open(paths, task)
