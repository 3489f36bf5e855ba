"""Logging: every rank writes its own file; only rank 0 (or every rank, with DEBUG=1) prints to the console."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

FORMAT = "%(asctime)s [{who}] %(levelname)s %(message)s"
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD", re.IGNORECASE)


def debug_enabled() -> bool:
    """DEBUG=1 (or any value but 0/false): verbose NCCL/c10d, every rank on the console, DEBUG log level."""
    return os.environ.get("DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def redacted_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment with the value of every variable named like a secret replaced, for debug logs."""
    return {name: "<redacted>" if SECRET_NAME.search(name) else value for name, value in sorted(environ.items())}


def setup_logging(who: str = "launcher", log_file: Path | None = None, console: bool = True) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    # Only our own loggers go to DEBUG: libraries' debug output (HTTP clients) can carry credentials.
    logging.getLogger("train").setLevel(logging.DEBUG if debug_enabled() else logging.NOTSET)
    formatter = logging.Formatter(FORMAT.format(who=who), datefmt="%H:%M:%S")
    if console or debug_enabled():
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(formatter)
        root.addHandler(stream)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(formatter)
        root.addHandler(handler)
    # torch.distributed's elastic agent logs every worker start at INFO; keep the console readable.
    logging.getLogger("torch.distributed").setLevel(logging.INFO if debug_enabled() else logging.WARNING)
