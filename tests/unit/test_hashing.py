"""train/hashing.py, the one reader behind every file digest: each algorithm equal to its library's digest of the
whole bytes, across chunk boundaries, several in one read."""

from __future__ import annotations

import hashlib
import os

import xxhash

from train import hashing


def test_every_digest_equals_its_librarys_over_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "CHUNK", 1000)  # the file spans several reads, the last one short
    data = os.urandom(3 * 1000 + 17)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    want = {
        "xxh3_128": xxhash.xxh3_128(data).hexdigest(),
        "sha1": hashlib.sha1(data).hexdigest(),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    assert hashing.file_digest(path, "xxh3_128", "sha1", "sha256") == want
    assert hashing.file_digest(path) == {"xxh3_128": want["xxh3_128"]}  # the default
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert hashing.file_digest(empty, "sha1") == {"sha1": hashlib.sha1(b"").hexdigest()}
