"""Joining the process group: a missing peer is an error in bounded time, and the gloo fallback is opt-in."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import REPO, free_port, run_ranks
from train.distributed.env import DistEnv, destroy_distributed, init_distributed, resolve_backend
from train.errors import ConfigError, DistributedError

pytestmark = pytest.mark.distributed

LONELY_RANK = """
import sys
from train.distributed.env import DistEnv, init_distributed
from train.errors import DistributedError
try:
    init_distributed(DistEnv.from_environ("gloo"), 10)
except DistributedError as e:
    print(e)
    sys.exit(e.exit_code)
"""


def test_a_peer_that_never_arrives_is_an_error_naming_the_rendezvous():
    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", LONELY_RANK], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == DistributedError.exit_code, proc.stdout + proc.stderr
    assert f"MASTER_ADDR=127.0.0.1, MASTER_PORT={port}, world size 2" in proc.stdout
    assert "failed within 10s" in proc.stdout
    assert elapsed < 60, f"the timeout of 10 s took {elapsed:.0f} s"


def test_nccl_without_a_gpu_is_refused_unless_the_fallback_is_allowed(caplog):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without GPUs")
    with pytest.raises(ConfigError, match="backend_fallback"):
        resolve_backend("nccl", fallback=False)
    with caplog.at_level(logging.WARNING):
        assert resolve_backend("nccl", fallback=True) == "gloo"
    assert "FALLING BACK FROM NCCL TO GLOO" in caplog.text
    assert resolve_backend("auto", fallback=False) == "gloo"
    with pytest.raises(ConfigError, match="must be auto, nccl or gloo"):
        resolve_backend("mpi", fallback=False)


def _nccl_that_fails(rank: int, out: Path, fallback: bool) -> None:
    # This process group cannot start NCCL (no GPU, or a build without it): init must fail or fall back.
    env = DistEnv(rank, rank, 2, 2, "nccl", torch.device("cpu"))
    try:
        env = init_distributed(env, 30, fallback=fallback)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        result = {"backend": env.backend, "group": dist.get_backend(), "sum": t.item()}
    except DistributedError as e:
        result = {"error": str(e)}
    finally:
        destroy_distributed()
    (out / f"{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("fallback", [True, False])
def test_nccl_failing_to_start_falls_back_to_gloo_only_when_allowed(tmp_path, fallback):
    if torch.cuda.is_available() and dist.is_nccl_available():
        pytest.skip("NCCL starts here")
    run_ranks(_nccl_that_fails, 2, tmp_path, fallback)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    if fallback:
        assert results == [{"backend": "gloo", "group": "gloo", "sum": 3.0}] * 2
    else:
        assert all("joining the process group (nccl" in r["error"] for r in results), results
