"""Data loading benchmark: our memory-mapped cache against per-sample HDF5 reads and a shared-memory cache.

On the 2-task default data scaled up (advection1d + darcy2d), 2 ranks x 2 DataLoader workers per task each:
- samples/s of (a) the mmap cache as the trainer loads it, (b) one h5py read per sample as PDEBench's
  per-item loaders do, (c) the whole cache preloaded into tensors moved to shared memory (``share_memory_()``,
  the design that exhausts a container's /dev/shm: docs/troubleshooting.md);
- bytes in /dev/shm at the peak of each run;
- the memory the data costs: total PSS of all ranks and workers, minus the same processes' PSS before any
  data is touched (workers wait in ``worker_init_fn`` until that baseline is taken);
- cache build MB/s against a raw sequential HDF5 read of the same files, both from a cold page cache.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from functools import partial
from pathlib import Path
from queue import Empty

import h5py
import numpy as np
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, RandomSampler

from train.bench import save_result
from train.config import TaskConfig
from train.data.acquire.generate import generate
from train.data.cache.build import CHECKSUMS, build_cache
from train.data.cache.info import CacheInfo
from train.data.checksum import ChecksumMemo
from train.data.dataset import EqualBatchSampler, keep_batch, training_dataset
from train.data.formats.pdebench import READ_BLOCK_BYTES
from train.obs.procmem import ShmPeak, pss_bytes, shm_size_bytes

RANKS, WORKERS, INITIAL_STEP = 2, 2, 10
BATCH = {"advection1d": 32, "darcy2d": 16}  # configs/default.yaml


def task_configs(cache_gb: float, quick: bool) -> dict[str, tuple[TaskConfig, dict]]:
    """Each task's cache settings and generator arguments: the default tasks, scaled to ``cache_gb``."""
    if quick:
        adv = {"n_samples": 40, "resolution": 64}
        darcy = {"n_samples": 40, "resolution": 16}
    else:
        budget = cache_gb * 1e9
        adv = {"n_samples": int(0.9 * budget / (201 * 256 * 4)), "resolution": 256}  # 201 frames at stride 1
        darcy = {"n_samples": int(0.1 * budget / (2 * 64 * 64 * 4)), "resolution": 64}
    return {
        "advection1d": (TaskConfig(pde="advection1d", initial_step=INITIAL_STEP), {**adv, "coefficient": 0.1}),
        "darcy2d": (TaskConfig(pde="darcy2d"), {**darcy, "coefficient": 1.0}),
    }


def prepare_sources(workdir: Path, tasks: dict[str, tuple[TaskConfig, dict]]) -> dict[str, Path]:
    """Generate each task's HDF5 file, reusing one made earlier with the same arguments (generation is seeded)."""
    sources = {}
    for name, (task, args) in tasks.items():
        path = workdir / "data" / f"{name}.h5"
        recipe = path.with_suffix(".json")
        wanted = {"pde": task.pde, **args, "seed": 0}
        if not (path.is_file() and recipe.is_file() and json.loads(recipe.read_text()) == wanted):
            generate(task.pde, path, **{k: v for k, v in wanted.items() if k != "pde"})
            recipe.write_text(json.dumps(wanted))
        sources[name] = path
    return sources


def evict(path: Path) -> None:
    """Drop a file's clean pages from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_read_seconds(path: Path) -> tuple[float, int]:
    """Every dataset of the file read front to back in READ_BLOCK_BYTES blocks; (seconds, bytes)."""
    start, total = time.perf_counter(), 0
    with h5py.File(path, "r") as f:
        for key in f:
            ds = f[key]
            if not isinstance(ds, h5py.Dataset) or ds.ndim < 2:
                continue  # coordinates
            step = max(1, READ_BLOCK_BYTES // max(1, ds[0].nbytes))
            for i in range(0, ds.shape[0], step):
                total += ds[i : i + step].nbytes
    return time.perf_counter() - start, total


def build_rates(workdir: Path, tasks: dict, sources: dict[str, Path], cold: bool = True) -> dict:
    """Cold-cache MB/s of a raw HDF5 read, of the source checksums and of the cache build proper (``cold=False``,
    for --quick: from the page cache as it is, without the flushes eviction takes, which wait on every other
    writer of the disk)."""
    drop = evict if cold else lambda path: None
    raw_s = raw_bytes = 0.0
    for path in sources.values():
        drop(path)
        seconds, nbytes = raw_read_seconds(path)
        raw_s, raw_bytes = raw_s + seconds, raw_bytes + nbytes
    root = workdir / "build-timing"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for path in sources.values():
        drop(path)
    start = time.perf_counter()
    memo = ChecksumMemo(root / CHECKSUMS)  # what a first build does before it can name its folder
    for path in sources.values():
        memo.checksum(path)
    memo.save()
    checksum_s = time.perf_counter() - start
    for path in sources.values():
        drop(path)
    start = time.perf_counter()
    for name, (task, _) in tasks.items():
        build_cache(name, task, sources[name], root)
    build_s = time.perf_counter() - start
    shutil.rmtree(root, ignore_errors=True)
    return {
        "page_cache": "cold" if cold else "warm (--quick: not evicted)",
        "source_bytes": int(raw_bytes),
        "raw_read_MBps": raw_bytes / raw_s / 1e6,
        "build_MBps": raw_bytes / build_s / 1e6,
        "checksum_MBps": raw_bytes / checksum_s / 1e6,
        "first_build_MBps": raw_bytes / (checksum_s + build_s) / 1e6,
    }


def warm(paths: list[Path]) -> None:
    """Read files once so loaders compare on a warm page cache, as after a training run's first epoch."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


