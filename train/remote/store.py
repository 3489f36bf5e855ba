"""The run's remote copy: a B2 prefix or a folder, written file by file, each upload SHA1-verified.

A remote holds one folder per run, ``<remote>/<run name>/``, laid out like the run folder itself. Its writes
are whole files that become visible at once: B2 shows a file only when its upload is complete, and a folder
remote receives each file under a temporary name that is renamed into place once its bytes are on disk.
After each upload the remote is asked for the file's size and SHA1 (B2's ``content_sha1``, or the
``large_file_sha1`` of a multipart upload) and both must equal the local file's: a file the remote cannot
vouch for is an upload failure. The credentials are those of data downloads and never appear in a message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from train.atomic import atomic_path, fsync_dir
from train.disk import human
from train.errors import ConfigError, DataError, DiskFullError
from train.hashing import file_digest
from train.stores.b2 import B2Store
from train.stores.base import RemoteFile, check_name
from train.stores.local import LocalStore

log = logging.getLogger(__name__)


class UploadFailed(DataError):
    """An upload that did not end with the remote holding the same bytes; worth trying again."""


@dataclass(frozen=True)
class LocalFile:
    """A file about to be mirrored: its bytes are fixed by a hard link or copy the mirror made."""

    path: Path
    size: int
    sha1: str
    signature: tuple = ()
    """(inode, size, mtime) of the file it was taken from: tells whether that file changed since."""


def sha1_of(path: Path) -> str:
    return file_digest(path, "sha1")["sha1"]


class _Verifying:
    """What both kinds of remote share: upload then compare, and refuse a name that escapes the run folder."""

    url: str

    def upload(self, local: LocalFile, name: str) -> None:
        """Put ``local`` under ``name`` and check that the remote now holds exactly its bytes."""
        assert isinstance(self, FolderRemote | B2Remote)
        self._put(local, check_name(name))
        remote = self.stat(name)
        if remote is None:
            raise UploadFailed(f"{self.url}/{name}: not on the remote right after its upload")
        if remote.size != local.size or remote.sha1 != local.sha1:
            raise UploadFailed(
                f"{self.url}/{name}: the remote holds {remote.size} bytes with SHA1 {remote.sha1}, the local file "
                f"{local.size} bytes with SHA1 {local.sha1}"
            )


class FolderRemote(_Verifying, LocalStore):
    """A run's remote folder on a shared file system (NFS, a mounted volume)."""

    def __init__(self, root: Path | str):
        super().__init__(root)

    def stat(self, name: str) -> RemoteFile | None:
        path = self.path(name)
        if not path.is_file():
            return None
        # A folder keeps no checksum of its own: read the file back, which is what verifying it means here.
        return RemoteFile(name, path.stat().st_size, sha1_of(path), str(path.stat().st_mtime_ns))

    def _put(self, local: LocalFile, name: str) -> None:
        final = self.path(name)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(final, needed=local.size) as tmp:
                shutil.copyfile(local.path, tmp)
        except DiskFullError as e:  # the remote's disk, not this machine's: an upload to retry, never a stop
            free = "an unknown amount" if e.free is None else human(e.free)
            raise UploadFailed(
                f"{self.url}/{name}: the remote's disk is full ({free} free, {human(local.size)} needed); free space "
                "there or point run.remote at another folder, then `python -m train push` sends what is missing"
            ) from None
        except OSError as e:
            raise UploadFailed(f"{self.url}/{name}: {e.strerror or e}") from None

    def names(self, folder: str) -> list[str]:
        where = self.path(folder) if folder else self.root
        if not where.is_dir():
            return []
        files = [p.name for p in where.iterdir() if p.is_file() and not p.name.startswith(".")]  # not temp files
        return sorted(f"{folder}/{name}" if folder else name for name in files)

    def delete(self, name: str) -> None:
        path = self.path(name)
        path.unlink(missing_ok=True)
        if path.parent.is_dir():
            fsync_dir(path.parent)


class B2Remote(_Verifying, B2Store):
    """A run's remote folder under a B2 bucket prefix. Replaced files leave no older versions behind."""

    KEY_NEEDS = "list, read, write and delete files in the bucket (a run's remote replaces and prunes files)"

    def _put(self, local: LocalFile, name: str) -> None:
        from b2sdk.v2.exception import B2Error

        bucket = self._get_bucket()
        try:
            bucket.upload_local_file(
                local_file=str(local.path),
                file_name=self._key(name),
                content_type="application/octet-stream",
                # B2 checks a simple upload against sha1_sum; a multipart upload's whole-file SHA1 is only known
                # from this file info, which the data stage reads back the same way.
                sha1_sum=local.sha1,
                file_info={"large_file_sha1": local.sha1},
            )
        except B2Error as e:
            raise UploadFailed(str(self._error(e, f"{self.url}/{name}"))) from None
        except OSError as e:
            raise UploadFailed(f"{self.url}/{name}: cannot read {local.path}: {e.strerror or e}") from None
        self._delete_versions(name, keep_newest=True)

    def names(self, folder: str) -> list[str]:
        from b2sdk.v2.exception import B2Error

        bucket = self._get_bucket()
        start = len(self._key("x")) - 1  # the prefix and its slash
        try:
            return sorted(v.file_name[start:] for v, _ in bucket.ls(self._key(folder) if folder else self.prefix))
        except B2Error as e:
            raise UploadFailed(str(self._error(e, f"{self.url}/{folder}"))) from None

    def delete(self, name: str) -> None:
        self._delete_versions(name, keep_newest=False)

    def _delete_versions(self, name: str, *, keep_newest: bool) -> None:
        from b2sdk.v2.exception import B2Error, FileNotPresent

        bucket = self._get_bucket()
        try:
            versions = [v for v in bucket.list_file_versions(self._key(name)) if v.file_name == self._key(name)]
            for version in versions[1:] if keep_newest else versions:  # newest first
                with contextlib.suppress(FileNotPresent):
                    bucket.delete_file_version(version.id_, version.file_name)
        except B2Error as e:
            raise UploadFailed(str(self._error(e, f"{self.url}/{name}"))) from None


Remote = FolderRemote | B2Remote


def open_remote(url: str, run_name: str, b2_api=None, run_root: Path | None = None) -> Remote:
    """The run's folder under ``run.remote``; a folder remote is created when missing. ``run_root``: the local
    run folder, which a folder remote may neither be nor lie inside (nor hold): mirroring would copy files onto
    themselves and swap metrics.jsonl under rank 0's open handle."""
    if url.startswith("b2://"):
        bucket, _, prefix = url.removeprefix("b2://").partition("/")
        return B2Remote(bucket, "/".join(p for p in (prefix.strip("/"), run_name) if p), b2_api)
    root = Path(url).expanduser() / run_name
    if run_root is not None:
        mine, theirs = Path(run_root).resolve(), root.resolve()
        if mine == theirs or mine in theirs.parents or theirs in mine.parents:
            raise ConfigError(
                f"run.remote={url}: the run's remote folder {theirs} is its own run folder {mine} (or inside it, or "
                "holds it); the remote must be another disk or a shared folder outside run.runs_dir/<run name>"
            )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"run.remote={url}: cannot create {root} ({e.strerror or e}); point it at a writable "
            "folder or b2://bucket/prefix"
        ) from None
    if not os.access(root, os.W_OK):
        raise ConfigError(f"run.remote={url}: {root} is not writable; point it at a writable folder")
    return FolderRemote(root)
