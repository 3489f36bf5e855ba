"""Rank programs for launcher tests: real processes under torchrun that fail in a chosen way.

``python -m tests.ranks abort-after-peer-error``: rank 0 stops with a config error (exit 2, recorded like the
worker records it); rank 1, blocked in a collective, dies by SIGABRT the moment rank 0 is gone, as gloo's
teardown does after a peer's error ("terminate called without an active exception"). The launcher must name
rank 0's error, not the abort it caused.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch.distributed as dist

from train.distributed.error_file import record, record_error
from train.errors import ConfigError


@record
def abort_after_peer_error() -> int:
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        error = ConfigError("rank 0 found a bad setting (tasks.x.y)")
        record_error(error)
        return error.exit_code
    with contextlib.suppress(RuntimeError):
        dist.barrier()  # rank 0 never arrives: its exit closes the connection and ends the barrier
    os.abort()


if __name__ == "__main__":
    programs = {"abort-after-peer-error": abort_after_peer_error}
    sys.exit(programs[sys.argv[-1]]())  # the launcher puts --run-dir and --launch-record first
