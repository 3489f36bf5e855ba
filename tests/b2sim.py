"""A simulated Backblaze B2 account (b2sdk's in-process RawSimulator) for tests: real SDK code paths, no network."""

from __future__ import annotations

from b2sdk.v2 import B2Api, B2HttpApiConfig, InMemoryAccountInfo, RawSimulator

from train.stores import open_store
from train.stores.b2 import B2Store

SENTINEL_KEY = "K005sentinel-secret-DO-NOT-LEAK-0123456789"


class Account:
    """A simulated B2 account whose key is a sentinel, with the env vars set for it."""

    def __init__(self, monkeypatch):
        self.api = B2Api(InMemoryAccountInfo(), api_config=B2HttpApiConfig(_raw_api_class=RawSimulator))
        self.sim = self.api.session.raw_api
        self.key_id, _ = self.sim.create_account()
        self.sim.key_id_to_key[self.key_id].key = SENTINEL_KEY
        self.api.authorize_account("production", self.key_id, SENTINEL_KEY)
        self.bucket = self.api.create_bucket("pdebench", "allPrivate")
        monkeypatch.setenv("B2_APPLICATION_KEY_ID", self.key_id)
        monkeypatch.setenv("B2_APPLICATION_KEY", SENTINEL_KEY)
        self.downloads: list[str] = []
        real = self.sim.download_file_from_url

        def counting(token, url, *args, **kwargs):
            self.downloads.append(url)
            return real(token, url, *args, **kwargs)

        monkeypatch.setattr(self.sim, "download_file_from_url", counting)

    def store(self, prefix: str = "data") -> B2Store:
        store = open_store(f"b2://pdebench/{prefix}", self.api)
        assert isinstance(store, B2Store)
        return store

    def stored(self, name: str):
        """The simulator's record of the newest version of ``name`` (to corrupt it behind B2's back)."""
        files = self.sim.bucket_name_to_bucket["pdebench"].file_name_and_id_to_file
        return min((fid, f) for (n, fid), f in files.items() if n == name)[1]
