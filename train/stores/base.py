"""What every store is: the files it holds (:class:`RemoteFile`), the three things it does (:class:`Store`),
the names it accepts, and the errors after which a download is tried again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from train.errors import DataError, PreflightError

CHUNK = 1 << 20
Progress = Callable[[int], None]  # byte deltas; negative when a failed attempt's bytes are taken back


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative to the store's root, '/'-separated
    size: int
    sha1: str | None  # lower-case hex; None when the store does not know it
    version: str | None = None  # identifies the content when there is no SHA1: B2's file id, a local mtime
    uploaded: int | None = None  # B2's upload_timestamp (milliseconds since the epoch); None for local files


class Store(Protocol):
    url: str  # for messages and logs only; never holds a secret

    def stat(self, name: str) -> RemoteFile | None: ...

    def list(self, folder: str) -> list[str]:
        """Names of the files directly in ``folder`` (relative to the store's root; "" is the root), sorted."""

    def download(self, name: str, dest: Path, progress: Progress | None = None) -> str | None:
        """Write the file's bytes to ``dest``; return the SHA1 of the source as read, where computed."""


class Retryable(DataError):
    """Wrong size or SHA1: the next attempt may get good bytes."""


UNREACHABLE = (
    "the store could not be reached, which is this machine's network (DNS, a proxy, a firewall) or an outage of "
    "the store, not the data; re-run the same command once it answers"
)


class Transient(Retryable):
    """A B2 or network error that b2sdk's own retries did not cure: tried again after a pause. Not the data's
    fault: this machine's network (DNS, a refused connection) or an outage of the store, so exit 4."""

    exit_code = PreflightError.exit_code


def check_name(name: str) -> str:
    if not name or name.startswith("/") or "\\" in name or "\0" in name or {"", ".", ".."} & set(name.split("/")):
        raise DataError(
            f"refusing remote file name {name!r}: it must be a relative '/'-separated path "
            "without '..', '.', empty parts or backslashes"
        )
    return name


def join(folder: str, name: str) -> str:
    """``folder/name``, or ``name`` in the store's root (folder "")."""
    return f"{folder}/{name}" if folder else name
