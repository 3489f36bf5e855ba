"""A rank killed by a signal: the launcher names the rank and the signal and exits with code 5."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, folders

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
def test_sigkill_of_one_rank_is_reported_with_exit_code_5(tmp_path):
    args = ["run", "--config", "configs/tiny.yaml", "--nproc", "2", "--set", "train.steps_per_epoch=100000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", *args, *folders(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / "tiny"
    log = run_dir / "logs" / "rank1.log"
    try:
        deadline = time.monotonic() + 120
        pid = None
        while time.monotonic() < deadline and proc.poll() is None:
            if log.is_file() and "training" in log.read_text():
                pid = _rank_pid(run_dir, 1)
                if pid is not None:
                    break
            time.sleep(0.2)
        assert pid is not None, "rank 1 never started training"
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 5, stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in stderr
    assert "out-of-memory" in stderr
    # The root cause comes first in the summary, before any peer it took down.
    summary = stderr.split("training failed:", 1)[1].strip().splitlines()
    assert summary[0].startswith("rank 1 was killed by SIGKILL"), summary
