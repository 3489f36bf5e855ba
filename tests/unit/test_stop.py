"""A stop request (SIGTERM, SIGUSR1) before the ranks run ends the command with exit 75 even when the exception
its signal raised was lost: Python only prints an exception raised while it runs a finalizer."""

from __future__ import annotations

import os
import signal

import pytest

from train.atomic import atomic_path
from train.data.acquire.generate import generate
from train.errors import StopRequested
from train.launch.stop import stop_on_signals


@pytest.fixture
def lost_stop():
    """The state a signal leaves behind when its exception was swallowed: the request recorded, nothing raised."""
    with stop_on_signals():
        StopRequested.pending = "stopped by SIGUSR1 outside the training"
        try:
            yield
        finally:
            StopRequested.pending = None


def test_a_signal_raises_and_records_the_stop():
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(StopRequested, match="stopped by SIGUSR1"), stop_on_signals():
        os.kill(os.getpid(), signal.SIGUSR1)
        signal.pause()  # the handler raises here
    assert StopRequested.pending is None, "the record ends with the block"
    assert signal.getsignal(signal.SIGUSR1) == before, "the handler before the block is back"


def test_a_lost_stop_still_discards_the_write_in_flight(tmp_path, lost_stop):
    with pytest.raises(StopRequested), atomic_path(tmp_path / "x.json") as tmp:
        tmp.write_text("{}")
    assert list(tmp_path.iterdir()) == [], "no file under its final name, no temporary file"


def test_a_lost_stop_ends_a_generation_at_its_next_chunk(tmp_path, lost_stop):
    with pytest.raises(StopRequested):
        generate("darcy2d", tmp_path / "d.hdf5", n_samples=4, resolution=16, coefficient=1.0, seed=0)
    assert list(tmp_path.iterdir()) == []


def test_a_lost_stop_ends_the_command_with_its_exit_code_at_the_end_of_the_block():
    with pytest.raises(StopRequested), stop_on_signals():
        StopRequested.pending = "stopped by SIGTERM outside the training"  # the exception itself was lost
    assert StopRequested.pending is None


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_a_stop_arriving_as_the_command_exits_leaves_its_exit_code(sig):
    """SLURM may deliver its --signal again, or the time limit's, to a job whose command has just ended: the work
    is over, nothing is left to stop, and the job must end with the command's code, not as killed by the signal."""
    import subprocess
    import sys

    from tests.helpers import REPO

    code = (
        "import os, signal, sys\n"
        "sys.argv = ['train', 'doctor', '--config', '/nonexistent/config.yaml']\n"
        "import train.__main__\n"  # runs the command as `python -m train` does, then exits with its code
    )
    after = f"import atexit, os, signal; atexit.register(lambda: os.kill(os.getpid(), signal.{sig}))\n"
    proc = subprocess.run([sys.executable, "-c", after + code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])


def test_a_stop_arriving_while_the_launcher_starts_ends_the_command_with_75():
    """SLURM's second delivery of a stop reached an array task requeued a moment before, as its launcher started:
    the default action killed it (exit 138, the task FAILED, never requeued). The signal is sent here as the
    command's module begins to import, before the command's handlers are in place."""
    import subprocess
    import sys

    from tests.helpers import REPO

    code = (
        "import importlib.abc, os, signal, sys\n"
        "class StopAtTheCommand(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'train.cli':\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGUSR1)\n"
        "sys.meta_path.insert(0, StopAtTheCommand())\n"
        "sys.argv = ['train', 'doctor', '--config', 'configs/tiny.yaml']\n"
        "import train.__main__\n"  # runs the command as `python -m train` does, then exits with its code
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-2000:])
    assert "stopped by SIGUSR1" in proc.stderr


def test_a_stop_raised_inside_a_finalizer_prints_nothing_and_still_ends_the_block(monkeypatch):
    """The signal's handler ran while Python called a weakref's callback (an h5py or numpy object freed
    mid-write): Python swallows that exception and printed it as a traceback under 'Exception ignored', which
    read as a crash of a clean stop."""
    import sys
    import weakref

    printed = []  # Python's hook for exceptions it cannot raise: the default prints them
    monkeypatch.setattr(sys, "unraisablehook", printed.append)

    class Freed:
        pass

    def freed(_ref):
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(10_000):  # the handler runs at the interpreter's next check, inside this callback
            pass

    with pytest.raises(StopRequested, match="stopped by SIGUSR1"), stop_on_signals():
        obj = Freed()
        ref = weakref.ref(obj, freed)
        del obj
        assert ref() is None
    assert printed == [], [p.exc_value for p in printed]
    assert sys.unraisablehook == printed.append, "the hook before the block is back"
