"""The GPU check's measurements (train.bench.gpu.perf, gpu_peer) at toy size on the CPU: the code a GPU machine
runs stays working where none is. Their figures are the GPU's to give (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from train.bench.gpu.perf import Bench, against_bare, no_sync, sweep

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-perf")  # the toy data, generated once


@pytest.fixture
def bench(folder):
    made = Bench(folder, CPU)
    yield made
    made.close()


def test_the_sweep_measures_the_trainer_on_both_data_paths(bench):
    rows = sweep(bench, 300, batch=4)
    assert {(r["batch"], r["data"]) for r in rows} == {(b, d) for b in (4, 8) for d in ("device", "loader")}
    assert all(r["samples_per_s"] > 0 and 0 <= r["data_wait"] < 1 for r in rows), rows


def test_the_trainer_and_the_bare_loop_run_the_same_steps(bench):
    result = against_bare(bench, 4, None, repeats=1)
    assert result["ratio"] > 0 and result["repeats"][0]["bare"]["samples_per_s"] > 0


def test_the_sync_check_counts_its_steady_steps(bench):
    assert no_sync(bench, 4, None) == {"passed": True, "steps_checked": 50, "batch": 4, "mode": "eager",
                                       "checked_on": "cpu"}  # fmt: skip


def test_the_peer_is_neuraloperators_own_trainer_on_the_same_windows(bench):
    pytest.importorskip("neuralop", reason="neuraloperator is a test-only dependency: pip install '.[dev]'")
    from train.bench.gpu.peer import peer, windows

    x, y = windows(bench, 6)
    assert x.shape == (6, 10, 64) and y.shape == (6, 1, 64)
    assert peer(bench, 2, False, batches=2)["samples_per_s"] > 0


def test_the_fsdp_check_shards_the_model_and_matches_the_plain_one(bench):
    from train.bench.gpu.fsdp import fsdp_against_plain

    result = fsdp_against_plain(bench, 4, steps=8)
    assert result["passed"], result
    assert result["steps"] == 10 and result["fp32_eager_max_relative_gap"] <= 1e-5


def test_the_bare_loop_really_shards_under_fsdp(bench, monkeypatch):
    from torch.distributed.tensor import DTensor

    from train.engine import optim

    seen = []
    real = optim.build_optimizer

    def spy(parameters, cfg, total):
        parameters = list(parameters)
        seen.extend(isinstance(p, DTensor) for p in parameters)
        return real(parameters, cfg, total)

    monkeypatch.setattr(optim, "build_optimizer", spy)
    settings = bench.settings(4, 4, on_device=True, mode=None, objective="one_step")
    bench.bare([*settings, "dist.parallel=fsdp"], 4, strategy="fsdp")
    assert seen and all(seen)


def test_the_launch_count_traces_one_steady_step(bench):
    """On a GPU: graph replays, kernel launches and copies of one steady step; on this CPU the trace has no CUDA
    calls, and its kernel-level operations outside compiled graphs (an eager step here: all of them) are counted."""
    from train.bench.gpu.perf import launches_per_step

    result = launches_per_step(bench, 4, None, warmup=2)
    assert result["graph"] == result["kernel"] == result["copy"] == 0 and not result["target_met"]
    assert result["ops_outside_graphs"] > 100, result
