"""A node's bounded cache of one shard set's shards.

Whole shards, shared by every rank and DataLoader worker of the node through a file lock, each verified (SHA1
against the shard set's manifest) before it takes its final name, evicted least recently used. Never evicted:
a shard some live process of the node pinned (the blocks its loader reads or fetches ahead: ``pins/<pid>``),
and never anything of a local shard set, which is read where it lies (it has no other copy). A dataset's files as
published (train.data.stream.published) are converted into the node's folder once verified, wherever they lie:
the conversions are what is held and evicted, the files are never touched. A store that stops answering is waited
for with back-off, then the run stops with a checkpoint (StoreUnavailable, exit 75).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from train.atomic import atomic_path, write_json_atomic
from train.data.node_lock import node_lock
from train.data.stream.convert import Converted, part_file
from train.disk import disk_full_error, human
from train.errors import ConfigError, DataError, StoreUnavailable
from train.hashing import file_digest
from train.stores import is_local, local_path, open_store
from train.stores.base import Transient

log = logging.getLogger(__name__)

PINS = "pins"
LOCK = ".lock"
DOWNLOADS = ".downloads"  # a published file while it is verified and converted
FETCHED = "fetched.jsonl"  # one line per shard fetched: what the benchmark and the tests count


@dataclass(frozen=True)
class Shard:
    """One shard of a shard set, as its manifest lists it."""

    name: str
    bytes: int
    sha1: str
    samples: int

    def record(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "sha1": self.sha1, "samples": self.samples}

    @classmethod
    def from_record(cls, record: dict) -> Shard:
        return cls(record["name"], int(record["bytes"]), record["sha1"], int(record["samples"]))


class ShardCache:
    """The shards of the shard set at ``url`` on this node: in ``folder`` (a remote set) or where they lie (a
    local one), within ``limit`` bytes. Nothing but names and numbers survive pickling: a loader's worker opens
    the store itself, and only when a shard it reads is missing."""

    def __init__(
        self,
        url: str,
        folder: Path | str,
        shards: list[Shard],
        limit: int,
        wait_s: float,
        convert: Converted | None = None,
    ):
        self.url, self.limit, self.wait_s, self.convert = url, int(limit), float(wait_s), convert
        # Published files are converted into the node's folder, wherever they lie: the copy there has the
        # original as its copy, so it may be evicted like a fetched one.
        self.local = is_local(url) and convert is None
        self.folder = local_path(url) if self.local else Path(folder)
        self.shards = {s.name: s for s in shards}
        self._store = None
        self._pinned: set[str] | None = None
        self._lock = threading.Lock()  # the loader's thread and the prefetch thread fetch one at a time

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None, "_pinned": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def store(self):
        if self._store is None:
            self._store = open_store(self.url)
        return self._store

    def path(self, name: str, part: str = "") -> Path:
        """The shard's file on this node (of ``part``, a converted published file's), fetched first if it is not
        here."""
        path = self.folder / (part_file(name, part) if self.convert else name)
        if self.local or path.is_file():
            return path
        self.fetch([name])
        return path

    def files(self, name: str) -> list[Path]:
        """Every file of shard ``name`` on this node: itself, or a published file's converted parts."""
        if self.convert is None:
            return [self.folder / name]
        return [self.folder / part_file(name, part) for part in self.convert.parts]

    def footprint(self, shard: Shard) -> int:
        """Bytes a shard takes while it is fetched: a published file's download and its conversion side by side."""
        return shard.bytes + (shard.samples * self.convert.sample_bytes if self.convert else 0)

    def usage(self) -> int:
        """Bytes of shards held now (what the limit bounds)."""
        if self.local:
            return 0
        return sum(size for _, _, size in self._held())

    def _held(self) -> list[tuple[str, float, int]]:
        """(name, last use, bytes) of every shard on the node whole."""
        held = []
        for name in self.shards:
            with contextlib.suppress(FileNotFoundError):
                stats = [p.stat() for p in self.files(name)]
                held.append((name, stats[-1].st_mtime, sum(st.st_size for st in stats)))
        return held

    def _present(self, name: str) -> bool:
        return self.files(name)[-1].is_file()  # the trajectories are written last

    # -- pins: what no process may evict -------------------------------------------------------------------

    def pin(self, names: set[str]) -> None:
        """Say which shards this process reads or fetches ahead (its blocks); they are touched, so the least
        recently used order follows the epoch."""
        if self.local or names == self._pinned:
            return
        self._pinned = set(names)
        write_json_atomic(self.folder / PINS / str(os.getpid()), sorted(names))
        now = time.time()
        for path in [p for name in names for p in self.files(name)]:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path, (now, now))

    def unpin(self) -> None:
        self._pinned = None
        (self.folder / PINS / str(os.getpid())).unlink(missing_ok=True)

    def pinned(self) -> set[str]:
        """Every live process's pins on this node (a dead process's file is removed)."""
        names: set[str] = set()
        for pin in (self.folder / PINS).glob("[0-9]*"):
            if not _alive(int(pin.name)):
                pin.unlink(missing_ok=True)
                continue
            try:
                names |= set(json.loads(pin.read_text()))
            except (OSError, ValueError):
                continue  # being replaced: the next read sees it
        return names

    # -- fetching ------------------------------------------------------------------------------------------

    def fetch(self, names: list[str], wait: bool = True) -> int:
        """Make every shard of ``names`` present (a local set: a no-op); returns the bytes fetched. ``wait``
        false: a store that does not answer is given up at once (the prefetch thread: the reader waits)."""
        if self.local:
            return 0
        return sum(self._fetch_one(name, self.wait_s if wait else 0.0) for name in names)

    def _fetch_one(self, name: str, wait_s: float) -> int:
        """One shard, tried until it is here or the store has not answered for ``wait_s``. Each try holds the
        node's lock; the pause between tries does not, so every rank of the node waits for the store side by
        side and all give up together, not one after another."""
        start, delay = time.monotonic(), 1.0
        while not self._present(name):
            try:
                with self._lock, node_lock(self.folder / LOCK, f"another process fetching shards into {self.folder}"):
                    if self._present(name):
                        return 0  # another process fetched it while this one waited
                    shard = self.shards[name]
                    self._make_room(shard)
                    return self._fetch_verified(shard)
            except Transient as e:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    raise StoreUnavailable(
                        f"the shard store {self.url} did not answer for {waited:.0f} s (data.store_wait_s="
                        f"{self.wait_s:g}; last: {e}); the run stopped with a checkpoint: re-run the same command "
                        "once the store answers"
                    ) from None
                log.warning("shard store %s: %s; trying again in %.0f s", self.url, e, delay)
                time.sleep(min(delay, max(wait_s - waited, 0.1)))
                delay = min(delay * 2, 30.0)
        return 0

    def _make_room(self, shard: Shard) -> None:
        held = sorted(self._held(), key=lambda h: h[1])
        used, need = sum(size for _, _, size in held), self.footprint(shard)
        pinned = self.pinned()
        for name, _, size in held:
            if used + need <= self.limit:
                break
            if name in pinned:
                continue
            for path in self.files(name):  # a loader's worker that mapped it reads on: the bytes go with the map
                path.unlink(missing_ok=True)
            used -= size
            log.debug("shard cache: evicted %s (%s)", name, human(size))
        if used + need > self.limit:
            raise ConfigError(
                f"data.cache_limit={human(self.limit)} cannot hold {shard.name} ({human(need)}) beside the "
                f"{human(used)} of shards the node's ranks read or fetched ahead ({self.folder}): raise "
                "data.cache_limit, or lower data.block_shards or data.prefetch_blocks"
            )

    def _fetch_verified(self, shard: Shard) -> int:
        """Download ``shard``, verified, under its final name (a published file: converted, its download
        removed); a damaged copy is fetched once more, then refused."""
        sent, where = 0, f"{self.url.rstrip('/')}/{shard.name}"
        for attempt in range(2):
            try:
                if self.convert is None:
                    with atomic_path(self.folder / shard.name, needed=shard.bytes) as tmp:
                        self.store.download(shard.name, tmp)
                        sent += tmp.stat().st_size
                        self._verify(shard, tmp)  # inside the block: a damaged file never takes the final name
                else:
                    sent += self._fetch_converted(shard)
            except _Damaged as e:
                sha1 = e.args[0]
                if attempt == 0:
                    log.warning("shard %s: SHA1 %s, not the manifest's %s; fetching it again", where, sha1, shard.sha1)
                continue
            with open(self.folder / FETCHED, "a") as f:
                f.write(json.dumps({"name": shard.name, "bytes": shard.bytes, "time": time.time()}) + "\n")
            return sent
        raise DataError(
            f"shard {where}: its bytes differ from the shard set's manifest twice (SHA1 {sha1}, expected "
            f"{shard.sha1}): the store holds a damaged copy and nothing was trained on it; upload the shard again "
            "(make shard writes the set) and re-run"
        )

    def _fetch_converted(self, shard: Shard) -> int:
        """A published file fetched into the node's downloads (read where it lies, on this node's disk),
        verified, and converted into its parts; returns the bytes downloaded."""
        if is_local(self.url):
            source = local_path(self.url) / shard.name
            self._verify(shard, source)
            self._convert(shard, source)
            return 0
        downloads = self.folder / DOWNLOADS
        shutil.rmtree(downloads, ignore_errors=True)  # under the node's lock: only a killed fetch's leftovers
        downloads.mkdir(parents=True)
        download = downloads / part_file(shard.name, "").removesuffix(".npy")
        try:
            try:
                self.store.download(shard.name, download)
            except OSError as e:
                raise disk_full_error(e, download, shard.bytes) or e from None
            self._verify(shard, download)
            self._convert(shard, download)
            return download.stat().st_size
        finally:
            download.unlink(missing_ok=True)  # converted or refused: the download is not kept

    def _convert(self, shard: Shard, source: Path) -> None:
        if self.convert.write(shard.name, source, self.folder) != shard.samples:
            for path in self.files(shard.name):
                path.unlink(missing_ok=True)
            raise DataError(
                f"{self.url.rstrip('/')}/{shard.name}: its trajectories differ from the {shard.samples} of the shard "
                "set's manifest: write the set again (make shard PUBLISHED=1)"
            )

    @staticmethod
    def _verify(shard: Shard, path: Path) -> None:
        sha1 = file_digest(path, "sha1")["sha1"]
        if sha1 != shard.sha1:
            raise _Damaged(sha1)


class _Damaged(Exception):
    """A fetched shard's SHA1 is not the manifest's."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
