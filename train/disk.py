"""A full disk, named for what it is: the path being written, the space free and the space needed.

Writes fail on a full disk in several disguises: ``OSError(ENOSPC)`` from Python, h5py's wrapped text, and
torch.save's C++ stream, which loses errno altogether ("basic_ios::clear: iostream error"). Every write path
of the project funnels its failures through :func:`disk_full_error`, so all of them end with the same
message and exit code (4, an environment problem) instead of a traceback or a crash.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from train.errors import DiskFullError, TrainError

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_FULL_TEXT = ("no space left on device", "disk quota exceeded", "errno = 28")
# An error that lost its errno is taken for a full disk when less than this is left beyond what the write
# still needed: a disk with this much room fails writes for other reasons (I/O errors, permissions).
MARGIN = 1 << 20


def human(n: int | float) -> str:
    """Bytes for people: 512 B, 3.4 KiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: Path | str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (or of its nearest existing
    parent); None when not even that can be asked."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def looks_full(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says the disk is full, by errno or by its text."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in FULL_ERRNOS:
            return True
        if any(text in str(error).lower() for text in _FULL_TEXT):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def disk_full_error(
    error: BaseException, path: Path | str, needed: int | None = None, free_before: int | None = None, written: int = 0
) -> DiskFullError | None:
    """A :class:`DiskFullError` for a write to ``path`` that failed with ``error``, or None when the disk was
    not the cause. ``needed``: the bytes the write needed, when known; ``free_before`` and ``written``: the free
    bytes measured before the caller removed its partial file of ``written`` bytes, which judge errors that
    lost their errno. Errors a user can act on otherwise (TrainError) are never taken for a full disk."""
    if isinstance(error, DiskFullError):
        return error
    if isinstance(error, TrainError):
        return None
    room = free_before is None or free_before >= MARGIN + max(0, (needed or 0) - written)
    if room and not looks_full(error):
        return None
    free = free_bytes(Path(path).parent)
    return DiskFullError(full_message(path, free, needed), Path(path), free, needed)


def as_disk_full(error: BaseException, where: Path | str) -> DiskFullError | None:
    """For an error caught far from its write (a process's last resort): a DiskFullError naming the file the
    error names, else ``where``, when the error itself says the disk is full. Free space alone proves nothing
    here: a peer's lost connection on a full disk is still a lost connection."""
    if not looks_full(error):
        return None
    return disk_full_error(error, Path(getattr(error, "filename", None) or where))


def full_message(path: Path | str, free: int | None, needed: int | None) -> str:
    free_text = "an unknown amount" if free is None else human(free)
    need_text = f"needs {human(needed)}" if needed else "needs more space"
    return (
        f"disk full: writing {path} {need_text}, but its file system has {free_text} free. Nothing was lost: no "
        "partial file is kept and earlier files are untouched. Free space there, or point the folder "
        "(run.runs_dir, run.cache_dir, run.data_dir) at a larger disk, then re-run the same command"
    )


def reserve(path: Path | str) -> None:
    """Allocate every block of the file ``path`` (already sized, as np.lib.format.open_memmap leaves it) before
    anything writes through a memory map: a page that cannot be allocated later kills the writer with SIGBUS,
    while this fails with ENOSPC here, where it can be reported."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def unwritable(folder: Path | str) -> str | None:
    """Why no file can be made in ``folder``, or None when one can: a real write and removal of a small probe
    file (so permissions, read-only mounts and a full disk all show), in the folder or, while it does not exist
    yet, in its nearest existing parent, where it would be made (nothing is created by asking)."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    try:
        fd, name = tempfile.mkstemp(prefix=".write-probe.", dir=probe)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        return e.strerror or str(e)
    return None
