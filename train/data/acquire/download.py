"""Fetch files from a store (train.stores: a B2 bucket, a web server, a local folder) into the data folder,
verified and atomic.

Guarantees:

- Nothing partial or corrupt ever sits under a destination name: bytes go to a temporary file beside it, their
  size and SHA1 are checked, and only then is it renamed into place. A failure, an exception or Ctrl-C leaves
  the destination as it was and no temporary file behind.
- The expected SHA1 is B2's ``content_sha1`` or, for multipart uploads (``content_sha1`` 'none'), the
  ``large_file_sha1`` file info, which b2sdk itself never checks; local copies are checked against the SHA1 of
  the source computed while reading it. A file whose SHA1 nobody knows is recorded with a warning.
- A manifest (``<dest folder>/.manifest.json``: size, SHA1, source, file id, upload time per file) makes a
  re-run a no-op that transfers nothing and does not re-read the local file.
- B2 credentials come from the environment and never appear in a message, log line, exception or file.
- Remote names cannot escape their store: ``..``, absolute paths, empty parts and backslashes are refused.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from train.atomic import atomic_path, write_json_atomic
from train.data.node_lock import node_lock
from train.disk import human
from train.errors import DataError
from train.hashing import file_digest
from train.stores.base import UNREACHABLE, Progress, RemoteFile, Retryable, Store, Transient, check_name
from train.stores.local import LocalStore

log = logging.getLogger(__name__)

MANIFEST = ".manifest.json"
RETRY_DELAY_S = 2.0
_manifest_lock = threading.Lock()  # a batch's threads share manifests; fetch_all's file lock covers processes


@dataclass
class FetchResult:
    dest: Path
    bytes_transferred: int
    skipped: bool
    sha1: str
    remote: RemoteFile  # what the store said of the file it holds (the newest stat, after any retry)
    warnings: list[str] = field(default_factory=list)  # what was logged as a warning on the way, for the run
    sha256: str | None = None  # recorded at the first download (None: an entry written before it was)


def _sha256_file(path: Path) -> str:
    return file_digest(path, "sha256")["sha256"]


def _digests(path: Path) -> tuple[str, str]:
    """SHA-1 (what B2 records) and SHA-256 (what the run's provenance records) of a file, in one read."""
    digests = file_digest(path, "sha1", "sha256")
    return digests["sha1"], digests["sha256"]


def _sha1_file(path: Path) -> str:
    return file_digest(path, "sha1")["sha1"]


def _source(store: Store, name: str) -> str:
    return f"{store.url.rstrip('/')}/{name}"


def read_manifest(folder: Path) -> dict:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); its files will be fetched again", folder / MANIFEST, e)
        return {}
    return data if isinstance(data, dict) else {}


def _record(dest: Path, entry: dict | None) -> None:
    with _manifest_lock:
        manifest = read_manifest(dest.parent)
        if manifest.get(dest.name) != entry:
            manifest.pop(dest.name, None)
            write_json_atomic(dest.parent / MANIFEST, manifest | ({dest.name: entry} if entry else {}))


def _current(store: Store, remote: RemoteFile, dest: Path) -> str | None:
    """The recorded SHA1 if ``dest`` already holds ``remote``, judged from sizes and the manifest alone."""
    entry = read_manifest(dest.parent).get(dest.name)
    if not isinstance(entry, dict) or not dest.is_file() or not dest.stat().st_size == entry.get("size") == remote.size:
        return None
    if entry.get("sha256") and entry.get("mtime_ns") != dest.stat().st_mtime_ns:
        # Changed on disk since it was downloaded (or merely touched): its bytes must still be the recorded ones.
        if _sha256_file(dest) != entry["sha256"]:
            log.warning("%s: its SHA-256 differs from the one recorded at download; fetching it again", dest)
            return None
        _record(dest, {**entry, "mtime_ns": dest.stat().st_mtime_ns})
    if remote.sha1:
        return entry.get("sha1") if entry.get("sha1") == remote.sha1 else None
    same = (entry.get("source"), entry.get("version")) == (_source(store, remote.name), remote.version)
    return entry.get("sha1") if same else None


def _stat(store: Store, name: str) -> RemoteFile:
    remote = store.stat(check_name(name))
    if remote is None:
        raise DataError(f"{_source(store, name)} not found")
    return remote


