"""Stop requests: SIGTERM, SIGUSR1, SIGHUP or SIGINT ask every rank to stop at the same step boundary.

The handler only sets a flag (a signal handler must not log, take locks or touch collectives). At each step
boundary every rank posts its flag to an asynchronous MAX all-reduce and reads the result of the previous
boundary's: all ranks see the same value at the same step, so they stop together, and the reduction of one
float overlaps with a whole training step instead of stalling it. The flag lives on the CPU and goes through
gloo even when the gradients go through NCCL: read back from a GPU, it would make the host wait for the GPU at
every step. Repeated signals change nothing: one stop often arrives twice (SLURM or `kill -- -PGID` signals
every process, and torchrun's agent forwards its own copy); a rank that does not stop within
dist.shutdown_timeout_s is killed by the agent.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from train.stop_signals import RANK_STOP_SIGNALS


class StopRequest:
    def __init__(self):
        self.received: signal.Signals | None = None
        self._buffer = torch.zeros(1)
        self._pending = None
        self._previous: dict[signal.Signals, object] = {}
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        # Every rank builds its StopRequest at the same point of the run, as a new group requires.
        self._group = dist.new_group(backend="gloo") if self._distributed and dist.get_backend() != "gloo" else None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def __enter__(self) -> StopRequest:
        for sig in RANK_STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self.drain()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self) -> bool:
        """Called by every rank at every step boundary: whether some rank had been asked to stop by the previous
        boundary. Identical on all ranks."""
        if not self._distributed:
            return self.received is not None
        stop = False
        if self._pending is not None:
            self._pending.wait()
            stop = bool(self._buffer.item() > 0)
        self._buffer.fill_(1.0 if self.received is not None else 0.0)
        self._pending = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return stop

    def drain(self) -> None:
        """Wait for the reduction in flight: no collective may be left pending when the group is destroyed, and
        every rank must have posted the same number of them."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
