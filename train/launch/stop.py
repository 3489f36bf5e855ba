"""Stop requests to the launcher outside torchrun: SIGTERM, SIGUSR1 and SIGHUP end any stage cleanly with exit 75.

SLURM's ``--signal`` and a scheduler's SIGTERM can arrive while the launcher runs the doctor, generates or
downloads data, builds a cache or waits for the other nodes. With the default action the process would die
on the spot (exit 138 for SIGUSR1, a job that ends FAILED and is never requeued, a ``.tmp`` file left
behind). Here the signal raises ``StopRequested`` in the main thread wherever it is: atomic writes and
downloads remove their temporary files on the way out, and the job exits 75, which requeues it.

While torchrun runs the ranks, its agent installs handlers of its own (it forwards the signal to the ranks,
which checkpoint); the launcher puts these back when torchrun returns.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from train.errors import StopRequested
from train.stop_signals import EARLY, LAUNCHER_STOP_SIGNALS


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    # Later copies of the same stop (SLURM signals every process of the step, srun forwards its own) must not
    # interrupt the cleanup of the first one.
    for sig in LAUNCHER_STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    StopRequested.pending = (
        f"stopped by {name} outside the training (preparing data, caches or the launch); nothing was lost and "
        "temporary files were removed: re-run the same command to continue"
    )
    raise StopRequested(StopRequested.pending)


def _quiet_lost_stop(previous):
    """An unraisable-exception hook that keeps silent about a stop: the signal's handler ran inside a callback
    whose exceptions Python swallows (a weakref's or a finalizer's, an h5py or numpy object freed mid-write) and
    the default hook printed a traceback under 'Exception ignored', which reads as a crash. The stop is recorded
    (``StopRequested.pending``); the next ``check`` (the write's, the generator's next chunk, the block's end)
    raises it."""

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, StopRequested):
            previous(unraisable)

    return hook


@contextlib.contextmanager
def stop_on_signals(exiting: bool = False) -> Iterator[None]:
    """Turn SIGTERM, SIGUSR1 and SIGHUP into StopRequested for the duration of the block (main thread only).

    ``exiting``: the block is the process's whole command; after it the stop signals are ignored rather than
    given back their handlers. SLURM may deliver its signal again, or the time limit's, to a job whose command has
    just ended; nothing is left to stop, and the job must end with the command's code (a requeued array task
    that found no trial left is COMPLETED), not as killed by the signal while the interpreter shuts down."""
    StopRequested.pending = None
    previous = {sig: signal.signal(sig, _raise_stop) for sig in LAUNCHER_STOP_SIGNALS}
    unraisable, sys.unraisablehook = sys.unraisablehook, _quiet_lost_stop(sys.unraisablehook)
    try:
        if EARLY:  # held while the launcher started (train.stop_signals.hold_early): stop before anything runs
            _raise_stop(EARLY.pop(0), None)
        yield
        StopRequested.check()  # a stop whose exception was lost still ends the command with its exit code
    finally:
        sys.unraisablehook = unraisable
        StopRequested.pending = None
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if exiting else handler)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[list[int]]:
    """Hold SIGTERM, SIGUSR1 and SIGHUP for a bounded piece of cleanup that a stop must not cut short (the launcher's
    wait for the remote); yields the signals that arrived, which the caller has already decided how to end."""
    arrived: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield arrived
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in LAUNCHER_STOP_SIGNALS}
    try:
        yield arrived
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
