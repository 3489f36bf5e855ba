"""Streaming benchmark: samples/s of a run streaming its shards from a throttled store through a node cache a
quarter of the data's size, against the same run reading the shard set from local disk.

The store is an HTTP server on 127.0.0.1 (in this process) that sends at most ``rate_mb_s``. Both runs are one
rank of ``python -m train fit`` (FNO, 1-D advection, one pass over the data an epoch). Measured: the steady
samples/s of each (metrics.jsonl, the first window left out), the bytes fetched per epoch (the cache's record of
its fetches) against the data's size, the cache's size sampled every second against its limit, and the time from
launch to the first step for the shard set and for one four times its size (the same shards listed four times).
Then the same for The Well's files as published (the Gray-Scott demo's, served at the same rate): the published set
streamed through a cache at its working set, against the same trajectories repacked on local disk.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import yaml

from train.bench import REPO, machine_figures, save_result
from train.data.cache.info import CacheInfo
from train.data.stream.shards import write_shard_set

TARGETS = (
    "streamed samples/s >= 90% of local disk",
    "bytes fetched per epoch <= 1.1x the data",
    "cache never above its limit",
    "time to first step of a 4x larger set within 25%",
    "the Well's files streamed as published: samples/s >= 90% of their repacked shards on local disk",
)


def serve(root: Path, rate_mb_s: float) -> tuple[http.server.ThreadingHTTPServer, str]:
    """An HTTP server of ``root`` on 127.0.0.1 that sends each file at ``rate_mb_s`` at most."""
    chunk = 64 << 10

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args) -> None:
            pass

        def copyfile(self, source, outputfile) -> None:
            while block := source.read(chunk):
                outputfile.write(block)
                time.sleep(len(block) / (rate_mb_s * 1e6))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m train {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def _source(workdir: Path, samples: int, shard_mb: float) -> Path:
    """The task's shard set, written once."""
    out = workdir / f"set-{samples}-{shard_mb:g}mb"  # one per size: a quick run's set is not the full one
    if not (out / "adv" / "stream.json").is_file():
        task = {"pde": "advection1d", "n_samples": samples, "resolution": 256, "temporal_stride": 5}
        (workdir / "source.yaml").write_text(yaml.safe_dump({"tasks": {"adv": task}}))
        where = [f"--set=run.{k}_dir={workdir / k}" for k in ("data", "cache", "runs")]
        _cli(
            "shard", "--config", str(workdir / "source.yaml"), *where, "--output", str(out), "--shard-mb", str(shard_mb)
        )
    return out / "adv"


def _four_times(shard_set: Path) -> Path:
    """A set listing every shard four times (hard links): four times the data, the same shards."""
    big = shard_set.parent / "adv4"
    if not (big / "stream.json").is_file():
        big.mkdir(exist_ok=True)
        meta = json.loads((shard_set / "stream.json").read_text())
        shards = []
        for copy in range(4):
            for s in meta["shards"]:
                name = f"c{copy}-{s['name']}"
                if not (big / name).exists():
                    os.link(shard_set / s["name"], big / name)
                shards.append({**s, "name": name})
        for w in meta["whole"]:
            if not (big / w["name"]).exists():
                os.link(shard_set / w["name"], big / w["name"])
        meta["cache"]["sizes"]["train"] *= 4
        (big / "stream.json").write_text(json.dumps({**meta, "shards": shards}))
    return big


def _advection(source: str, epochs: int, limit: int | None) -> dict:
    return {
        "tasks": {"adv": {"pde": "advection1d", "source": source, "initial_step": 4, "batch_size": 64}},
        "model": {"name": "fno", "fno": {"modes": 8, "width": 16}},
        "data": {"stream": True, "block_shards": 1, **({"cache_limit": limit} if limit else {})},
        "train": {"epochs": epochs, "log_every": 5, "num_workers": 1},
    }


def _gray_scott(source: str, epochs: int, limit: int | None) -> dict:
    """The Well demo's config (configs/well.yaml) streamed from ``source``, epochs of one pass; nothing fetched
    ahead, so that the smallest cache the plan accepts holds less than the four files' conversions."""
    config = yaml.safe_load((REPO / "configs" / "well.yaml").read_text())
    config["tasks"]["gray_scott"]["source"] = source
    limited = {"cache_limit": limit} if limit else {}
    config["data"] = {"stream": True, "block_shards": 1, "prefetch_blocks": 0, **limited}
    config["train"].update(epochs=epochs, steps_per_epoch=None, log_every=5, num_workers=1, warmup_steps=0)
    return config


