"""Where a task's files can come from: the table of stores, by the location's scheme.

``b2://bucket/prefix`` is a B2 bucket (b2sdk), ``s3://bucket/prefix`` a bucket of an S3-compatible store (boto3:
Amazon S3, B2's S3 API, MinIO, R2; its endpoint from AWS_ENDPOINT_URL), ``https://`` (and ``http://``) a web
server, ``file:///folder`` or a plain path a local folder. Each store lists, stats and downloads files by names
relative to its root; the download machinery (train/data/acquire/download.py) adds the verification, the retries
and the manifest.
"""

from __future__ import annotations

from pathlib import Path

from train.errors import ConfigError, DataError
from train.stores.b2 import B2Store
from train.stores.base import Store, check_name
from train.stores.https import HttpsStore
from train.stores.local import LocalStore
from train.stores.s3 import S3Store


def _bucket(source: str) -> tuple[str, str]:
    """The bucket and prefix of ``scheme://bucket/prefix``, both checked."""
    scheme, _, rest = source.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ConfigError(f"{source}: no bucket name (expected {scheme}://bucket/prefix)")
    if prefix.strip("/"):
        check_name(prefix.strip("/"))
    return bucket, prefix


def _b2(source: str, b2_api) -> Store:
    return B2Store(*_bucket(source), b2_api)


def _local(source: str, b2_api) -> Store:
    path = local_path(source)
    if source.startswith("file://") and not path.is_absolute():
        raise ConfigError(f"{source}: file URLs need an absolute path (file:///abs/folder)")
    store = LocalStore(path)
    if not store.root.is_dir():
        raise DataError(f"source folder '{store.root}' not found (or not a folder)")
    return store


STORES = {
    "b2://": _b2,
    "s3://": lambda source, b2_api: S3Store(*_bucket(source)),
    "https://": lambda source, b2_api: HttpsStore(source),
    "http://": lambda source, b2_api: HttpsStore(source),
    "file://": _local,
}
"""Scheme -> the store of a location; a location without a scheme is a local folder."""


def is_local(location: str) -> bool:
    """A plain path or a ``file://`` URL, read where it lies; any other scheme names a store whose files are
    fetched into the data folder."""
    return "://" not in location or location.startswith("file://")


def local_path(location: str) -> Path:
    """The path a local location names (``file://`` removed, ``~`` expanded)."""
    return Path(location.removeprefix("file://")).expanduser()


def open_store(source: str, b2_api=None) -> Store:
    """The store of ``source``; ``b2_api``: a b2sdk API to use instead of a new one (tests: the simulator)."""
    for scheme, make in STORES.items():
        if source.startswith(scheme):
            return make(source, b2_api)
    if "://" in source:
        raise ConfigError(
            f"{source}: unsupported source (use b2://bucket/prefix, s3://bucket/prefix, https://..., file:///folder "
            "or a path)"
        )
    return _local(source, b2_api)
