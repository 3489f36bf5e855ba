"""Keep CPython's cyclic garbage collector off the objects a process holds until it exits.

A process that imports torch holds about a million objects for its whole life (modules, functions, classes).
Every full collection walks them all again, and so does the interpreter's last collection at exit: measured on
a 2-core machine, a quarter of a short run's CPU time in the launcher and in each rank (0.1 s a full collection,
0.5 s at exit). ``gc.freeze()`` moves the objects alive at that moment to a generation the collector skips;
objects made later are collected as before, and the frozen ones are freed with the process, as they would be.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def freeze_imported() -> None:
    """Once the process has imported what it runs on: later collections skip every object alive now. Garbage is
    collected first, so that none is kept for good (a process calling this more than once, e.g. a test
    session, keeps only what it would keep anyway)."""
    gc.collect()
    gc.freeze()


def exit_process(code: int) -> NoReturn:
    """``sys.exit(code)`` without the interpreter's last walk over every object: threads are joined, atexit
    handlers run and files are flushed as in any exit; objects left in reference cycles are not finalised, as
    CPython never promised they would be at exit."""
    gc.freeze()
    sys.exit(code)
