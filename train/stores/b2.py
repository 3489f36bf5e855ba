"""A B2 bucket (or a prefix in one) as a store, through b2sdk; the credentials come from the environment and
never appear in a message."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path

from train.errors import DataError, PreflightError, TrainError
from train.stores.base import UNREACHABLE, Progress, RemoteFile, Retryable, Transient, check_name

_SHA1 = re.compile(r"[0-9a-f]{40}")

B2_CREDENTIALS = ("B2_APPLICATION_KEY_ID", "B2_APPLICATION_KEY")
"""The environment variables B2 is reached with (an application key's id and secret)."""


def missing_b2_credentials(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The B2 credential variables ``environ`` lacks (an empty one counts as unset)."""
    return [name for name in B2_CREDENTIALS if not environ.get(name)]


class B2Store:
    KEY_NEEDS = "read the bucket"
    """What the application key must be allowed to do, for the messages about it."""

    def __init__(self, bucket: str, prefix: str = "", api=None):
        self.bucket_name, self.prefix = bucket, prefix.strip("/")
        self.url = f"b2://{bucket}/{self.prefix}" if self.prefix else f"b2://{bucket}"
        self._api, self._bucket, self._secrets = api, None, ()
        self._lock = threading.Lock()

    def _get_bucket(self):
        from b2sdk.v2 import B2Api, InMemoryAccountInfo
        from b2sdk.v2.exception import B2Error

        with self._lock:  # authorize once, although a batch's threads all start at the same moment
            if self._bucket is not None:
                return self._bucket
            missing = missing_b2_credentials()
            if missing:
                raise PreflightError(
                    f"{self.url}: B2 credentials missing: set {' and '.join(missing)} "
                    f"(an application key that can {self.KEY_NEEDS})"
                )
            key_id, key = (os.environ[name] for name in B2_CREDENTIALS)
            self._secrets = (key, key_id)
            api = self._api or B2Api(InMemoryAccountInfo())  # in memory: the key must never reach a file
            try:
                api.authorize_account(os.environ.get("B2_REALM", "production"), key_id, key)
                self._bucket = api.get_bucket_by_name(self.bucket_name)
            except B2Error as e:
                raise self._error(e, self.url) from None
            return self._bucket

    def _error(self, e: Exception, where: str) -> TrainError:
        from b2sdk.v2 import exception as x

        reason = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, x.ChecksumMismatch):  # its str() leaves out both digests
            reason = f"SHA1 mismatch: expected {e.expected}, got {e.actual}"
        for secret in self._secrets:
            reason = reason.replace(secret, "***")
        if isinstance(e, x.Unauthorized | x.AccessDenied | x.RestrictedBucket | x.NotAllowedByAppKeyError):
            return PreflightError(
                f"{where}: B2 rejected the key in B2_APPLICATION_KEY_ID ({reason}); check B2_APPLICATION_KEY_ID / "
                f"B2_APPLICATION_KEY and that the key can {self.KEY_NEEDS}"
            )
        if isinstance(e, x.NonExistentBucket):
            return DataError(f"b2://{self.bucket_name}: no such bucket (or not visible to this key)")
        if isinstance(e, x.ChecksumMismatch | x.TruncatedOutput):
            return Retryable(f"{where}: {reason}")
        if isinstance(e, x.TransientErrorMixin):
            return Transient(f"{where}: {reason}; {UNREACHABLE}")
        return DataError(f"{where}: B2 error: {reason}")

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{check_name(name)}" if self.prefix else check_name(name)

    def stat(self, name: str) -> RemoteFile | None:
        from b2sdk.v2.exception import B2Error, FileNotPresent

        bucket = self._get_bucket()
        try:
            info = bucket.get_file_info_by_name(self._key(name))
        except FileNotPresent:
            return None
        except B2Error as e:
            raise self._error(e, f"{self.url}/{name}") from None
        sha1 = info.content_sha1
        if not sha1 or sha1 == "none":
            sha1 = info.file_info.get("large_file_sha1")
        sha1 = sha1.lower() if sha1 and _SHA1.fullmatch(sha1.lower()) else None
        return RemoteFile(name, info.size, sha1, info.id_, info.upload_timestamp)

    def list(self, folder: str) -> list[str]:
        """Names (relative to the prefix) of the files directly in ``folder``."""
        from b2sdk.v2.exception import B2Error

        bucket = self._get_bucket()
        key = self._key(folder).rstrip("/") + "/" if folder else (f"{self.prefix}/" if self.prefix else "")
        try:
            names = [v.file_name for v, _ in bucket.ls(key, recursive=False) if v is not None]
        except B2Error as e:
            raise self._error(e, f"{self.url}/{folder}") from None
        start = len(self.prefix) + 1 if self.prefix else 0
        return sorted(name[start:] for name in names)

    def download(self, name: str, dest: Path, progress: Progress | None = None) -> None:
        from b2sdk.v2 import AbstractProgressListener
        from b2sdk.v2.exception import B2Error

        class Listener(AbstractProgressListener):
            done = 0

            def set_total_bytes(self, total_byte_count: int) -> None:
                pass

            def bytes_completed(self, byte_count: int) -> None:
                delta, self.done = byte_count - self.done, byte_count  # totals, which go back when b2sdk retries
                if progress and delta:
                    progress(delta)

        bucket = self._get_bucket()
        try:
            downloaded = bucket.download_file_by_name(self._key(name), progress_listener=Listener())
            # One stream, in this thread. b2sdk's parallel downloader deadlocks when interrupted (its writer
            # thread stops, its producers block on the full queue and the process never exits), and an error
            # raised from its writer thread (our cancel) does the same.
            with open(dest, "wb") as f:
                downloaded.save(f, allow_seeking=False)
        except B2Error as e:
            raise self._error(e, f"{self.url}/{name}") from None
