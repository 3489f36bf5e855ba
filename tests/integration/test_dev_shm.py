"""Proof that training never needs /dev/shm for its data: Docker's 64 MB default, a cache over ten times larger.

Each test runs in a private mount namespace (``unshare -m``) with its own 64 MB tmpfs on /dev/shm, as in a
container started without ``--shm-size``. The same namespace makes the shared-memory design (the whole cache
preloaded and moved to shared memory) fail with "No space left on device", so the proof cannot pass vacuously.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, folders, in_namespace_with_tmpfs, mount_namespace_problem, run_cli
from tests.shm_probe import cached_arrays
from train.disk import human

pytestmark = pytest.mark.integration

SHM_MB = 64
RANKS, WORKERS, PREFETCH = 2, 4, 2  # PREFETCH: DataLoader's default prefetch_factor
BATCHES = {"advection1d": 16, "darcy2d": 8}

CONFIG = f"""
tasks:
  advection1d:
    pde: advection1d
    n_samples: 880
    resolution: 1024
    initial_step: 10
    batch_size: {BATCHES["advection1d"]}
    patch_size: 16
  darcy2d:
    pde: darcy2d
    n_samples: 200
    resolution: 32
    coefficient: 1.0
    batch_size: {BATCHES["darcy2d"]}
    patch_size: 8
model:
  d_model: 32
  n_heads: 2
  n_layers: 1
train:
  epochs: 1
  steps_per_epoch: 20
  log_every: 5
  num_workers: {WORKERS}
run:
  name: shm64
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    problem = mount_namespace_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the /dev/shm proof must run in CI, but {problem}")
        pytest.skip(problem)
    tmp = tmp_path_factory.mktemp("shm")
    config = tmp / "shm64.yaml"
    config.write_text(CONFIG)
    args = ["--config", str(config), "--nproc", str(RANKS), *folders(tmp)]
    proc = run_cli("cache", *args, timeout=600)  # data and caches are built on the host, outside the namespace
    assert proc.returncode == 0, proc.stderr[-4000:]
    cache_bytes = sum(a.nbytes for a in cached_arrays(tmp / "cache"))  # in place or copied: the data read
    return tmp, args, cache_bytes


def in_small_shm(*command: str, timeout: float = 900) -> dict:
    """Run tests/shm_probe.py COMMAND in a private namespace with a 64 MB /dev/shm; its JSON result."""
    probe = [sys.executable, str(REPO / "tests" / "shm_probe.py"), *command]
    proc = in_namespace_with_tmpfs(Path("/dev/shm"), f"{SHM_MB}m", *probe, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shm_size"] == SHM_MB << 20, "the probe must see the namespace's tmpfs, not the host's /dev/shm"
    return result


def test_two_ranks_with_four_workers_train_on_a_cache_ten_times_larger_than_dev_shm(setup):
    tmp, args, cache_bytes = setup
    assert cache_bytes >= 10 * (SHM_MB << 20), f"cache of {cache_bytes / 2**20:.0f} MiB is too small for the proof"
    result = in_small_shm("run", *args)
    assert result["returncode"] == 0, result["stderr_tail"]
    summary = json.loads((tmp / "runs" / "shm64" / "report" / "summary.json").read_text())
    assert set(summary) == {"advection1d", "darcy2d"}
    # What may pass through /dev/shm: batches on their way from the workers, never the cache. Per loader
    # that is prefetch_factor batches per worker, plus the few the training loop still references (the
    # current one, the one before it, one received out of order); 1 MiB covers the queues' semaphores.
    batch_bytes = 4 * (BATCHES["advection1d"] * 11 * 1024 + BATCHES["darcy2d"] * 2 * 32 * 32)
    bound = RANKS * (WORKERS * PREFETCH + 4) * batch_bytes + (1 << 20)
    used = result["shm_peak"]
    print(
        f"/dev/shm peak {used / 2**20:.2f} MiB of {SHM_MB} MiB; in-flight batch bound {bound / 2**20:.2f} MiB; "
        f"cache {cache_bytes / 2**20:.0f} MiB"
    )
    assert used <= bound
    assert used < cache_bytes / 20


def test_a_preloaded_shared_cache_fails_in_the_same_namespace(setup):
    tmp, _, cache_bytes = setup
    result = in_small_shm("preload", str(tmp / "cache"))
    # torch words it "unable to allocate shared memory(shm) for file </torch_...>" (older releases: "unable
    # to write to file </torch_...>"), then the errno text (docs/troubleshooting.md).
    assert result["error"] is not None, "the shared-memory design unexpectedly fit in 64 MB"
    assert re.search(r"</torch_[\d_]+>: No space left on device \(28\)", result["error"]), result["error"]
    assert result["shared_bytes"] < SHM_MB << 20 < cache_bytes


def doctor_in_small_shm(args: list[str], *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "train", "doctor", *args, *extra]
    return in_namespace_with_tmpfs(Path("/dev/shm"), f"{SHM_MB}m", *command, timeout=120)


def test_the_doctor_sizes_dev_shm_from_the_cache_and_fails_where_it_is_too_small(setup):
    _, args, _ = setup
    batch_bytes = 4 * (BATCHES["advection1d"] * 11 * 1024 + BATCHES["darcy2d"] * 2 * 32 * 32)

    def need(workers: int) -> str:
        return human(RANKS * (workers * PREFETCH + 4) * batch_bytes)

    fits = doctor_in_small_shm(args)
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert re.search(rf"WARN\s+/dev/shm\s+64.0 MiB free of 64.0 MiB; needs {need(WORKERS)}, but this is Docker's 64 MB",
                     fits.stdout), fits.stdout  # fmt: skip
    # Six times the workers: their in-flight batches no longer fit.
    too_many = doctor_in_small_shm(args, "--set", "train.num_workers=24")
    assert too_many.returncode == 4, too_many.stdout + too_many.stderr
    assert re.search(rf"FAIL\s+/dev/shm\s+64.0 MiB free of 64.0 MiB, this config needs {need(24)}", too_many.stdout)
    assert "--shm-size" in too_many.stdout and "/dev/shm" in too_many.stderr
