"""Keep CPython's cyclic garbage collector off the objects a process holds until it exits.

A process that imports torch holds some 200,000 objects the collector tracks for its whole life (300,000 in a
rank, which imports dynamo for DDP): modules, functions, classes. Every full collection walks them all again,
those made while importing as the count grows, the ones in the middle of a run and the interpreter's last one
at exit. On a 2-core machine that was a fifth of a short run's CPU time: a 2-rank run of configs/tiny.yaml
took 11.5 CPU seconds (launcher and ranks) and takes 8.9 with the imports made with the collector paused and
``gc.freeze()`` after them. Frozen objects sit in a generation the collector skips, at exit too; objects made
later are collected as before, and the frozen ones are freed with the process, as they would be.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def pause_while_importing(module_name: str) -> None:
    """The first call of a process's entry module, with its ``__name__``: run as the program, its imports run
    with the collector paused (a rank's make some 300,000 objects, each collection on the way walking them all:
    0.4 s of CPU a rank); imported as a module, e.g. by a test, it changes nothing. :func:`freeze_imported`
    resumes the collector."""
    if module_name == "__main__":
        gc.disable()


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """The imports made inside run with the collector paused; then :func:`freeze_imported`."""
    gc.disable()
    try:
        yield
    finally:
        freeze_imported()


def freeze_imported() -> None:
    """Once the process has imported what it runs on: later collections skip every object alive now. Garbage is
    collected first, so that none is kept for good (a process calling this more than once, e.g. a test
    session, keeps only what it would keep anyway). The collector runs from here on, paused or not before."""
    gc.collect()
    gc.freeze()
    gc.enable()
