"""The reader seam: one interface for every HDF5 layout, chosen from a table by the family's storage style.

A reader covers one split: PDEBench's styles read one file, The Well's a folder of files. The cache stage sees
only this interface:

- ``n_samples``, ``grid``, ``n_frames``: how many trajectories (or steady pairs), their strided grid and frames;
- ``parts(samples)``: blocks of samples as ``{part: float32 array}``, channels last; "" holds trajectories
  (n, t, *grid, c), "x"/"y" steady inputs/targets, "const" per-trajectory constant channels (n, *grid, c);
- ``std_floor``: None (PDEBench: a constant channel keeps its scale) or the floor on a normalising std (The Well);
- ``coordinates()``, ``describe()`` (what the cache manifest records beyond its arrays), ``close()``.

Adding a layout touches this table and its own module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from train.config import TaskConfig
from train.data.formats.pdebench import GroupReader, SingleFileReader
from train.data.formats.well import WellReader
from train.errors import DataError
from train.pdes import LAYOUTS


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


def _one_file(cls) -> Callable[[list[Path], TaskConfig], Reader]:
    def open_(paths: list[Path], task: TaskConfig) -> Reader:
        if len(paths) != 1:
            raise DataError(f"a {task.pde} split is one file, got {len(paths)}: {[str(p) for p in paths]}")
        return cls(paths[0], task.pde, task.spatial_stride, task.temporal_stride)

    return open_


READERS: dict[str, Callable[[list[Path], TaskConfig], Reader]] = {
    "single": _one_file(SingleFileReader),
    "groups": _one_file(GroupReader),
    "well": lambda paths, task: WellReader(paths, task.spatial_stride),
}
"""Storage style (``pdes.Layout.style``) -> the reader of one split's files."""


def open_reader(paths: Path | list[Path], task: TaskConfig) -> Reader:
    """The reader of one split's files for the task's family."""
    paths = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
    return READERS[LAYOUTS[task.pde].style](paths, task)
