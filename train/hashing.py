"""Digests of files, read once in chunks: the one reader behind every file the package fingerprints (source data,
checkpoint shards, downloads and what B2 records of them, the remote's copies, a fine-tuning source, a model's
own file). A leaf: it imports nothing of the package.

xxh3-128 where only this package compares the digest (about 10 GB/s: the read, not the hash, sets the pace);
SHA-1 where a store records it (B2's ``contentSha1``); SHA-256 where a person or another tool may check it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import xxhash

CHUNK = 8 << 20
"""Bytes read at a time: large enough that a read costs about what its bytes do, small enough for any memory."""

ALGORITHMS = {"xxh3_128": xxhash.xxh3_128, "sha1": hashlib.sha1, "sha256": hashlib.sha256}
"""The digests a file may be read for, by the name records carry."""


def hashers(*algorithms: str) -> dict[str, Any]:
    """Fresh hash objects by name, for a caller that sees the bytes go by (a copy)."""
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    assert not unknown, f"no such digest: {unknown} (known: {', '.join(ALGORITHMS)})"
    return {a: ALGORITHMS[a]() for a in algorithms or ("xxh3_128",)}


def file_digest(path: Path, *algorithms: str) -> dict[str, str]:
    """The hex digests of ``path``'s bytes, by algorithm (xxh3-128 when none is named), in one read."""
    digests = hashers(*algorithms)
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            for h in digests.values():
                h.update(view[:n])
    return {name: h.hexdigest() for name, h in digests.items()}
