"""Remote benchmark: the trainer's step time with and without a slow remote mirroring every checkpoint.

The same launch as the trainer benchmark (2 gloo ranks, no torch.compile), with a checkpoint every 10 steps,
run alternately without a remote and with one: b2sdk's simulated B2 bucket (in this process, which is the
launcher) throttled to ``rate_mb_s`` per upload, so that an upload is always in flight. The launcher's mirror
thread snapshots, hashes and uploads each checkpoint while the ranks train; the figure is the ratio of the
median step times (with / without), per pair of launches, and its median over the pairs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from train import run_files
from train.bench import machine_figures, save_result
from train.bench.trainer_step import RANKS, config, prepare
from train.config import Config
from train.data.acquire.sources import stage_data
from train.launch.torchrun import launch
from train.launch.watchers import watched_launch
from train.obs.sinks import read_metrics
from train.pipeline import stage_cache
from train.remote.pointer import read_pointer
from train.remote.store import open_remote

TARGET = 1.02
TARGET_NAME = f"step time ratio with/without a slow remote <= {TARGET}"
CHECKPOINT_EVERY = 10


def slow_bucket(rate_mb_s: float):
    """A simulated B2 account (credentials in this process's environment) whose uploads run at ``rate_mb_s``."""
    from b2sdk.v2 import B2Api, B2HttpApiConfig, InMemoryAccountInfo, RawSimulator

    class SlowSimulator(RawSimulator):
        MIN_PART_SIZE = 1 << 20

        def upload_part(self, upload_url, upload_auth_token, part_number, content_length, *args, **kwargs):
            time.sleep(content_length / (rate_mb_s * 1e6))
            return super().upload_part(upload_url, upload_auth_token, part_number, content_length, *args, **kwargs)

        def upload_file(self, upload_url, upload_auth_token, file_name, content_length, *args, **kwargs):
            time.sleep(content_length / (rate_mb_s * 1e6))
            return super().upload_file(upload_url, upload_auth_token, file_name, content_length, *args, **kwargs)

    api = B2Api(InMemoryAccountInfo(), api_config=B2HttpApiConfig(_raw_api_class=SlowSimulator))
    key_id, key = api.session.raw_api.create_account()
    api.authorize_account("production", key_id, key)
    api.create_bucket("bench", "allPrivate")
    os.environ["B2_APPLICATION_KEY_ID"], os.environ["B2_APPLICATION_KEY"] = key_id, key
    return api


def timed_launch(cfg: Config, folders: dict, warmup: int, api) -> dict:
    """One launch, mirrored to the slow bucket when ``api`` is given; rank 0's steady step time."""
    run = prepare(cfg, folders)
    if api is None:
        launch(run, RANKS, cfg, ["--stages", "fit"], module="train.worker")
        mirrored, in_time = [], []
    else:
        remote = open_remote("b2://bench/runs", run.root.name, api)
        with watched_launch(cfg, run, remote) as mirror:
            launch(run, RANKS, cfg, ["--stages", "fit"], module="train.worker")
            in_time = list(mirror.mirrored)  # verified while the ranks trained
        mirrored = mirror.mirrored
        assert (read_pointer(remote) or {}).get("checkpoint"), "the benchmark's remote holds no checkpoint"
    windows = [r for r in read_metrics(run.root / run_files.METRICS) if "step_time_s" in r]
    steady = [r["step_time_s"] for r in windows if r["step"] - cfg.train.log_every >= warmup]
    if not steady:
        raise RuntimeError(f"no metrics window after {warmup} warmup steps in {run.root / 'metrics.jsonl'}")
    return {
        "step_time_s": statistics.median(steady),
        "windows": len(steady),
        "mirrored": mirrored,
        "mirrored_while_training": len(in_time),
    }


def run(out: Path, workdir: Path, steps: int, warmup: int, repeats: int, rate_mb_s: float, quick: bool) -> dict:
    workdir = workdir.resolve()
    log_every = 2 if quick else 10
    cfg, overrides = config(workdir, "bench-remote", steps, warmup, log_every, quick)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"checkpoint_every": CHECKPOINT_EVERY})})
    overrides = [
        *(o for o in overrides if not o.startswith("train.checkpoint_every")),
        f"train.checkpoint_every={CHECKPOINT_EVERY}",
    ]
    folders = stage_cache(cfg, stage_data(cfg))
    api = slow_bucket(rate_mb_s)
    load_before = os.getloadavg()[0]
    pairs = []
    for i in range(repeats):
        print(f"remote benchmark: repeat {i + 1}/{repeats}, no remote", file=sys.stderr, flush=True)
        without = timed_launch(cfg, folders, warmup, None)
        print(f"remote benchmark: repeat {i + 1}/{repeats}, slow remote", file=sys.stderr, flush=True)
        with_remote = timed_launch(cfg, folders, warmup, api)
        pairs.append(
            {"without": without, "with": with_remote, "ratio": with_remote["step_time_s"] / without["step_time_s"]}
        )
    ratio = statistics.median(p["ratio"] for p in pairs)
    checkpoint_bytes = sum(
        p.stat().st_size for p in (Path(cfg.run.runs_dir) / "bench-remote" / "checkpoints").glob("step_*.pt")
    )
    result = {
        "machine": machine_figures(load_before),
        "setup": {
            "config": f"configs/{'tiny' if quick else 'default'}.yaml",
            "overrides": overrides,
            "ranks": RANKS,
            "steps": steps,
            "warmup": warmup,
            "repeats": repeats,
            "rate_mb_s": rate_mb_s,
            "checkpoint_mb": checkpoint_bytes / 1e6 / max(1, cfg.train.keep_checkpoints),
        },
        "without_s": statistics.median(p["without"]["step_time_s"] for p in pairs),
        "with_s": statistics.median(p["with"]["step_time_s"] for p in pairs),
        "ratio": ratio,
        "repeats": pairs,
        "targets": {TARGET_NAME: ratio <= TARGET},
    }
    save_result(out, "remote", result, markdown(result))
    return result


def markdown(r: dict) -> str:
    s, load = r["setup"], r["machine"]["load_average_1min"]
    ms = lambda x: f"{1000 * x:.2f} ms"  # noqa: E731
    lines = [
        f"{s['config']} ({', '.join(s['overrides'])}); {s['ranks']} gloo ranks, {s['warmup']} warmup + {s['steps']} "
        f"timed steps, a checkpoint ({s['checkpoint_mb']:.1f} MB) every {CHECKPOINT_EVERY} steps; the remote: "
        f"simulated B2 at {s['rate_mb_s']} MB/s; {s['repeats']} pair(s) of launches, alternating; "
        f"{r['machine']['cpus']} CPUs, 1-minute load average {load['before']:.1f} before, {load['after']:.1f} after.",
        "",
        "| repeat | no remote | slow remote | ratio | checkpoints mirrored while training / in all |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {i} | {ms(p['without']['step_time_s'])} | {ms(p['with']['step_time_s'])} | {p['ratio']:.3f} | "
            f"{p['with']['mirrored_while_training']} / {len(p['with']['mirrored'])} |"
            for i, p in enumerate(r["repeats"], 1)
        ),
        "",
        f"Step time ratio with/without the remote (median over pairs): **{r['ratio']:.3f}**.",
        "",
        "| target | met |",
        "|---|---|",
        *(f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in r["targets"].items()),
    ]
    return "\n".join(lines) + "\n"
