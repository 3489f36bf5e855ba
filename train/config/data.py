"""The ``data`` section: how training data reaches the ranks when it is streamed instead of fetched whole."""

from __future__ import annotations

import re

import pydantic
from pydantic import Field

from train.config.section import Section

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12}
_UNITS |= {"tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str, key: str) -> int:
    """``value`` as bytes: an integer, or a number with a unit (``500MB``, ``20 GiB``)."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{key}={value!r}: give bytes as a number with an optional unit (500MB, 20GiB, 1TB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class DataConfig(Section):
    stream: bool = False
    """Stream every task's training split from its shard set (``make shard`` writes one) instead of fetching the
    files whole: shards are fetched into a bounded node cache as training reaches them (docs/streaming.md).
    ``tasks.<name>.stream`` overrides it per task."""
    cache_limit: int | str | None = None
    """Bytes the node's shard cache may hold (``200GB``, ``50 GiB`` or a number); default: the free space of
    run.cache_dir's disk less 10%. A limit below one task's working set (shards being read, the ones before them
    still in the loader and those fetched ahead) is refused before training."""
    canonical_nodes: int = Field(1, ge=1)
    """Streams the shards of an epoch are dealt to; their samples are interleaved, so the sequence of samples is
    the same whatever the number of nodes, ranks and workers. Part of the order: keep it across resumes."""
    block_shards: int = Field(2, ge=1)
    """Shards of a stream whose samples are shuffled together: more mixes better and needs a larger cache."""
    prefetch_blocks: int = Field(1, ge=0)
    """Blocks of every stream fetched ahead, on a thread, while the current one is read."""
    store_wait_s: float = Field(120.0, ge=0)
    """Seconds a rank waits, with back-off, for a store that stopped answering before it stops the run with a
    checkpoint (exit 75): a re-run continues once the store is back."""

    @pydantic.field_validator("cache_limit")
    @classmethod
    def _limit(cls, value: int | str | None) -> int | str | None:
        if value is not None and parse_bytes(value, "data.cache_limit") <= 0:
            raise ValueError(f"data.cache_limit={value!r}: a cache needs room for at least one shard")
        return value

    @property
    def limit_bytes(self) -> int | None:
        """``cache_limit`` in bytes; None: the disk decides."""
        return None if self.cache_limit is None else parse_bytes(self.cache_limit, "data.cache_limit")
