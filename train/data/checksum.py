"""Content checksums of source files, remembered per file so an unchanged file is never read twice.

A cache is keyed by what its source files contain, not by their names or timestamps: a re-downloaded or
moved file with the same bytes keeps its cache, a rewrite that kept the size and mtime does not. Hashing
an 8 GB PDEBench file on every run would cost seconds, so each checksum is remembered with the file's
identity (device, inode, size, mtime and ctime). ctime cannot be set from user space and changes on
every write, so a remembered checksum is only reused for bytes that have not been touched since.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from train.atomic import write_json_atomic
from train.errors import DataError
from train.hashing import file_digest

ALGORITHM = "xxh3_128"


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def hash_file(path: Path) -> str:
    """xxh3-128 of the whole file: ~10 GB/s, so the read, not the hash, sets the pace."""
    return file_digest(path, ALGORITHM)[ALGORITHM]


class ChecksumMemo:
    """Checksums of files by resolved path, stored in one JSON file; callers serialise access (a lock)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._entries: dict[str, dict] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._entries = {}
        self._dirty = False
        self.hashed_bytes = 0
        """Bytes read to hash files whose checksum was not remembered."""

    def checksum(self, source: Path) -> str:
        try:
            resolved = source.resolve()
            st = resolved.stat()
        except OSError as e:
            raise DataError(f"data file '{source}' cannot be read: {e}") from None
        key, identity = str(resolved), _identity(st)
        entry = self._entries.get(key)
        if entry is not None and entry.get("identity") == identity and entry.get("algorithm") == ALGORITHM:
            return entry["checksum"]
        try:
            value = hash_file(resolved)
            self.hashed_bytes += st.st_size
        except OSError as e:
            raise DataError(f"data file '{source}' cannot be read: {e}") from None
        # A write during the read would make the checksum describe neither version: do not remember it.
        if _identity(resolved.stat()) == identity:
            self._entries[key] = {"identity": identity, "algorithm": ALGORITHM, "checksum": value}
            self._dirty = True
        return value

    def save(self) -> None:
        if self._dirty:
            write_json_atomic(self.path, self._entries)
            self._dirty = False
