"""dist.parallel=fsdp and hsdp trained by real torchrun processes on CPU (gloo): the same losses as DDP, and
checkpoints of a sharded run resumed under another strategy and world size. (Faults - a rank SIGKILLed, SIGTERM
to the job - replay bitwise under fsdp too: tests/integration/test_faults.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.farm import LONG, final_weights
from tests.helpers import folders, run_cli
from train.checkpoint import checkpoint_name
from train.obs.sinks import read_metrics

pytestmark = pytest.mark.integration


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "samples_per_s" in r]


def _relative_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def test_fsdp_trains_with_the_losses_of_ddp(farm):
    """The farm's two uninterrupted 160-step runs (2 ranks, fp32, dropout on): one replicated, one sharded."""
    gap = _relative_gap(_losses(farm.reference_run("one_step")), _losses(farm.reference_run("fsdp")))
    print(f"fsdp vs ddp: largest relative loss difference over 160 steps {gap:.2e}")
    assert gap <= 1e-5


def test_hsdp_on_four_ranks_trains_with_the_losses_of_ddp(tmp_path):
    losses = {}
    for strategy in ("ddp", "hsdp"):
        proc = run_cli(
            "fit", "--config", "configs/tiny.yaml", "--nproc", "4", "--run", strategy, "--set",
            f"dist.parallel={strategy}", "--set", "dist.shard_group_size=2", "--set", "train.epochs=1", "--set",
            "train.steps_per_epoch=30", "--set", "train.log_every=1", *folders(tmp_path),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[strategy] = _losses(tmp_path / "runs" / strategy)
    log = (tmp_path / "runs" / "hsdp" / "logs" / "rank0.log").read_text()
    assert "dist.parallel=hsdp: 4 unit(s) sharded over 2 rank(s), 2 replica(s)" in log
    assert _relative_gap(losses["ddp"], losses["hsdp"]) <= 1e-5


def test_a_sharded_runs_checkpoint_resumes_under_ddp_on_one_rank_and_resharded_on_four(tmp_path, farm):
    """The fsdp reference's checkpoint at step 150 (every rank's shards) continued to 160 by DDP on the same 2 ranks
    (the same batches: weights within float rounding of the sharded run's own), by one process and by fsdp on 4
    ranks (the shards resharded as they load; other batches: it continues)."""
    source = tmp_path / "source.dcp"  # every rank's shards, as dist.checkpoint=auto writes them on one node
    shutil.copytree(farm.reference_run("fsdp") / "checkpoints" / checkpoint_name(150, sharded=True), source)
    want = final_weights(farm.reference_run("fsdp"))
    for nproc, run, strategy in ((2, "ddp-2", "ddp"), (1, "one-rank", "ddp"), (4, "fsdp-4", "fsdp")):
        proc = run_cli(
            "fit", "--config", "configs/tiny.yaml", "--nproc", str(nproc), "--run", run, *LONG, "--set",
            f"dist.parallel={strategy}", "--set", f"train.resume={source}", *folders(tmp_path),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"resumed from {source}" in (tmp_path / "runs" / run / "logs" / "rank0.log").read_text()
        got = final_weights(tmp_path / "runs" / run)
        gap = max(float((got[k] - want[k]).abs().max()) for k in want)
        print(f"{run}: largest weight difference from the fsdp run after 10 steps {gap:.2e}")
        if nproc == 2:
            assert gap < 1e-5
        assert all(torch.isfinite(v).all() for v in got.values())