def _fetch(store: Store, remote: RemoteFile, dest: Path, retries: int, progress: Progress | None) -> FetchResult:
    """Make ``dest`` hold the store's file ``remote``, verified; a no-op when the manifest says it already does."""
    source = _source(store, remote.name)
    if isinstance(store, LocalStore) and dest.exists() and store.path(remote.name).samefile(dest):
        return FetchResult(dest, 0, True, _sha1_file(dest), remote)
    if (recorded := _current(store, remote, dest)) is not None:
        log.info("%s: up to date (%s)", dest, source)
        sha256 = read_manifest(dest.parent).get(dest.name, {}).get("sha256")
        return FetchResult(dest, 0, True, recorded, remote, sha256=sha256)
    transferred, warnings = 0, []
    for attempt in range(retries + 1):
        if attempt:
            remote = _stat(store, remote.name)  # the file may have been replaced: expect its new size and SHA1
        sent = 0

        def count(n: int) -> None:
            nonlocal sent
            sent += n
            if progress:
                progress(n)

        try:
            with atomic_path(dest, needed=remote.size) as tmp:
                source_sha1 = store.download(remote.name, tmp, progress=count)
                size, expected = tmp.stat().st_size, remote.sha1 or source_sha1
                if size != remote.size:
                    raise Retryable(f"{source}: got {size} bytes, expected {remote.size}")
                sha1, sha256 = _digests(tmp)
                if sha1 != expected and expected is not None:
                    raise Retryable(f"{source}: SHA1 mismatch: expected {expected}, got {sha1}")
                _record(dest, None)  # a crash between the rename and the record must not leave the old entry
        except Retryable as e:
            transferred += sent
            if progress and sent:
                progress(-sent)
            if attempt == retries and isinstance(e, Transient):
                raise Transient(f"{e} (after {retries + 1} attempts; {dest} left as it was): {UNREACHABLE}") from None
            if attempt == retries:
                raise DataError(f"{e} (after {retries + 1} attempts; {dest} left as it was)") from None
            warnings.append(f"{e}; trying again ({attempt + 1}/{retries})")
            log.warning("%s", warnings[-1])
            time.sleep(RETRY_DELAY_S * 2**attempt if isinstance(e, Transient) else 0)
            continue
        if expected is None:
            warnings.append(f"{source}: the store has no SHA1 for this file; recorded {sha1} unverified")
            log.warning("%s", warnings[-1])
        entry = {"size": size, "sha1": sha1, "sha256": sha256, "verified": expected is not None, "source": source}
        entry |= {"mtime_ns": dest.stat().st_mtime_ns, "version": remote.version, "uploaded": remote.uploaded}
        _record(dest, entry)
        log.info("%s -> %s (%s, sha256 %s)", source, dest, human(size), sha256)
        return FetchResult(dest, transferred + sent, False, sha1, remote, warnings, sha256)
    raise AssertionError("unreachable")


class _Cancelled(Exception):
    pass


def fetch_all(
    jobs: list[tuple[Store, str, Path]], *, workers: int = 4, lock_dir: Path, show_progress: bool = True
) -> list[FetchResult]:
    """Fetch every (store, name, dest) in parallel under a node-local lock; results in job order."""
    jobs = [(store, check_name(name), Path(dest)) for store, name, dest in jobs]
    lock_file = Path(lock_dir) / ".download.lock"
    with node_lock(lock_file, f"another download on this node to finish ({lock_file})"):
        for _, _, dest in jobs:  # under the lock, temporary files are leftovers of a killed run
            for stale in dest.parent.glob(f".{dest.name}.*.tmp"):
                stale.unlink(missing_ok=True)
        cancel, bar_lock = threading.Event(), threading.Lock()
        with cf.ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
            remotes = list(pool.map(lambda job: _stat(job[0], job[1]), jobs))
            pairs = list(zip(jobs, remotes, strict=True))
            todo = sum(r.size for (s, _, d), r in pairs if _current(s, r, d) is None)
            bar = tqdm(
                total=todo,
                unit="B",
                unit_scale=True,
                desc="download",
                disable=not (show_progress and sys.stderr.isatty()),
            )

            def tick(n: int) -> None:
                if cancel.is_set():
                    raise _Cancelled
                with bar_lock:
                    bar.update(n)

            futures = [pool.submit(_fetch, s, r, d, 2, tick) for (s, _, d), r in pairs]
            try:
                cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
                for f in futures:
                    f.cancel()  # only those not started: running ones finish, and what they write is good
                cf.wait(futures)
            except BaseException:
                cancel.set()  # Ctrl-C: running downloads stop at their next chunk and remove their temp files
                raise
            finally:
                bar.close()
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    for e in errors[1:]:
        log.error("%s", e)
    if errors:
        raise errors[0]
    return [f.result() for f in futures]


def describe(jobs: list[tuple[Store, str, Path]]) -> list[str]:
    """Dry run: a line per job (source -> dest, size) and a total; stats the sources, transfers nothing."""
    lines, total, count, fresh = [], 0, 0, 0
    for store, name, dest in jobs:
        remote = store.stat(check_name(name))
        state = "NOT FOUND" if remote is None else human(remote.size)
        if remote is not None and _current(store, remote, Path(dest)) is not None:
            fresh, state = fresh + 1, f"{state}, up to date"
        elif remote is not None:
            count, total = count + 1, total + remote.size
        lines.append(f"{_source(store, name)} -> {dest} ({state})")
    lines.append(f"total: {count} file(s), {human(total)} to download" + (f", {fresh} up to date" if fresh else ""))
    return lines
