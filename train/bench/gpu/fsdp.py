"""FSDP2 on a GPU (``make gpu-check GPU_CHECKS=fsdp``): the ``fsdp`` row of the strategy table against the plain
model, on the same device data, batches, optimizer and seed.

NCCL takes one rank per GPU (the launcher starts one process per visible GPU), so on a one-GPU machine the
sharded model runs over a process group of one: every unit still goes through ``fully_shard``
(DTensor parameters, its gathers and reduce-scatters, the fused AdamW on the shards, the mixed-precision policy)
and through torch.compile, which CPU tests cannot show. Two comparisons, each over the same steps:

- fp32, eager: each step's loss of the sharded model against the plain one (target: equal within 1e-5 relative);
- bf16, compiled (``default`` mode: CUDA graphs would replay without FSDP2's hooks): the sharded model's last
  losses against the plain compiled model's, and their step times.
"""

from __future__ import annotations

import statistics

from train.bench.gpu.perf import Bench

TOLERANCE = 1e-5
"""Largest relative gap between the fp32 loss curves (the FSDP2 target of docs/benchmarks.md)."""


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))


def fsdp_against_plain(bench: Bench, batch: int, steps: int = 100) -> dict:
    """Loss curves and step times of the sharded and the plain model; ``passed`` when the fp32 curves agree
    within :data:`TOLERANCE` and the compiled bf16 curves within 5% at the end."""
    fp32 = bench.settings(batch, steps, on_device=True, mode=None, objective="one_step")
    fp32 += ["train.precision=fp32", "dist.parallel=fsdp"]
    plain, sharded = bench.bare(fp32, steps, losses=True), bench.bare(fp32, steps, strategy="fsdp", losses=True)
    fp32_gap = _gap(plain["losses"], sharded["losses"])
    fast = bench.settings(batch, steps, on_device=True, mode=None if bench.toy else "default", objective="one_step")
    fast += [f"train.precision={'fp32' if bench.toy else 'bf16'}", "dist.parallel=fsdp"]
    plain_c = bench.bare(fast, steps, losses=True)
    sharded_c = bench.bare(fast, steps, strategy="fsdp", losses=True)
    tail = max(1, steps // 10)
    end = [statistics.fmean(r["losses"][-tail:]) for r in (plain_c, sharded_c)]
    end_gap = abs(end[0] - end[1]) / end[0]
    return {
        "passed": fp32_gap <= TOLERANCE and end_gap <= 0.05,
        "batch": batch,
        "steps": len(plain["losses"]),
        "fp32_eager_max_relative_gap": fp32_gap,
        "fp32_step_ms": {"plain": plain["step_ms"], "fsdp": sharded["step_ms"]},
        "compiled": {
            "precision": "fp32" if bench.toy else "bf16",
            "mode": "eager" if bench.toy else "default",
            "final_loss": {"plain": end[0], "fsdp": end[1]},
            "relative_gap": end_gap,
            "step_ms": {"plain": plain_c["step_ms"], "fsdp": sharded_c["step_ms"]},
        },
        "ranks": bench.env.world_size,
    }
