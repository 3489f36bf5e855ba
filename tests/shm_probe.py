"""Run inside a private mount namespace whose /dev/shm is a small tmpfs (see tests/integration/test_dev_shm.py).

``run CONFIG...``: the whole pipeline (``python -m train run``) as a child process, sampling the bytes used on
/dev/shm every few milliseconds; prints a JSON line with the exit code and the peak.
``preload CACHE_DIR``: the seed's design, every cached array preloaded into a tensor and moved to shared
memory with ``share_memory_()``; prints a JSON line with the error it met.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def shm_size() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_blocks * st.f_frsize


def run(args: list[str]) -> dict:
    peak, done = shm_used(), threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, shm_used())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    before = shm_used()
    sampler.start()
    proc = subprocess.run([sys.executable, "-m", "train", "run", *args], capture_output=True, text=True)
    done.set()
    sampler.join()
    return {
        "returncode": proc.returncode,
        "shm_size": shm_size(),
        "shm_before": before,
        "shm_peak": peak,
        "stderr_tail": proc.stderr[-6000:],
    }


def preload(cache_dir: Path) -> dict:
    import numpy as np
    import torch

    arrays = sorted(p for p in cache_dir.rglob("*.npy") if "_windows_" not in p.name)
    total, shared = sum(p.stat().st_size for p in arrays), 0
    try:
        for path in arrays:  # as the seed's PreloadedCacheDataset: a tensor per array, then share_memory_()
            tensor = torch.from_numpy(np.load(path))
            tensor.share_memory_()
            shared += tensor.nbytes
    except RuntimeError as e:
        return {"error": str(e), "shared_bytes": shared, "cache_bytes": total, "shm_size": shm_size()}
    return {"error": None, "shared_bytes": shared, "cache_bytes": total, "shm_size": shm_size()}


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    result = run(rest) if mode == "run" else preload(Path(rest[0]))
    print(json.dumps(result))
