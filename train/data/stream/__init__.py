"""Streaming: a task's training split as shards in a store, fetched into a bounded node cache as training
reaches them (docs/streaming.md).

``shards.py`` writes a shard set (``make shard``) and reads its manifest, ``order.py`` decides the order of an
epoch's samples, ``node_cache.py`` keeps a node's shards within ``data.cache_limit``, ``sampler.py`` feeds a
rank's loader in that order with the shards fetched ahead, and ``stage.py`` prepares a streamed task on the
launcher's side (its manifest, its val and test files, the cache plan).
"""
