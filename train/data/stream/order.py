"""The order of a streamed epoch's samples: a pure function of (seed, task stream, epoch, pass, canonical nodes).

The shards are shuffled and dealt to ``canonical_nodes`` streams; each stream reads its shards in blocks of
``block_shards``, the samples of a block shuffled together; the streams' samples are interleaved one by one.
Ranks take consecutive slices of that sequence (rank r of W takes batch r of every W), so the sequence does not
depend on the number of nodes, ranks or workers: a run resumed on another world size continues it where it
stopped. Only the blocks around the read position need to be on the node: the one being read, the one before it
(batches the loader's workers may still hold) and ``prefetch_blocks`` ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EpochOrder:
    """One pass over a shard set's items in streamed order."""

    items: np.ndarray
    """Item indices (training windows) in the order they are trained on."""
    block: np.ndarray
    """The block (of its stream) each position's item belongs to; streams advance together."""
    blocks: list[list[list[int]]]
    """[stream][block] -> the shards (indices into the manifest's list) of that block."""

    def shards_around(self, position: int, behind: int, ahead_blocks: int) -> set[int]:
        """The shards of the blocks read from ``position - behind`` to ``position`` and ``ahead_blocks`` past
        them, in every stream: what must be on the node (or arrive) while the loader reads at ``position``."""
        position = min(max(position, 0), len(self.items) - 1)
        span = self.block[max(0, position - behind) : position + 1]
        first, last = int(span.min()), int(span.max()) + ahead_blocks
        return {s for stream in self.blocks for k in range(first, min(last, len(stream) - 1) + 1) for s in stream[k]}


def item_ranges(shard_samples: list[int], items_per_sample: int) -> np.ndarray:
    """(shards + 1) offsets: shard s holds items ``offsets[s]:offsets[s + 1]`` (a sample's windows in a row)."""
    return np.concatenate([[0], np.cumsum(np.asarray(shard_samples, np.int64) * items_per_sample)])


def epoch_order(
    offsets: np.ndarray, seed: int, stream: int, epoch: int, pass_: int, canonical_nodes: int, block_shards: int
) -> EpochOrder:
    """Pass ``pass_`` of epoch ``epoch`` over the items of shards whose item ranges are ``offsets``."""
    n_shards = len(offsets) - 1
    rng = np.random.default_rng([seed, stream, epoch, pass_, 0x5A4D])
    dealt = rng.permutation(n_shards)
    streams, positions, owners, blocks_of = [], [], [], []
    blocks: list[list[list[int]]] = []
    for node in range(min(canonical_nodes, n_shards)):
        mine = dealt[node::canonical_nodes]
        node_blocks = [mine[k : k + block_shards].tolist() for k in range(0, len(mine), block_shards)]
        blocks.append(node_blocks)
        parts, block_ids = [], []
        for k, shards in enumerate(node_blocks):
            items = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in shards])
            parts.append(np.random.default_rng([seed, stream, epoch, pass_, node, k]).permutation(items))
            block_ids.append(np.full(len(items), k, np.int32))
        stream_items = np.concatenate(parts)
        streams.append(stream_items)
        blocks_of.append(np.concatenate(block_ids))
        positions.append(np.arange(len(stream_items)))
        owners.append(np.full(len(stream_items), node))
    # One sample of each stream in turn (a stream that ran out is skipped): sort by (position, stream).
    rank = np.lexsort((np.concatenate(owners), np.concatenate(positions)))
    return EpochOrder(np.concatenate(streams)[rank], np.concatenate(blocks_of)[rank], blocks)
