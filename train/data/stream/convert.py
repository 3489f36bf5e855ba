"""A published file as the cache holds it: its trajectories read by the format's reader (strided, channels last,
float32 physical values) and written as one ``.npy`` per part: the trajectories, and a Well dataset's constant
channels apart. A node converts each published shard once it is fetched and verified, and its val and test files
before training, so every read after that is the memory-mapped read of a repacked shard."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pydantic

from train.atomic import atomic_path
from train.config import TaskConfig
from train.data.cache.cached_array import NpyWriter
from train.data.formats import open_reader
from train.errors import DataError

PARTS = ("const", "")  # the trajectories last: a shard whose trajectories are on disk is complete


def part_file(name: str, part: str) -> str:
    """The node's file of one part of published shard ``name`` (a path in its store): one flat name."""
    return name.replace("/", "__") + (f".{part}" if part else "") + ".npy"


def convert(task: TaskConfig, paths: list[Path], dest: dict[str, Path]) -> int:
    """Write the trajectories of ``paths`` (one split's files, in order) to ``dest[part]``, each complete under
    its final name or absent; returns the trajectories. Files of other parts than ``dest``'s are an error."""
    reader = open_reader(paths, task)
    try:
        n = reader.n_samples
        first = next(iter(reader.parts(range(min(n, 1)))), {})
        if set(first) != set(dest):
            raise DataError(
                f"{paths[0]}: holds the parts {sorted(first)}, its shard set's manifest says {sorted(dest)}: the "
                "file is not of the dataset the set was written from; write the set again (make shard PUBLISHED=1)"
            )
        for part in [p for p in PARTS if p in first]:
            shape = (n, *first[part].shape[1:])
            with atomic_path(dest[part], needed=4 * n * first[part][0].size) as tmp:
                writer = NpyWriter(tmp, shape)
                try:
                    for blocks in reader.parts(range(n)):
                        writer.write(blocks[part])
                finally:
                    writer.close()
        return n
    finally:
        reader.close()


@dataclass(frozen=True)
class Converted:
    """How a node converts a published shard set's files: the task's settings as the manifest's cache was built
    with them, the parts each file gives, and the bytes a trajectory takes converted (every part)."""

    task: dict
    parts: tuple[str, ...]
    sample_bytes: int

    def record(self) -> dict:
        return {"task": self.task, "parts": list(self.parts), "sample_bytes": self.sample_bytes}

    @classmethod
    def from_record(cls, record: dict) -> Converted:
        return cls(record["task"], tuple(record["parts"]), int(record["sample_bytes"]))

    def write(self, name: str, source: Path, folder: Path) -> int:
        """Convert the verified file ``source`` (shard ``name``) into its parts in ``folder``."""
        dest = {part: Path(folder) / part_file(name, part) for part in self.parts}
        return convert(task_config(self.task), [source], dest)


def task_config(settings: dict) -> TaskConfig:
    """The task settings a published set's manifest records, as the config they were read with."""
    try:
        return TaskConfig.model_validate(settings)
    except pydantic.ValidationError as e:
        raise DataError(
            f"a published shard set's manifest records task settings this version does not read ({e.errors()[0]['loc']}"
            f": {e.errors()[0]['msg']}): write the manifest again with this version (make shard PUBLISHED=1)"
        ) from None
