"""Logging: every rank writes its own file; only rank 0 (or every rank, with DEBUG=1) prints to the console."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

FORMAT = "%(asctime)s [{who}] %(levelname)s %(message)s"


def setup_logging(who: str = "launcher", log_file: Path | None = None, console: bool = True) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    formatter = logging.Formatter(FORMAT.format(who=who), datefmt="%H:%M:%S")
    if console or os.environ.get("DEBUG") == "1":
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(formatter)
        root.addHandler(stream)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(formatter)
        root.addHandler(handler)
    # torch.distributed's elastic agent logs every worker start at INFO; keep the console readable.
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)


class MetricsWriter:
    """Append one JSON object per logged step to metrics.jsonl (rank 0 only), flushed line by line."""

    def __init__(self, path: Path | None):
        self._file = open(path, "a") if path is not None else None  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
