"""A rank's error file, written atomically: the launcher reads it to name the failing rank's error.

torchrun points each rank at a file (TORCHELASTIC_ERROR_FILE) for the exception that ended it. PyTorch's own
handler writes that file in place; when the agent stops the surviving ranks after a peer died (SIGTERM, then
SIGKILL), one of them can die mid-write, and the agent then fails to parse the truncated file and crashes
instead of restarting the group. Written to a temporary name and renamed, the file is whole or absent.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as _record

from train.atomic import atomic_path

_R = TypeVar("_R")


class AtomicErrorHandler(ErrorHandler):
    def record_exception(self, e: BaseException) -> None:
        """The record PyTorch's handler writes (its format, which the agent parses), renamed into place."""
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
            }
        }
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(data))


_HANDLER = AtomicErrorHandler()


def record(fn: Callable[..., _R]) -> Callable[..., _R]:
    """torch's ``@record`` (an unexpected exception is written to the error file), with the atomic handler."""
    return _record(fn, error_handler=_HANDLER)


def record_error(e: BaseException) -> None:
    """Write ``e`` as this rank's error (for an error the rank handles itself and exits non-zero on)."""
    _HANDLER.record_exception(e)
