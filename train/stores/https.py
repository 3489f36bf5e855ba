"""Files served over HTTPS (The Well's file server, or any web server that lists a folder as an index page).

A store for :mod:`train.data.acquire.download`, which adds the temporary file, the size check, the retries, the manifest
and the checksums (SHA-1 and SHA-256, recorded at the first download). This module is only the protocol, on
``requests`` (no socket code):

- ``stat``: a HEAD request; the file's size is its Content-Length, its version its ETag or Last-Modified.
- ``download``: a streamed GET; when the connection drops, the transfer resumes where it stopped with a Range
  request (a server that ignores the range starts over), and gives up after ``RESUMES`` drops in a row with no
  byte gained.
- Anything that is not the file is refused: an HTML page (an error page served with 200 or 503: the body of a
  file this package reads is never HTML), a status other than 200/206, a body longer or shorter than announced.
  A 5xx status or a short body is retried by the caller; a 4xx is not.
- ``list``: the file names an index page links to, for a Well dataset's split folders.
"""

from __future__ import annotations

import html.parser
import logging
import urllib.parse
from pathlib import Path

import requests

from train.errors import DataError
from train.stores.base import CHUNK, UNREACHABLE, Progress, RemoteFile, Transient, check_name, join

log = logging.getLogger(__name__)

TIMEOUT_S = (15, 60)  # connect, read: a stalled transfer is a dropped connection
RESUMES = 5


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _looks_like_html(head: bytes, content_type: str) -> bool:
    start = head.lstrip()[:15].lower()
    return content_type.split(";")[0].strip().lower() == "text/html" or start.startswith((b"<!doctype html", b"<html"))


class HttpsStore:
    def __init__(self, url: str, session: requests.Session | None = None):
        self.url = url.rstrip("/")
        self._session = session or requests.Session()

    def _url(self, name: str) -> str:
        return f"{self.url}/{urllib.parse.quote(check_name(name))}"

    def _get(self, url: str, **kwargs) -> requests.Response:
        try:
            return self._session.get(url, timeout=TIMEOUT_S, **kwargs)
        except requests.RequestException as e:
            raise Transient(f"{url}: {type(e).__name__}: {e}; {UNREACHABLE}") from None

    @staticmethod
    def _check_status(response: requests.Response, url: str) -> None:
        if response.status_code >= 500:
            raise Transient(f"{url}: the server answered {response.status_code} {response.reason}")
        if response.status_code not in (200, 206):
            raise DataError(f"{url}: the server answered {response.status_code} {response.reason}")

    def stat(self, name: str) -> RemoteFile | None:
        url = self._url(name)
        try:
            response = self._session.head(url, timeout=TIMEOUT_S, allow_redirects=True)
        except requests.RequestException as e:
            raise Transient(f"{url}: {type(e).__name__}: {e}; {UNREACHABLE}") from None
        if response.status_code == 404:
            return None
        self._check_status(response, url)
        if _looks_like_html(b"", response.headers.get("Content-Type", "")):
            raise DataError(f"{url}: the server sends an HTML page, not the file (an error page?)")
        size = response.headers.get("Content-Length")
        if size is None or not size.isdigit():
            raise DataError(f"{url}: the server does not announce the file's size (no Content-Length)")
        version = response.headers.get("ETag") or response.headers.get("Last-Modified")
        return RemoteFile(name, int(size), None, version)

    def list(self, folder: str) -> list[str]:
        """File names under ``folder`` that its index page links to; [] when the folder does not exist."""
        url = (self._url(folder) if folder else self.url) + "/"
        response = self._get(url)
        if response.status_code == 404:
            return []
        self._check_status(response, url)
        parser = _Links()
        parser.feed(response.text)
        names = set()
        base = urllib.parse.urlparse(url)
        for href in parser.hrefs:
            target = urllib.parse.urlparse(urllib.parse.urljoin(url, href))
            name = urllib.parse.unquote(target.path).removeprefix(base.path)
            # Only files directly in the folder: not its parent, sort links ("?C=M"), other hosts or subfolders.
            if target.netloc == base.netloc and target.path.startswith(base.path) and name and "/" not in name:
                names.add(join(folder, name))
        return sorted(names)

    def download(self, name: str, dest: Path, progress: Progress | None = None) -> None:
        """Write the file to ``dest``, resuming after dropped connections; the caller checks the size."""
        url, have, furthest, stalls = self._url(name), 0, 0, 0
        with open(dest, "wb") as out:
            while True:
                headers = {"Range": f"bytes={have}-"} if have else {}
                response = self._get(url, headers=headers, stream=True)
                if have and response.status_code == 416:  # nothing after byte `have`: the caller checks the size
                    response.close()
                    return
                self._check_status(response, url)
                if have and response.status_code == 200:  # the range was ignored: start over
                    out.seek(0)
                    out.truncate()
                    if progress:
                        progress(-have)
                    have = 0
                first = True
                try:
                    for chunk in response.iter_content(CHUNK):
                        if first and not have and _looks_like_html(chunk, response.headers.get("Content-Type", "")):
                            raise DataError(f"{url}: the server sent an HTML page, not the file (an error page?)")
                        first = False
                        out.write(chunk)
                        have += len(chunk)
                        if progress:
                            progress(len(chunk))
                    return
                except requests.RequestException as e:
                    # Progress is a byte never received before: a server that starts over every time gains none.
                    stalls = 0 if have > furthest else stalls + 1
                    furthest = max(furthest, have)
                    if stalls >= RESUMES:
                        raise Transient(f"{url}: the connection keeps dropping ({e})") from None
                    log.warning("%s: connection dropped after %d bytes (%s); resuming", url, have, type(e).__name__)
                finally:
                    response.close()
