"""Parallel strategies benchmark: ddp, fsdp and hsdp on 2 and 4 CPU ranks (gloo) with the transformer at a size
where the model state matters (d_model 256, 8 layers: about 6 M parameters, 100 MB of weights, gradients and
AdamW state under ddp).

Per (ranks, strategy, checkpoint form), one ``python -m train fit`` of configs/tiny.yaml's data (30 steps, a
checkpoint at step 20) and one more resuming from that checkpoint: rank 0's model state (its shards: weights,
gradients, optimizer state, from the tensors), its peak RSS, the median step time of the windows after the
first, the checkpoint's write time and the resume's load: of every rank's shards (dist.checkpoint=sharded), or
gathered onto rank 0 and written as one file, then sharded again as it loads (full). Targets: fsdp's model state per
rank at most 0.6x ddp's on 2 ranks and 0.35x on 4.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

from train.bench import machine_figures, save_result
from train.checkpoint import checkpoint_name
from train.errors import TrainError
from train.obs.sinks import read_metrics

REPO = Path(__file__).resolve().parents[2]
MODEL = [
    "model.name=transformer",
    "model.transformer.d_model=256",
    "model.transformer.n_layers=8",
    "model.transformer.n_heads=8",
    "train.objective=one_step",
]
PLAN = [
    (2, "ddp", "full"),
    (2, "fsdp", "sharded"),
    (2, "fsdp", "full"),
    (4, "ddp", "full"),
    (4, "fsdp", "sharded"),
    (4, "fsdp", "full"),
    (4, "hsdp", "sharded"),
]
"""(ranks, dist.parallel, dist.checkpoint) of each measured run."""
TARGETS = {2: 0.6, 4: 0.35}


def _fit(workdir: Path, run: str, nproc: int, strategy: str, *extra: str) -> list[dict]:
    sets = [
        *MODEL,
        f"dist.parallel={strategy}",
        "dist.shard_group_size=2",
        "train.epochs=1",
        "train.steps_per_epoch=30",
        "train.log_every=10",
        "train.checkpoint_every=20",
        "train.val_every=1000",
        *(f"run.{k}_dir={workdir / k}" for k in ("data", "cache", "runs")),
        *extra,
    ]
    command = [
        sys.executable,
        "-m",
        "train",
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--nproc",
        str(nproc),
        "--run",
        run,
        *(a for s in sets for a in ("--set", s)),
    ]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise TrainError(f"{run} failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return read_metrics(workdir / "runs" / run / "metrics.jsonl")


def measure(workdir: Path, nproc: int, strategy: str, form: str) -> dict:
    run, checkpoint = f"{strategy}-{nproc}-{form}", f"dist.checkpoint={form}"
    records = [r for r in _fit(workdir, run, nproc, strategy, checkpoint) if "step_time_s" in r]
    source = (
        workdir / "runs" / run / "checkpoints" / checkpoint_name(20, sharded=strategy != "ddp" and form == "sharded")
    )
    resumed = _fit(workdir, f"{run}-resumed", nproc, strategy, checkpoint, f"train.resume={source}")
    return {
        "ranks": nproc,
        "strategy": strategy,
        "checkpoint": form,
        "model_state_mib": records[0]["model_state_mib"],
        "peak_rss_mib": max(r["rss_mib"] for r in records),
        "step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
        "checkpoint_write_s": next(r["checkpoint_s"] for r in records if "checkpoint_s" in r),
        "checkpoint_load_s": next(r["resume_load_s"] for r in resumed if "resume_load_s" in r),
        "final_loss": records[-1]["loss"],
    }


def run(out: Path, workdir: Path, quick: bool = False) -> dict:
    """Every entry of PLAN; ``quick`` runs the same plan (its sizes are already small)."""
    load_before = os.getloadavg()[0]
    rows = [measure(workdir, nproc, strategy, form) for nproc, strategy, form in PLAN]
    ddp = {r["ranks"]: r for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        base = ddp[r["ranks"]]
        r["state_vs_ddp"] = r["model_state_mib"] / base["model_state_mib"]
        r["step_vs_ddp"] = r["step_time_s"] / base["step_time_s"]
    targets = {
        f"fsdp model state per rank <= {limit}x ddp's on {n} ranks": next(
            r["state_vs_ddp"] <= limit for r in rows if r["ranks"] == n and r["strategy"] == "fsdp"
        )
        for n, limit in TARGETS.items()
    }
    result = {"rows": rows, "machine": machine_figures(load_before), "targets": targets, "model": MODEL}
    lines = [
        "| ranks | strategy | checkpoint | model state / rank | vs ddp | peak RSS | step time | vs ddp | "
        "checkpoint write | load |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['ranks']} | {r['strategy']} | {r['checkpoint']} | {r['model_state_mib']:.1f} MiB | "
            f"{r['state_vs_ddp']:.2f}x | "
            f"{r['peak_rss_mib']:.0f} MiB | {1e3 * r['step_time_s']:.0f} ms | {r['step_vs_ddp']:.2f}x | "
            f"{r['checkpoint_write_s']:.2f} s | {r['checkpoint_load_s']:.2f} s |"
            for r in rows
        ),
        "",
        *(f"- {name}: {'met' if met else 'MISSED'}" for name, met in targets.items()),
    ]
    save_result(out, "parallel", result, "\n".join(lines) + "\n")
    return result
