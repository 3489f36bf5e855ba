"""A folder of this machine as a store: files read in place, or copied with their SHA1 computed on the way."""

from __future__ import annotations

from pathlib import Path

from train.disk import looks_full
from train.errors import DataError
from train.hashing import hashers
from train.stores.base import CHUNK, Progress, RemoteFile, check_name, join


class LocalStore:
    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def path(self, name: str) -> Path:
        return self.root / check_name(name)

    def stat(self, name: str) -> RemoteFile | None:
        path = self.path(name)
        if not path.is_file():
            return None
        st = path.stat()
        return RemoteFile(name, st.st_size, None, str(st.st_mtime_ns))

    def list(self, folder: str) -> list[str]:
        """Names (relative to the root) of the files directly in ``folder`` ("" the root); [] when it does not exist."""
        path = self.path(folder) if folder else self.root
        return sorted(join(folder, p.name) for p in path.iterdir() if p.is_file()) if path.is_dir() else []

    def download(self, name: str, dest: Path, progress: Progress | None = None) -> str:
        h = hashers("sha1")["sha1"]
        try:
            with open(self.path(name), "rb") as src, open(dest, "wb") as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    if progress:
                        progress(len(chunk))
        except OSError as e:
            if looks_full(e):  # the caller's atomic write names the file, the free and the needed space
                raise
            raise DataError(f"{self.url}/{name}: cannot copy to {dest.parent}: {e.strerror or e}") from None
        return h.hexdigest()
