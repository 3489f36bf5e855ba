"""A real HTTP server on 127.0.0.1 serving a folder, with Range requests, index pages and faults on demand."""

from __future__ import annotations

import html
import http.server
import threading
import urllib.parse
from collections import Counter
from pathlib import Path


class FileServer:
    """Serves ``root`` at ``url``; ``faults[relative path]`` makes that file misbehave:

    - "drop": the first GET sends half the body, then closes the connection (the Content-Length was whole);
    - "503": every GET answers 503 with an HTML body; "html": every GET answers 200 with an HTML page;
    - "lie": HEAD and GET announce 100 bytes more than the file holds (GET sends the file, then closes).
    ``requests`` counts the GETs per path; ``outage_after``: once that many GETs of files were answered, every
    later GET answers 503 (a store that went away), until it is set to None again.
    """

    def __init__(self, root: Path):
        self.root, self.faults, self.requests = Path(root), {}, Counter()
        self.outage_after: int | None = None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _path(self) -> tuple[str, Path]:
                rel = urllib.parse.unquote(urllib.parse.urlparse(self.path).path).lstrip("/")
                return rel, server.root / rel

            def _headers(self, status: int, length: int, kind: str = "application/octet-stream", extra=()) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(length))
                for key, value in extra:
                    self.send_header(key, value)
                self.end_headers()

            def _index(self, rel: str, folder: Path) -> None:
                links = "".join(
                    f'<a href="{html.escape(p.name)}">{html.escape(p.name)}</a>\n' for p in sorted(folder.iterdir())
                )
                body = f"<html><body><h1>Index of /{rel}</h1>\n{links}</body></html>".encode()
                self._headers(200, len(body), "text/html")
                self.wfile.write(body)

            def do_HEAD(self) -> None:
                rel, path = self._path()
                if not path.is_file():
                    self._headers(404, 0)
                    return
                extra = 100 if server.faults.get(rel) == "lie" else 0
                self._headers(200, path.stat().st_size + extra, extra=[("ETag", f'"{path.stat().st_mtime_ns}"')])

            def do_GET(self) -> None:
                rel, path = self._path()
                server.requests[rel] += 1
                fault = server.faults.get(rel)
                if path.is_dir():
                    self._index(rel, path)
                    return
                if not path.is_file():
                    self._headers(404, 0)
                    return
                if server.outage_after is not None and sum(server.requests.values()) > server.outage_after:
                    fault = "503"
                if fault in ("503", "html"):
                    body = b"<!DOCTYPE html><html><body>Service Unavailable</body></html>"
                    self._headers(503 if fault == "503" else 200, len(body), "text/html")
                    self.wfile.write(body)
                    return
                data = path.read_bytes()
                start = 0
                if ranged := self.headers.get("Range"):
                    start = int(ranged.removeprefix("bytes=").split("-")[0])
                    if start >= len(data):
                        self._headers(416, 0)
                        return
                    self._headers(
                        206, len(data) - start, extra=[("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")]
                    )
                else:
                    self._headers(200, len(data) + (100 if fault == "lie" else 0))
                body = data[start:]
                if fault == "drop" and server.requests[rel] == 1:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)
                if fault == "lie":
                    self.close_connection = True

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> FileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
