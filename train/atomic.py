"""Atomic file and folder writes: a crash never leaves a half-written file or folder under its final name."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from train.disk import disk_full_error, free_bytes
from train.errors import StopRequested


def fsync_dir(directory: Path) -> None:
    """Persist a rename: the directory entry itself must reach the disk, not only the file."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _size(path: Path | None) -> int:
    """Bytes of a file, or of every file under a folder (a partial write about to be removed)."""
    try:
        if path is None:
            return 0
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0


@contextlib.contextmanager
def atomic_path(final: Path | str, needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success fsync it and rename it into place.

    The temporary file lives in the same folder so that ``os.replace`` is a rename on one file
    system (atomic), never a copy. On any exception the temporary file is removed and ``final``
    keeps whatever it held before; a failure from a full disk becomes a DiskFullError naming ``final``
    and ``needed`` (the bytes the file needs, when the caller knows them).
    """
    final = Path(final)
    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        tmp = Path(tmp_name)
        try:
            # mkstemp makes the file owner-only; give it the mode a plain open() would (shared data folders,
            # volumes used by other users), or the mode of the file it replaces.
            mode = final.stat().st_mode & 0o7777 if final.exists() else 0o666 & ~_umask()
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        yield tmp
        StopRequested.check()  # a stop whose exception was lost inside the write (a finalizer) still discards it
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException as e:
        free_before, written = free_bytes(final.parent), _size(tmp)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        full = disk_full_error(e, final, needed, free_before, written) if isinstance(e, Exception) else None
        if full is not None and full is not e:
            raise full from e
        raise


@contextlib.contextmanager
def atomic_dir(final: Path | str, needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside ``final`` (which must not exist); on success fsync every file in it and
    rename it into place. On any exception the temporary folder is removed (a full disk's failure becomes a
    DiskFullError, as in :func:`atomic_path`). Leftovers of a killed build are named ``.<final name>.*.tmp``: a
    caller that holds the folder's lock may delete them."""
    final = Path(final)
    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        # mkdtemp makes the folder owner-only; a cache shared by the users of a machine needs the umask's mode.
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        StopRequested.check()
        for path in tmp.iterdir():
            if path.is_file():
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException as e:
        free_before, written = free_bytes(final.parent), _size(tmp)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        full = disk_full_error(e, final, needed, free_before, written) if isinstance(e, Exception) else None
        if full is not None and full is not e:
            raise full from e
        raise


def write_text_atomic(final: Path | str, text: str) -> None:
    with atomic_path(final) as tmp:
        tmp.write_text(text)


def write_json_atomic(final: Path | str, obj: object) -> None:
    write_text_atomic(final, json.dumps(obj, indent=2, sort_keys=True) + "\n")


STALE_AFTER_S = 3600
"""A temporary file nobody wrote to for this long belongs to a writer that was killed (SIGKILL, a lost machine)."""


def sweep_stale_temporaries(folder: Path, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the temporary files of atomic writes under ``folder`` that no writer touched for ``older_than_s``:
    what a killed process left behind (a signal ends writers cleanly, but SIGKILL cannot be caught). A live
    writer's file is fresher than that, so a launcher on another node writing into a shared folder keeps its own."""
    removed = []
    if not folder.is_dir():
        return removed
    now = time.time()
    for path in folder.rglob(".*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            if path.is_file() and now - path.stat().st_mtime > older_than_s:
                path.unlink()
                removed.append(path)
    return removed
