"""Tests of the memory figures the benchmark reads from /proc and /dev/shm, against real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from train.obs.procmem import ShmPeak, child_pids, pss_bytes, shm_used_bytes

MB = 1 << 20

_TOUCH = """
import sys
block = bytearray(int(sys.argv[1]) * (1 << 20))  # zero-filled: every page written
print("ready", flush=True)
sys.stdin.readline()
"""


def _child(mb: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _TOUCH, str(mb)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_pss_grows_by_the_memory_a_process_touches():
    small, large = _child(1), _child(200)
    try:
        grown = pss_bytes(large.pid) - pss_bytes(small.pid)
        assert 190 * MB < grown < 215 * MB
    finally:
        for proc in (small, large):
            proc.communicate("\n")


def test_child_pids_lists_real_children():
    proc = _child(1)
    try:
        assert proc.pid in child_pids(os.getpid())
    finally:
        proc.communicate("\n")
    assert proc.pid not in child_pids(os.getpid())


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_shm_used_and_peak_see_a_file_in_dev_shm():
    path = Path("/dev/shm") / f"procmem-test-{uuid.uuid4().hex}"
    before = shm_used_bytes()
    with ShmPeak(interval_s=0.001) as shm:
        try:
            path.write_bytes(b"\1" * (8 * MB))
            assert shm_used_bytes() - before >= 7 * MB
            time.sleep(0.1)  # sampled every millisecond: give the thread time to see it
        finally:
            path.unlink()
    assert shm.peak >= 7 * MB