class H5PerSample:
    """PDEBench's per-item loading: the file opened lazily in each worker, one h5py read per sample."""

    def __init__(self, info: CacheInfo, source: Path):
        self.source, self.autoregressive = source, info.autoregressive
        first, last = info.splits["train"]["samples"]
        self.first, self.n = first, last - first
        self.windows = info.n_frames - INITIAL_STEP if self.autoregressive else 1
        self.in_stats = (np.float32(info.input_mean[0]), np.float32(info.input_std[0]))
        self.out_stats = (np.float32(info.target_mean[0]), np.float32(info.target_std[0]))
        self.file = None

    def __len__(self) -> int:
        return self.n * self.windows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.file is None:
            self.file = h5py.File(self.source, "r")
        (mi, si), (mo, so) = self.in_stats, self.out_stats
        if self.autoregressive:
            sample, t = divmod(i, self.windows)
            window = (self.file["tensor"][self.first + sample, t : t + INITIAL_STEP + 1] - mi) / si
            window = torch.from_numpy(window[..., None])
            return {"x": window[:-1], "y": window[-1]}
        x = (self.file["nu"][self.first + i] - mi) / si
        y = (self.file["tensor"][self.first + i, 0] - mo) / so
        return {"x": torch.from_numpy(x[..., None]), "y": torch.from_numpy(y[..., None])}


class PreloadedShared:
    """Seed 000's PreloadedCacheDataset: the whole cache in tensors moved to shared memory, batches by indexing."""

    def __init__(self, info: CacheInfo):
        self.base = training_dataset(info, "train", INITIAL_STEP)
        parts = [""] if info.autoregressive else ["x", "y"]
        self.tensors = [torch.from_numpy(np.array(info.array("train", p))).share_memory_() for p in parts]
        if info.autoregressive:
            self.index = torch.from_numpy(np.array(self.base.arrays[1], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.base)

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices)
        if len(self.tensors) == 2:
            return {"x": self.tensors[0][idx], "y": self.tensors[1][idx]}
        sample, start = self.index[idx].T
        windows = self.tensors[0][sample[:, None], start[:, None] + torch.arange(INITIAL_STEP + 1)]
        return {"x": windows[:, :-1], "y": windows[:, -1]}


def fetch_rates(infos: dict, sources: dict, seconds: float = 2.0) -> dict:
    """Samples/s of the fetch alone, in one process with no DataLoader: what each design costs per sample."""
    rates = {}
    rng = np.random.default_rng(0)
    for name, info in infos.items():
        batch = BATCH[name]
        mapped, per_sample = training_dataset(info, "train", INITIAL_STEP), H5PerSample(info, sources[name])
        fetches = {
            "mmap": lambda ds=mapped, b=batch: ds.__getitems__(np.sort(rng.choice(len(ds), b, replace=False)).tolist()),
            "h5py": lambda ds=per_sample, b=batch: [ds[int(i)] for i in rng.integers(len(ds), size=b)],
        }
        for label, fetch in fetches.items():
            fetch()
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                fetch()
                n += batch
            rates[f"{label}/{name}"] = n / (time.perf_counter() - start)
    return rates


def _worker_ready(queue, baseline_taken, worker_id: int) -> None:
    queue.put(("worker", os.getpid()))
    baseline_taken.wait()  # the parent measures every process before any of them touches data


