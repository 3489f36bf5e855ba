"""Run inside a private mount namespace whose /dev/shm is a small tmpfs (see tests/integration/test_dev_shm.py).

``run CONFIG...``: the whole pipeline (``python -m train run``) as a child process, sampling the bytes used on
/dev/shm every few milliseconds; prints a JSON line with the exit code and the peak.
``preload CACHE_DIR``: the shared-memory design, every cached array preloaded into a tensor and moved to shared
memory with ``share_memory_()``; prints a JSON line with the error it met.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from train.obs.procmem import ShmPeak, shm_size_bytes


def run(args: list[str]) -> dict:
    with ShmPeak() as shm:
        proc = subprocess.run([sys.executable, "-m", "train", "run", *args], capture_output=True, text=True)
    return {
        "returncode": proc.returncode,
        "shm_size": shm_size_bytes(),
        "shm_peak": shm.peak,
        "stderr_tail": proc.stderr[-6000:],
    }


def cached_arrays(cache_dir: Path) -> list:
    """Every array of every finished cache under ``cache_dir``: the data a run reads, whether its bytes lie in the
    cache's .npy files or in place in the source files."""
    from train.data.cache.info import CacheInfo

    arrays = []
    for manifest in sorted(cache_dir.glob("*/*/manifest.json")):
        info = CacheInfo.load(manifest.parent)
        if info is None:
            continue
        parts = ([""] if info.autoregressive else ["x", "y"]) + (["const"] if info.const_channels else [])
        arrays += [info.array(split, part) for split in ("train", "val", "test") for part in parts]
    return arrays


def preload(cache_dir: Path) -> dict:
    import numpy as np
    import torch

    arrays = cached_arrays(cache_dir)
    total, shared = sum(a.nbytes for a in arrays), 0
    try:
        for array in arrays:  # a tensor per array, then share_memory_()
            tensor = torch.from_numpy(np.asarray(array))
            tensor.share_memory_()
            shared += tensor.nbytes
    except RuntimeError as e:
        return {"error": str(e), "shared_bytes": shared, "cache_bytes": total, "shm_size": shm_size_bytes()}
    return {"error": None, "shared_bytes": shared, "cache_bytes": total, "shm_size": shm_size_bytes()}


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    result = run(rest) if mode == "run" else preload(Path(rest[0]))
    print(json.dumps(result))
