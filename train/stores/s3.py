"""A bucket (or a prefix in one) of an S3-compatible object store as a store: ``s3://bucket/prefix``.

Amazon S3, Backblaze B2's S3 API, MinIO, Cloudflare R2 and other S3-compatible services, through boto3: the
client AWS maintains and the one those services document for their S3 APIs (b2:// locations keep b2sdk, whose
native API also gives every file's SHA1). boto3 is an optional dependency (``pip install 'train[s3]'``), imported
only when an ``s3://`` location is used. The endpoint comes from ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``;
unset: Amazon S3), the credentials from boto3's own chain (``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``, a
profile, an instance role); no message holds them. S3 keeps no SHA1 of an object: one uploaded with the user
metadata ``sha1`` (``aws s3 cp --metadata sha1=<hex>``) is verified against it, any other by its size only.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from train.errors import ConfigError, DataError, PreflightError, TrainError
from train.hashing import hashers
from train.stores.base import CHUNK, UNREACHABLE, Progress, RemoteFile, Transient, check_name, join

_SHA1 = re.compile(r"[0-9a-f]{40}")
_MISSING = {"404", "NoSuchKey", "NotFound"}
_REFUSED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
INSTALL = "pip install 'train[s3]' (boto3)"


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", client=None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client, self._lock, self._bucket_seen = client, threading.Lock(), False

    @property
    def client(self):
        with self._lock:  # one client, made once, although a batch's threads start at the same moment
            if self._client is None:
                try:
                    import boto3
                except ImportError:
                    raise ConfigError(f"{self.url}: s3:// locations need boto3: {INSTALL}") from None
                self._client = boto3.session.Session().client("s3")  # the environment as it is now
            return self._client

    def _error(self, e: Exception, where: str) -> TrainError:
        from botocore import exceptions as x

        if isinstance(e, x.NoCredentialsError | x.PartialCredentialsError):
            return PreflightError(
                f"{where}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL "
                "for a store other than Amazon S3)"
            )
        if isinstance(e, x.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                return DataError(f"s3://{self.bucket}: no such bucket (or not visible to these credentials)")
            if code in _REFUSED:
                return PreflightError(
                    f"{where}: the store refused these credentials ({code}); check AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY and that they may read the bucket"
                )
            if code.startswith("5") or code in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"):
                return Transient(f"{where}: the store answered {code}; {UNREACHABLE}")
            return DataError(f"{where}: S3 error {code}: {e}")
        if isinstance(
            e, x.EndpointConnectionError | x.ConnectionClosedError | x.ReadTimeoutError | x.ConnectTimeoutError
        ):
            return Transient(f"{where}: {type(e).__name__}; {UNREACHABLE}")
        return DataError(f"{where}: S3 error: {type(e).__name__}: {e}")

    def _key(self, name: str) -> str:
        return join(self.prefix, check_name(name))

    def _check_bucket(self) -> None:
        """DataError when the bucket itself is missing (asked once)."""
        from botocore.exceptions import BotoCoreError, ClientError

        if self._bucket_seen:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in _MISSING | {"NoSuchBucket"}:
                raise DataError(f"s3://{self.bucket}: no such bucket (or not visible to these credentials)") from None
            raise self._error(e, self.url) from None
        except BotoCoreError as e:
            raise self._error(e, self.url) from None
        self._bucket_seen = True

    def stat(self, name: str) -> RemoteFile | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in _MISSING:
                self._check_bucket()  # a HEAD's 404 says no more: the object, or the whole bucket
                return None
            raise self._error(e, f"{self.url}/{name}") from None
        except BotoCoreError as e:
            raise self._error(e, f"{self.url}/{name}") from None
        sha1 = str(head.get("Metadata", {}).get("sha1", "")).lower()
        uploaded = head.get("LastModified")
        return RemoteFile(
            name,
            int(head["ContentLength"]),
            sha1 if _SHA1.fullmatch(sha1) else None,
            str(head.get("ETag", "")).strip('"') or None,
            int(uploaded.timestamp() * 1000) if uploaded is not None else None,
        )

    def list(self, folder: str) -> list[str]:
        """Names (relative to the prefix) of the objects directly in ``folder``."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = join(self.prefix, check_name(folder)) if folder else self.prefix
        start = f"{key}/" if key else ""
        names = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=start, Delimiter="/"
            )
            for page in pages:
                names += [item["Key"] for item in page.get("Contents", [])]
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, f"{self.url}/{folder}") from None
        skip = len(self.prefix) + 1 if self.prefix else 0
        return sorted(name[skip:] for name in names if not name.endswith("/"))

    def download(self, name: str, dest: Path, progress: Progress | None = None) -> str:
        """The object's bytes into ``dest``, streamed; the SHA1 of what was read."""
        from botocore.exceptions import BotoCoreError, ClientError

        h = hashers("sha1")["sha1"]
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
            with open(dest, "wb") as out:
                while chunk := body.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    if progress:
                        progress(len(chunk))
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, f"{self.url}/{name}") from None
        return h.hexdigest()
