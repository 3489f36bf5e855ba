"""A rank's error file, written atomically: the launcher reads it to name the failing rank's error.

torchrun points each rank at a file (TORCHELASTIC_ERROR_FILE) for the exception that ended it. PyTorch's own
handler writes that file in place; when the agent stops the surviving ranks after a peer died (SIGTERM, then
SIGKILL), one of them can die mid-write, and the agent then fails to parse the truncated file and crashes
instead of restarting the group. Written to a temporary name and renamed, the file is whole or absent; on a
full disk it is absent, never empty (an empty file would crash the agent the same way), and a reserve of a
few blocks, set aside when the rank starts, makes room for it there.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as _record

from train.atomic import atomic_path

_R = TypeVar("_R")
RESERVE_BYTES = 64 << 10
MAX_STACK = 32 << 10  # the record must fit the reserve


class AtomicErrorHandler(ErrorHandler):
    def initialize(self) -> None:
        """At the rank's start: torch's set-up, and a few blocks set aside beside the error file, given back
        just before the record is written, so that a rank that fails on a full disk can still say why."""
        super().initialize()
        path = self._get_error_file_path()
        if path:
            self._reserve = Path(f"{path}.reserve")
            try:
                self._reserve.parent.mkdir(parents=True, exist_ok=True)
                with open(self._reserve, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, RESERVE_BYTES)
            except OSError:  # already full: nothing to set aside
                self._reserve.unlink(missing_ok=True)
            atexit.register(self._reserve.unlink, missing_ok=True)

    def record_exception(self, e: BaseException) -> None:
        """The record PyTorch's handler writes (its format, which the agent parses), renamed into place."""
        path = self._get_error_file_path()
        if not path:
            return
        stack = traceback.format_exc()
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {"py_callstack": stack[-MAX_STACK:], "timestamp": str(int(time.time()))},
            }
        }
        if getattr(self, "_reserve", None) is not None:
            self._reserve.unlink(missing_ok=True)
        try:
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps(data))
        except Exception as write_error:  # not even the reserve was enough: the exit code and the log still tell
            print(f"the error file {path} could not be written: {write_error}", file=sys.stderr)


_HANDLER = AtomicErrorHandler()


def record(fn: Callable[..., _R]) -> Callable[..., _R]:
    """torch's ``@record`` (an unexpected exception is written to the error file), with the atomic handler."""
    return _record(fn, error_handler=_HANDLER)


def record_error(e: BaseException) -> None:
    """Write ``e`` as this rank's error (for an error the rank handles itself and exits non-zero on)."""
    _HANDLER.record_exception(e)
