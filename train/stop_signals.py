"""The signals that stop a run, defined once: what every process of a launch does on each, and what the launch
targets' engines send (train.launch.targets: each row's ``stop_signal`` is one of these)."""

from __future__ import annotations

import signal

RANK_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
"""A rank saves a checkpoint at its next step and exits 75 on any (train.engine.signals); its DataLoader workers
ignore them all (the rank stops them), and a rank killed by one while it evaluated was stopped, not broken."""
LAUNCHER_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
"""Outside torchrun (the doctor, data, caches, waiting for the other nodes) the launcher stops cleanly with exit 75
on these (train.launch.stop); Ctrl-C interrupts it as it does any Python program. SIGHUP: the terminal it ran in
was closed (an ssh session dropped)."""
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
"""What torchrun's agent passes on to the ranks (then waits dist.shutdown_timeout_s before SIGKILL)."""

EARLY: list[int] = []
"""Stop signals that arrived before the launcher's handlers were in place (:func:`hold_early`)."""


def hold_early() -> None:
    """The first thing ``python -m train`` does, before it imports the command line: a stop signal arriving
    meanwhile is held, not the default action that kills the launcher with nothing cleaned up (exit 138 for
    SIGUSR1, a job that ends FAILED and is never requeued). train.launch.stop raises it once its own handlers are
    in place."""
    for sig in LAUNCHER_STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: EARLY.append(signum))
