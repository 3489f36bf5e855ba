"""A rank killed by a signal: the launcher names the rank and the signal, with a hint, and exits 128+signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, folders, startup_s

pytestmark = pytest.mark.integration


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the worker process of ``run_dir`` whose RANK is ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train.worker" in cmdline and str(run_dir).encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc to find the rank's process")
@pytest.mark.parametrize(
    "sig, hint", [(signal.SIGKILL, "out-of-memory"), (signal.SIGBUS, "/dev/shm exhausted")], ids=["SIGKILL", "SIGBUS"]
)
def test_a_rank_killed_by_a_signal_is_named_first_with_the_shells_exit_code(tmp_path, sig, hint):
    args = ["run", "--config", "configs/tiny.yaml", "--nproc", "2", "--set", "train.steps_per_epoch=100000"]
    startup_s()  # measured before the launch, not while it runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", *args, *folders(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / "tiny"
    log = run_dir / "logs" / "rank1.log"
    try:
        deadline = time.monotonic() + 60 * startup_s()
        pid = None
        while time.monotonic() < deadline and proc.poll() is None:
            if log.is_file() and "training" in log.read_text():
                pid = _rank_pid(run_dir, 1)
                if pid is not None:
                    break
            time.sleep(0.2)
        assert pid is not None, "rank 1 never started training"
        os.kill(pid, sig)
        _, stderr = proc.communicate(timeout=60 * startup_s())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert f"rank 1 was killed by {sig.name}" in stderr
    assert hint in stderr
    # The root cause comes first in the summary, before any peer it took down.
    summary = stderr.split("training failed:", 1)[1].strip().splitlines()
    assert summary[0].startswith(f"rank 1 was killed by {sig.name}"), summary