def _held(folder: Path) -> int:
    """Bytes of a node's shard cache: its shards (or conversions) and a download being converted."""
    skip = {"fetched.jsonl", ".lock"}
    return sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name not in skip and p.parent.name != "pins"
    )


def _fit(workdir: Path, run: str, config: dict, watch: bool) -> dict:
    (task,) = config["tasks"]
    path = workdir / f"{run}.yaml"
    path.write_text(yaml.safe_dump(config))
    where = [f"--set=run.{k}_dir={workdir / run / k}" for k in ("data", "cache", "runs")]
    shutil.rmtree(workdir / run, ignore_errors=True)
    peaks: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            folders = list((workdir / run / "cache").glob(f"{task}/stream-*/shards")) if watch else []
            peaks.append(sum(_held(f) for f in folders))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _cli("fit", "--config", str(path), "--nproc", "1", "--run", run, *where, "--skip-doctor")
    finally:
        done.set()
        sampler.join()
    records = [json.loads(line) for line in (workdir / run / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "samples_per_s" in r]
    fetched = 0
    for log in (workdir / run / "cache").glob(f"{task}/stream-*/shards/fetched.jsonl"):
        fetched += sum(json.loads(line)["bytes"] for line in log.read_text().splitlines())
    return {
        "samples_per_s": statistics.median(r["samples_per_s"] for r in windows[1:] or windows),
        "first_step_s": next(r["launch_to_first_step_s"] for r in records if "launch_to_first_step_s" in r),
        "fetched_bytes": fetched,
        "cache_samples": len(peaks),
        "cache_peak_bytes": max(peaks, default=0),
    }


def _published_sets(workdir: Path, url: str) -> tuple[Path, Path]:
    """The Well demo's files (generated once), the manifest of them as published at ``url`` (read over HTTP), and
    the same trajectories repacked into one shard a file on local disk (what the published run must match)."""
    where = [f"--set=run.{k}_dir={workdir / 'well' / k}" for k in ("data", "cache", "runs")]
    config = ["--config", str(REPO / "configs" / "well.yaml"), *where]
    repacked, published = workdir / "well" / "repacked", workdir / "well" / "published"
    if not (repacked / "stream.json").is_file():
        _cli("cache", *config)
        (built,) = (workdir / "well" / "cache" / "gray_scott").iterdir()
        files = sorted((workdir / "well" / "data" / "gray_scott" / "data" / "train").iterdir())
        counts = []
        for file in files:
            with h5py.File(file) as f:
                counts.append(int(f.attrs["n_trajectories"]))
        write_shard_set("gray_scott", CacheInfo.load(built), repacked, counts=counts)
    shutil.rmtree(published, ignore_errors=True)
    _cli(
        "shard",
        *config,
        "--set",
        f"tasks.gray_scott.source={url}/gray_scott",
        "--published",
        "--output",
        str(published),
    )
    return repacked, published / "gray_scott"


def run(out: Path, workdir: Path, samples: int, shard_mb: float, rate_mb_s: float, epochs: int, quick: bool) -> dict:
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    shard_set = _source(workdir, samples, shard_mb)
    meta = json.loads((shard_set / "stream.json").read_text())
    data = sum(s["bytes"] for s in meta["shards"])
    limit = data // 4
    server, url = serve(shard_set.parent, rate_mb_s)
    try:
        print("stream benchmark: local shard set", file=sys.stderr, flush=True)
        local = _fit(workdir, "local", _advection(str(shard_set), epochs, None), False)
        print(f"stream benchmark: streamed at {rate_mb_s} MB/s", file=sys.stderr, flush=True)
        streamed = _fit(workdir, "streamed", _advection(f"{url}/adv", epochs, limit), True)
        print("stream benchmark: first step of a 4x larger set", file=sys.stderr, flush=True)
        big = _four_times(shard_set)
        larger = _fit(workdir, "larger", _advection(f"{url}/{big.name}", 1, limit), True)
    finally:
        server.shutdown()
    server, url = serve(workdir / "well" / "data", rate_mb_s)
    try:
        print(f"stream benchmark: the Well's files as published at {rate_mb_s} MB/s", file=sys.stderr, flush=True)
        repacked, published = _published_sets(workdir, url)
        files = sum(s["bytes"] for s in json.loads((published / "stream.json").read_text())["shards"])
        from_disk = _fit(workdir, "repacked", _gray_scott(str(repacked), epochs, None), False)
        well_limit = _published_limit(published)
        as_published = _fit(workdir, "published", _gray_scott(str(published), epochs, well_limit), True)
    finally:
        server.shutdown()
    ratio = streamed["samples_per_s"] / local["samples_per_s"]
    per_epoch = streamed["fetched_bytes"] / epochs / data
    first = larger["first_step_s"] / streamed["first_step_s"]
    published_ratio = as_published["samples_per_s"] / from_disk["samples_per_s"]
    result = {
        "machine": machine_figures(load_before),
        "setup": {
            "samples": samples,
            "shards": len(meta["shards"]),
            "data_bytes": data,
            "cache_limit_bytes": limit,
            "rate_mb_s": rate_mb_s,
            "epochs": epochs,
        },
        "local": local,
        "streamed": streamed,
        "larger": larger,
        "published": {
            "files_bytes": files,
            "cache_limit_bytes": well_limit,
            "repacked_local": from_disk,
            "streamed": as_published,
            "ratio": published_ratio,
            "fetched_per_epoch": as_published["fetched_bytes"] / epochs / files,
        },
        "ratio": ratio,
        "fetched_per_epoch": per_epoch,
        "first_step_ratio": first,
        "targets": {
            TARGETS[0]: ratio >= 0.9,
            TARGETS[1]: per_epoch <= 1.1,
            TARGETS[2]: max(streamed["cache_peak_bytes"], larger["cache_peak_bytes"]) <= limit
            and as_published["cache_peak_bytes"] <= well_limit,
            TARGETS[3]: first <= 1.25,
            TARGETS[4]: published_ratio >= 0.9,
        },
    }
    save_result(out, "stream", result, markdown(result))
    return result


def _published_limit(published: Path) -> int:
    """The smallest cache the plan accepts for the published set at the benchmark's settings: its working set."""
    from train.config import validate
    from train.data.stream.stage import read_shard_set, working_set

    cfg = validate(_gray_scott(str(published), 1, None), "the benchmark's config")
    return working_set(cfg, read_shard_set(str(published)))


def markdown(r: dict) -> str:
    s, w, load = r["setup"], r["published"], r["machine"]["load_average_1min"]
    mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
    lines = [
        f"1-D advection, {s['samples']} trajectories at 256 points in {s['shards']} shards ({mb(s['data_bytes'])}); "
        f"FNO, one rank, {s['epochs']} epochs of one pass; the store: HTTP on 127.0.0.1 at {s['rate_mb_s']} MB/s; "
        f"the node cache limited to {mb(s['cache_limit_bytes'])} (a quarter); {r['machine']['cpus']} CPUs, 1-minute "
        f"load average {load['before']:.1f} before, {load['after']:.1f} after.",
        "",
        "| run | samples/s | launch to first step | fetched | cache peak (samples) |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {x['samples_per_s']:.0f} | {x['first_step_s']:.1f} s | {mb(x['fetched_bytes'])} | "
            f"{mb(x['cache_peak_bytes'])} ({x['cache_samples']}) |"
            for name, x in (("local disk", r["local"]), ("streamed", r["streamed"]), ("4x larger set", r["larger"]))
        ),
        "",
        f"Streamed / local samples/s: **{r['ratio']:.2f}**; fetched per epoch: **{r['fetched_per_epoch']:.2f}x** the "
        f"data; first step of the 4x set / of the set: **{r['first_step_ratio']:.2f}**.",
        "",
        f"The Well's files as published (the Gray-Scott demo, configs/well.yaml: {mb(w['files_bytes'])} of training "
        f"files, four files a split), the manifest read from the same store, streamed through a cache of "
        f"{mb(w['cache_limit_bytes'])} (the working set, nothing fetched ahead: the smallest cache the plan accepts; "
        "each file converted on the node), against the same trajectories repacked into one shard a file on local "
        "disk:",
        "",
        "| run | samples/s | launch to first step | fetched | cache peak (samples) |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {x['samples_per_s']:.0f} | {x['first_step_s']:.1f} s | {mb(x['fetched_bytes'])} | "
            f"{mb(x['cache_peak_bytes'])} ({x['cache_samples']}) |"
            for name, x in (("repacked, local disk", w["repacked_local"]), ("published, streamed", w["streamed"]))
        ),
        "",
        f"Published / repacked samples/s: **{w['ratio']:.2f}**; fetched per epoch: **{w['fetched_per_epoch']:.2f}x** "
        "the files.",
        "",
        "| target | met |",
        "|---|---|",
        *(f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in r["targets"].items()),
    ]
    return "\n".join(lines) + "\n"