def _loaders(kind: str, infos: dict, sources: dict, rank: int, steps: int, queue, event) -> list[DataLoader]:
    loaders = []
    for stream, (name, info) in enumerate(infos.items()):
        common = {
            "num_workers": WORKERS,
            "persistent_workers": True,
            "worker_init_fn": partial(_worker_ready, queue, event),
        }
        if kind == "h5py":  # shuffled, as PDEBench's loaders; long enough for every step
            dataset = H5PerSample(info, sources[name])
            sampler = RandomSampler(
                dataset, num_samples=steps * BATCH[name], generator=torch.Generator().manual_seed(rank)
            )
            loaders.append(DataLoader(dataset, batch_size=BATCH[name], sampler=sampler, **common))
            continue
        dataset = training_dataset(info, "train", INITIAL_STEP) if kind == "mmap" else PreloadedShared(info)
        sampler = EqualBatchSampler(len(dataset), BATCH[name], steps, rank, RANKS, seed=0, stream=stream)
        loaders.append(DataLoader(dataset, batch_sampler=sampler, collate_fn=keep_batch, **common))
    return loaders


def _rank(rank: int, kind: str, infos: dict, sources: dict, steps: int, warmup: int, queue, events, barrier) -> None:
    # Workers forked, as a torchrun rank's are: a process started by spawn would spawn them too (each importing
    # torch again: most of a quick run's CPU time, and not what training does).
    mp.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    before = pss_bytes(os.getpid())
    loaders = _loaders(kind, infos, sources, rank, steps + warmup, queue, events[0])
    setup_cost = pss_bytes(os.getpid()) - before  # the preload of (c); nothing for lazily mapped datasets
    iterators = [iter(loader) for loader in loaders]  # starts the workers, which wait for the baseline
    queue.put(("rank", rank, os.getpid(), setup_cost))
    events[0].wait()
    for _ in range(warmup):
        [next(it) for it in iterators]
    barrier.wait()
    start, samples = time.perf_counter(), 0
    for _ in range(steps):
        samples += sum(len(next(it)["x"]) for it in iterators)
    elapsed = time.perf_counter() - start
    if kind == "mmap":  # map every page once, so the PSS below covers the whole cache, not what was sampled
        for info in infos.values():
            for part in [""] if info.autoregressive else ["x", "y"]:
                array = info.array("train", part)
                for i in range(0, len(array), 64):
                    float(array[i : i + 64].sum())
    queue.put(("done", rank, samples, elapsed))
    events[1].wait()
    del iterators, loaders


