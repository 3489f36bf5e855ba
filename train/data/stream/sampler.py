"""A rank's batches of a streamed task: the sequence of train.data.stream.order, with the shards each batch
reads on the node before it is handed to the loader, and the blocks after them fetched ahead on a thread."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import numpy as np

from train.data.dataset import EqualBatchSampler
from train.data.stream.node_cache import ShardCache
from train.data.stream.order import EpochOrder, epoch_order, item_ranges

log = logging.getLogger(__name__)


class StreamSampler(EqualBatchSampler):
    """EqualBatchSampler's batches (rank r takes batch r of every ``world_size``) over the streamed order.

    Before a batch's indices go to the loader, the shards of the blocks around it are pinned (no process of the
    node evicts them) and the ones it reads are fetched if missing; the next ``prefetch_blocks`` blocks are
    fetched on a thread. ``behind``: items before the read position whose shards must stay (batches the
    loader's workers may still be reading)."""

    def __init__(
        self,
        cache: ShardCache,
        shard_samples: list[int],
        items_per_sample: int,
        batch_size: int,
        steps: int,
        rank: int,
        world_size: int,
        seed: int,
        stream: int,
        *,
        canonical_nodes: int,
        block_shards: int,
        prefetch_blocks: int,
        behind_batches: int,
        fetching: bool = True,
    ):
        self.offsets = item_ranges(shard_samples, items_per_sample)
        super().__init__(int(self.offsets[-1]), batch_size, steps, rank, world_size, seed, stream)
        self.cache, self.names = cache, list(cache.shards)
        self.canonical_nodes, self.block_shards, self.prefetch_blocks = canonical_nodes, block_shards, prefetch_blocks
        self.behind = behind_batches * self.global_batch
        self.fetching = fetching
        self._ahead: queue.Queue[list[str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def passes(self) -> list[EpochOrder]:
        """The epoch's passes over the shard set (a short set is passed over several times per epoch)."""
        count = -(-self.steps * self.global_batch // self.n_items)
        return [
            epoch_order(self.offsets, self.seed, self.stream, self.epoch, p, self.canonical_nodes, self.block_shards)
            for p in range(count)
        ]

    def order(self) -> np.ndarray:
        return np.concatenate([p.items for p in self.passes()])[: self.steps * self.global_batch]

    def __iter__(self) -> Iterator[list[int]]:
        passes = self.passes()
        order = np.concatenate([p.items for p in passes])
        if self.fetching and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._fetch_ahead, name="shard-prefetch", daemon=True)
            self._thread.start()
        for step in range(self.start, self.stop):
            first = step * self.global_batch
            mine = first + self.rank * self.batch_size
            if not self.fetching:  # the split is on the device already
                yield np.sort(order[mine : mine + self.batch_size]).tolist()
                continue
            needed, ahead = self._around(passes, first, first + self.global_batch - 1)
            self.cache.pin(needed | ahead)
            self._ahead.put(sorted(ahead - needed))
            self.cache.fetch(sorted(needed))
            yield np.sort(order[mine : mine + self.batch_size]).tolist()

    def _around(self, passes: list[EpochOrder], first: int, last: int) -> tuple[set[str], set[str]]:
        """The shards the global batch ``first..last`` needs on the node, and those to fetch ahead."""
        needed, ahead = set(), set()
        for position in (first, last):
            p, at = divmod(position, self.n_items)
            needed |= passes[p].shards_around(at, self.behind if position == first else 0, 0)
            ahead |= passes[p].shards_around(at, 0, self.prefetch_blocks)
            if p + 1 < len(passes) and self.prefetch_blocks and passes[p].block[at] == passes[p].block[-1]:
                ahead |= passes[p + 1].shards_around(0, 0, self.prefetch_blocks - 1)
        return {self.names[s] for s in needed}, {self.names[s] for s in ahead}

    def _fetch_ahead(self) -> None:
        """The prefetch thread: fetches what the batches ahead will read. A failure here is only logged: the
        batch that needs the shard fetches it itself, and waits for (or gives up on) the store there."""
        while (names := self._ahead.get()) is not None:
            try:
                self.cache.fetch(names, wait=False)
            except Exception as e:  # the batch that needs the shard reports it
                log.debug("shard prefetch: %s", e)

    def close(self) -> None:
        """Stop the prefetch thread and drop this process's pins."""
        if self._thread is not None:
            self._ahead.put(None)
            self._thread.join(timeout=5)
        self.cache.unpin()
