import atexit
import contextlib
import os
import sys
import threading

from train.stop_signals import hold_early

hold_early()  # before the imports below: a stop arriving while they run is held, not fatal

from train.cli import main  # noqa: E402

code = main(exiting=True)
# The command's work is done and written. What the interpreter's own teardown still does (threads joined, exit
# handlers, streams flushed) is done here; then the process leaves without it destroying torch's C++ objects in
# whatever order their modules are freed: torchrun's store thread, destroyed while joinable, aborted a launcher
# that had stopped cleanly ("terminate called without an active exception", exit 134 where 75 was said).
for thread in threading.enumerate():
    if thread is not threading.main_thread() and not thread.daemon:
        thread.join()
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
        stream.flush()
os._exit(code)