def _receive(queue, procs: list, timeout_s: float = 1800) -> tuple:
    """The next message of a rank or worker; fails at once when a rank died instead of waiting forever."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1)
        except Empty:
            dead = [f"rank {r} exited with {p.exitcode}" for r, p in enumerate(procs) if p.exitcode is not None]
            if dead:
                raise RuntimeError("benchmark process failed: " + ", ".join(dead)) from None
    raise TimeoutError(f"no message from the benchmark's ranks in {timeout_s:.0f} s")


def loader_run(kind: str, infos: dict, sources: dict, steps: int, warmup: int) -> dict:
    """Samples/s, /dev/shm peak and data memory of one loader design on RANKS ranks."""
    ctx = mp.get_context("spawn")
    queue, events, barrier = ctx.Queue(), (ctx.Event(), ctx.Event()), ctx.Barrier(RANKS)
    args = (kind, infos, sources, steps, warmup, queue, events, barrier)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(RANKS)]  # not daemons: they fork workers
    os.environ["OMP_NUM_THREADS"] = "1"
    with ShmPeak() as shm:
        for p in procs:
            p.start()
        try:
            ranks, workers, setup = {}, [], 0
            while len(ranks) < RANKS or len(workers) < RANKS * len(infos) * WORKERS:
                msg = _receive(queue, procs)
                if msg[0] == "worker":
                    workers.append(msg[1])
                else:
                    ranks[msg[1]] = msg[2]
                    setup += msg[3]
            pids = [*ranks.values(), *workers]
            baseline = sum(pss_bytes(p) for p in pids)
            events[0].set()
            done = [_receive(queue, procs) for _ in range(RANKS)]
            after = sum(pss_bytes(p) for p in pids)
            events[1].set()
            for p in procs:
                p.join(timeout=120)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
    samples = sum(d[2] for d in done)
    return {
        "samples_per_s": samples / max(d[3] for d in done),
        "samples_timed": samples,
        "shm_peak_bytes": shm.peak,
        "data_memory_bytes": setup + after - baseline,
        "processes": len(pids),
    }


def run(out: Path, workdir: Path, cache_gb: float, steps: int, h5py_steps: int, warmup: int, quick: bool) -> dict:
    tasks = task_configs(cache_gb, quick)
    sources = prepare_sources(workdir, tasks)
    build = build_rates(workdir, tasks, sources, cold=not quick)
    infos = {name: build_cache(name, task, sources[name], workdir / "cache") for name, (task, _) in tasks.items()}
    cache_bytes = sum(
        info.array("train", part).nbytes
        for info in infos.values()
        for part in ([""] if info.autoregressive else ["x", "y"])
    )
    batch_bytes = sum(
        4 * BATCH[n] * (INITIAL_STEP + 1 if i.autoregressive else 2) * int(np.prod(i.grid)) * i.in_channels
        for n, i in infos.items()
    )
    warm([*sources.values(), *(p for info in infos.values() for p in info.path.glob("*.npy"))])
    fetch = fetch_rates(infos, sources, seconds=0.2 if quick else 2.0)
    loaders = {"mmap": loader_run("mmap", infos, sources, steps, warmup)}
    loaders["h5py"] = loader_run("h5py", infos, sources, h5py_steps, warmup)
    if shm_size_bytes() - (64 << 20) > RANKS * cache_bytes * 1.1:
        loaders["shared"] = loader_run("shared", infos, sources, steps, warmup)
    else:
        loaders["shared"] = {"skipped": f"/dev/shm holds {shm_size_bytes() / 1e9:.1f} GB; needs {RANKS} x the cache"}
    # Per loader: prefetch_factor (2) batches per worker, plus the few the consuming loop still references.
    in_flight = RANKS * (WORKERS * 2 + 4) * batch_bytes
    a, b, c = loaders["mmap"], loaders["h5py"], loaders["shared"]
    targets = {
        "mmap >= 10x per-sample h5py": a["samples_per_s"] >= 10 * b["samples_per_s"],
        "mmap within 10% of shared memory or faster": "skipped" in c or a["samples_per_s"] >= 0.9 * c["samples_per_s"],
        "no cache bytes in /dev/shm (peak under the in-flight batch bound)": a["shm_peak_bytes"] <= in_flight,
        "data memory <= 1.2x cache": a["data_memory_bytes"] <= 1.2 * cache_bytes,
        "build >= 50% of raw read": build["build_MBps"] >= 0.5 * build["raw_read_MBps"],
    }
    result = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "setup": {
            "ranks": RANKS,
            "workers_per_loader": WORKERS,
            "tasks": {n: {**args, "batch_size": BATCH[n]} for n, (_, args) in tasks.items()},
            "steps": steps,
            "h5py_steps": h5py_steps,
        },
        "cache_bytes": cache_bytes,
        "in_flight_batch_bound_bytes": in_flight,
        "build": build,
        "fetch_samples_per_s": fetch,
        "loaders": loaders,
        "targets": targets,
    }
    save_result(out, "cache_io", result, markdown(result))
    return result


def markdown(r: dict) -> str:
    mb = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    rows = ["| loader | samples/s | /dev/shm peak | data memory | x cache |", "|---|---:|---:|---:|---:|"]
    names = {"mmap": "(a) mmap cache", "h5py": "(b) per-sample h5py", "shared": "(c) preloaded shared memory"}
    for key, label in names.items():
        x = r["loaders"][key]
        if "skipped" in x:
            rows.append(f"| {label} | skipped: {x['skipped']} | | | |")
            continue
        rows.append(
            f"| {label} | {x['samples_per_s']:,.0f} | {mb(x['shm_peak_bytes'])} | {mb(x['data_memory_bytes'])} "
            f"| {x['data_memory_bytes'] / r['cache_bytes']:.2f} |"
        )
    b = r["build"]
    lines = [
        f"Cache (train split, both tasks): {mb(r['cache_bytes'])}; {r['setup']['ranks']} ranks x "
        f"{r['setup']['workers_per_loader']} workers per task loader; {r['machine']['cpus']} CPUs, torch "
        f"{r['machine']['torch']}.",
        "",
        *rows,
        "",
        f"From a {b['page_cache']} page cache ({b['source_bytes'] / 1e9:.2f} GB of source data): raw HDF5 read "
        f"{b['raw_read_MBps']:,.0f} MB/s; cache build {b['build_MBps']:,.0f} MB/s; source checksums "
        f"{b['checksum_MBps']:,.0f} MB/s; a first build, checksums then build, {b['first_build_MBps']:,.0f} MB/s. "
        "Loaders ran on a warm page cache.",
        "",
        "Fetch alone, one process, no DataLoader (samples/s): "
        + ", ".join(f"{k} {v:,.0f}" for k, v in r["fetch_samples_per_s"].items())
        + ".",
        "",
        "| target | met |",
        "|---|---|",
        *(f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in r["targets"].items()),
    ]
    return "\n".join(lines) + "\n"
