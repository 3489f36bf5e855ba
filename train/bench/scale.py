"""Data at PDEBench's published size, larger than memory: `make bench BENCH_ARGS=scale`.

Writes two files in PDEBench's layout: 1D advection, 10,000 x 201 x 1024 float32 (8.2 GB, the exact solution,
written block by block by the package's generator), and 2D compressible CFD at 128^2 with 4 fields: PDEBench
publishes 10,000 samples x 21 frames (55 GB); ``--cfd-fraction`` (default 0.1: 1,000 samples, 5.5 GB, so 13.7
GB of source in all) sets the share written. The CFD fields are an exact solution of the Euler equations
(train.data.acquire.generate_cfd): a density pattern carried by a uniform flow at constant pressure, each sample
with its own velocity, pressure and pattern. Then, from a cold page cache for the files involved
(``posix_fadvise(DONTNEED)`` on each, nothing machine-wide), it measures:

- the raw sequential read of each source against its cache build (``python -m train cache`` in the 4 GB
  cgroup, a process of its own so its peak RSS is the launcher's): advection and CFD read whole, which maps
  them in place (the build reads them, checksum and scan, and copies nothing), and advection with PDEBench's
  strides (spatial 4, temporal 5), which writes a copy of the strided subset;
- each cache's disk footprint against the data the run uses;
- one launch, ``python -m train run`` of the default FNO on both tasks, 2 ranks with 2 DataLoader workers each,
  the whole launch inside a 4 GB memory cgroup: exit status, OOM kills, and the peak RSS and PSS of every
  process;
- the loader alone (a null model: batches fetched and dropped) in samples/s and GB/s per core, against the
  samples/s the FNO consumes per core in that launch, and per GPU as `make gpu-check` measured it.

Targets (``--strict``): no OOM kill under 4 GB with 13 GB of source; the build's RSS under 1 GB; an in-place
build at least 70% of the raw read of the bytes it reads, a copying one at least 45%; a cache at most 1.05x the
data its run uses (none for an in-place one); the loader at least 10x what the FNO consumes per core.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from train.bench import cgroup, machine_figures, save_result
from train.bench.cache_io import evict, raw_read_seconds
from train.data.acquire.generate import generate
from train.data.acquire.generate_cfd import cfd_fields, write_cfd
from train.disk import free_bytes, human
from train.errors import TrainError
from train.obs.procmem import child_pids, pss_bytes

REPO = Path(__file__).resolve().parents[2]
ADVECTION = (10_000, 201, 1024)
CFD = (10_000, 21, 128, 128)
CFD_FIELDS = cfd_fields(2)
LIMIT = 4 << 30
# make gpu-check on one H200 (torch 2.11, CUDA 13.0): the default FNO on this advection file, mapped in place,
# batch 64, took 2,863 samples/s with 23% of the time waiting for data (runs/gpu-check/speed.json).
GPU_SAMPLES_PER_S = 2863.0
GPU_DATA_WAIT = 0.23
TARGETS = {"build_rss_gb": 1.0, "in_place_ratio": 0.70, "copy_ratio": 0.45, "footprint": 1.05, "loader_margin": 10.0}


def _peak_rss(group: cgroup.MemoryCgroup, argv: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run ``argv`` inside ``group``; its wall time and its peak RSS (VmHWM, read until it exits)."""
    start = time.perf_counter()
    proc = group.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    peak = 0
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stderr.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak = max(peak, int(status.split("VmHWM:")[1].split()[0]) * 1024)
        except (OSError, IndexError):
            pass
        time.sleep(0.05)
    reader.join()
    wall = time.perf_counter() - start
    return subprocess.CompletedProcess(argv, proc.returncode, proc.stdout.read(), "".join(out)), wall, peak


def _config(path: Path, tasks: dict, steps: int = 200) -> Path:
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    config["tasks"] = tasks
    config["train"].update(epochs=1, steps_per_epoch=steps, num_workers=2, log_every=min(20, steps // 2))
    path.write_text(yaml.safe_dump(config))
    return path


def _tasks(adv: Path, cfd: Path, strided: bool = False) -> dict:
    small = {"val_fraction": 0.002, "test_fraction": 0.002}  # 20 advection samples each: evaluation stays short
    advection = {"pde": "advection1d", "source": str(adv), "initial_step": 10, "batch_size": 32, **small}
    if strided:  # PDEBench's own 1D baseline: 1024 -> 256 points, 201 -> 41 frames
        advection.update(spatial_stride=4, temporal_stride=5)
    cfd2d = {"pde": "cfd2d", "source": str(cfd), "initial_step": 10, "batch_size": 4, **small}
    return {"advection1d": advection} if strided else {"advection1d": advection, "cfd2d": cfd2d}


def _cache_dirs(root: Path, name: str) -> list[Path]:
    return [p for p in (root / name).iterdir() if p.is_dir() and not p.name.startswith(".")]


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(workdir: Path, label: str, tasks: dict, sources: list[Path]) -> dict:
    """One cache build from a cold page cache: wall time, bytes read, peak RSS, footprint per task."""
    cache = workdir / f"cache-{label}"
    shutil.rmtree(cache, ignore_errors=True)
    config = _config(workdir / f"{label}.yaml", tasks)
    for source in sources:
        evict(source)
    argv = [sys.executable, "-m", "train", "cache", "--config", str(config), f"--set=run.cache_dir={cache}"]
    with cgroup.MemoryCgroup(LIMIT, "train-scale-build") as group:
        proc, wall, peak = _peak_rss(group, [*argv, f"--set=run.runs_dir={workdir / 'runs'}"], cwd=REPO)
    if proc.returncode or group.oom_kills:
        raise TrainError(f"the {label} cache build failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    # The stage's own time, from its log: checksums and builds (the process's start-up and preflight excluded).
    found = re.findall(r"checksummed [\d.]+ GB of source in ([\d.]+) s|built .* in ([\d.]+) s", proc.stderr)
    stage = sum(float(a or b) for a, b in found)
    read = 0
    per_task = {}
    for name in tasks:
        (folder,) = _cache_dirs(cache, name)
        manifest = json.loads((folder / "manifest.json").read_text())
        source = Path(tasks[name]["source"])
        used = _used_bytes(manifest)
        footprint = _folder_bytes(folder)
        # A checksum pass over the whole file, then the scan (in place) or the strided read (a copy): both whole.
        read += 2 * source.stat().st_size
        per_task[name] = {"in_place": bool(manifest.get("in_place")), "cache_bytes": footprint, "used_bytes": used}
    return {
        "wall_s": wall,
        "stage_s": stage,
        "bytes_read": read,
        "gb_s": read / stage / 1e9,
        "peak_rss": peak,
        "tasks": per_task,
        "oom_kills": group.oom_kills,
    }


def _used_bytes(manifest: dict) -> int:
    """The bytes of data the run reads: every split's samples, strided, all channels."""
    n = sum(manifest["sizes"].values())
    frames = manifest["n_frames"] if manifest["autoregressive"] else 1
    return 4 * n * frames * int(np.prod(manifest["grid"])) * (manifest["in_channels"] - manifest["const_channels"])


class ProcessPeaks:
    """Peak RSS and PSS of every process under a launcher, sampled every 200 ms."""

    def __init__(self, pid: int):
        self.pid, self.peaks = pid, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            for pid, depth in _descendants(self.pid):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    rss = int(status.split("VmRSS:")[1].split()[0]) * 1024
                    role = _role(Path(f"/proc/{pid}/cmdline").read_bytes(), depth)
                    pss = pss_bytes(pid)
                except (OSError, IndexError, ValueError):
                    continue
                old = self.peaks.get(pid, {"role": role, "rss": 0, "pss": 0})
                self.peaks[pid] = {"role": role, "rss": max(old["rss"], rss), "pss": max(old["pss"], pss)}

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.peaks


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, depth below ``pid``) of the process and everything under it."""
    found, todo = [], [(pid, 0)]
    while todo:
        current, depth = todo.pop()
        found.append((current, depth))
        try:
            todo += [(child, depth + 1) for child in child_pids(current)]
        except OSError:  # ended meanwhile
            continue
    return found


def _role(cmdline: bytes, depth: int) -> str:
    """The launcher (torchrun's agent runs in it), its ranks, and their DataLoader workers (forked: a rank's
    command line, one level further down)."""
    if depth == 0:
        return "launcher"
    return "rank" if depth == 1 and b"train.worker" in cmdline else "worker" if depth == 2 else "other"


def launch(workdir: Path, adv: Path, cfd: Path, steps: int = 200) -> dict:
    """The default FNO on both tasks, 2 ranks x 2 workers, the whole launch inside a 4 GB memory cgroup."""
    config = _config(workdir / "launch.yaml", _tasks(adv, cfd), steps)
    runs = workdir / "runs"
    shutil.rmtree(runs / "scale", ignore_errors=True)
    for source in (adv, cfd):
        evict(source)
    argv = [sys.executable, "-m", "train", "run", "--config", str(config), "--nproc", "2", "--run", "scale"]
    folders = [f"--set=run.cache_dir={workdir / 'cache-in_place'}", f"--set=run.runs_dir={runs}"]
    start = time.perf_counter()
    with cgroup.MemoryCgroup(LIMIT, "train-scale") as group:
        proc = group.popen([*argv, *folders], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peaks = ProcessPeaks(proc.pid)
        err = proc.communicate()[1]
        by_pid = peaks.stop()
    wall = time.perf_counter() - start
    metrics = [json.loads(x) for x in (runs / "scale" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in metrics if "samples_per_s" in r][1:]  # the first window holds start-up
    return {
        "exit": proc.returncode,
        "oom_kills": group.oom_kills,
        "cgroup_peak": group.peak_bytes,
        "wall_s": wall,
        "processes": sorted(by_pid.values(), key=lambda p: (p["role"] != "launcher", p["role"], -p["rss"])),
        "samples_per_s": sum(r["samples_per_s"] for r in steps) / max(1, len(steps)),
        "data_wait": sum(r["data_wait"] for r in steps) / max(1, len(steps)),
        "stderr": err[-2000:] if proc.returncode else "",
    }


def loader_rate(workdir: Path, seconds: float = 20.0) -> dict:
    """The advection cache (in place) through a DataLoader with 2 workers and no model: samples/s per core."""
    from torch.utils.data import DataLoader

    from train.data.cache.info import CacheInfo
    from train.data.dataset import EqualBatchSampler, WindowDataset, keep_batch

    (folder,) = _cache_dirs(workdir / "cache-in_place", "advection1d")
    info = CacheInfo.load(folder)
    dataset = WindowDataset(info, "train", 10)
    sampler = EqualBatchSampler(len(dataset), 32, 100_000, 0, 1, 0, 0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=keep_batch, num_workers=2)
    samples = nbytes = 0
    start = None
    for i, batch in enumerate(loader):
        if i == 20:
            start = time.perf_counter()  # workers started and warm
        elif start is not None:
            samples += len(batch["x"])
            nbytes += sum(t.numel() * t.element_size() for t in batch.values())
            if time.perf_counter() - start > seconds:
                break
    elapsed = time.perf_counter() - start
    del loader
    return {"samples_per_s_per_core": samples / elapsed / 2, "gb_s_per_core": nbytes / elapsed / 2 / 1e9}


def run(out: Path, workdir: Path, quick: bool = False, cfd_fraction: float = 0.1) -> dict:
    reason = cgroup.why_not()
    if reason is not None:
        raise TrainError(f"the scale benchmark runs its launch in a memory cgroup, and none can be made: {reason}")
    load_before = os.getloadavg()[0]
    workdir.mkdir(parents=True, exist_ok=True)
    n_adv = 200 if quick else ADVECTION[0]  # quick: 0.16 GB and 0.11 GB, 10 steps: the plumbing, not the figures
    n_cfd = 20 if quick else max(100, int(CFD[0] * cfd_fraction))
    adv_bytes = 4 * n_adv * ADVECTION[1] * ADVECTION[2]
    cfd_bytes = 4 * n_cfd * int(np.prod(CFD[1:])) * len(CFD_FIELDS)
    need = adv_bytes + cfd_bytes + adv_bytes // 20 + (1 << 30)
    free = free_bytes(workdir) or 0
    print(f"scale: needs about {human(need)} under {workdir} ({human(free)} free)", flush=True)
    if free < need:
        raise TrainError(
            f"{workdir}: {human(free)} free, the scale benchmark needs about {human(need)}; free disk "
            "or pass a smaller --cfd-fraction to write a smaller share of the CFD file"
        )
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    adv = data / f"1D_Advection_Sols_beta0.1_n{n_adv}.hdf5"
    cfd = data / f"2D_CFD_periodic_n{n_cfd}_Train.hdf5"
    started = time.perf_counter()
    if not adv.is_file():
        generate("advection1d", adv, n_samples=n_adv, resolution=ADVECTION[2], coefficient=0.1, seed=0)
    if not cfd.is_file():
        write_cfd(cfd, n_cfd, CFD[1], CFD[2:])
    written_s = time.perf_counter() - started
    raw = {}
    for name, path in (("advection1d", adv), ("cfd2d", cfd)):
        evict(path)
        seconds, nbytes = raw_read_seconds(path)
        raw[name] = nbytes / seconds / 1e9
    in_place = build(workdir, "in_place", _tasks(adv, cfd), [adv, cfd])
    copy = build(workdir, "copy", _tasks(adv, cfd, strided=True), [adv])
    raw_both = (adv_bytes + cfd_bytes) / (adv_bytes / raw["advection1d"] + cfd_bytes / raw["cfd2d"])
    launched = launch(workdir, adv, cfd, 10 if quick else 200)
    loader = loader_rate(workdir, 2.0 if quick else 20.0)
    fno_per_core = launched["samples_per_s"] / 2
    result = {
        "files": {"advection1d": [n_adv, *ADVECTION[1:]], "cfd2d": [n_cfd, *CFD[1:], len(CFD_FIELDS)]},
        "source_gb": (adv_bytes + cfd_bytes) / 1e9,
        "written_s": written_s,
        "raw_read_gb_s": raw,
        "raw_read_both_gb_s": raw_both,
        "in_place": in_place,
        "copy": copy,
        "in_place_ratio": in_place["gb_s"] / raw_both,
        "copy_ratio": copy["gb_s"] / raw["advection1d"],
        "launch": launched,
        "loader": loader,
        "fno_samples_per_s_per_core": fno_per_core,
        "gpu_samples_per_s": GPU_SAMPLES_PER_S / (1 - GPU_DATA_WAIT),
        "machine": machine_figures(load_before),
    }
    footprints = [t["cache_bytes"] / t["used_bytes"] for b in (in_place, copy) for t in b["tasks"].values()]
    result["targets"] = {
        "no OOM kill under 4 GB": launched["exit"] == 0
        and launched["oom_kills"] + in_place["oom_kills"] + copy["oom_kills"] == 0,
        "build RSS under 1 GB": max(in_place["peak_rss"], copy["peak_rss"]) < TARGETS["build_rss_gb"] * 1e9,
        "in-place build at least 70% of the raw read": result["in_place_ratio"] >= TARGETS["in_place_ratio"],
        "copying build at least 45% of the raw read": result["copy_ratio"] >= TARGETS["copy_ratio"],
        "cache at most 1.05x the data used": max(footprints) <= TARGETS["footprint"],
        "no copy when the run reads a dataset whole": all(t["in_place"] for t in in_place["tasks"].values())
        and all(t["cache_bytes"] < 0.01 * t["used_bytes"] for t in in_place["tasks"].values()),
        "loader at least 10x what the FNO consumes per core": loader["samples_per_s_per_core"]
        >= TARGETS["loader_margin"] * fno_per_core,
    }
    save_result(out, "scale", result, markdown(result))
    return result


def markdown(r: dict) -> str:
    gb = 1e9
    mib = 2**20
    launched, load = r["launch"], r["machine"]["load_average_1min"]
    rows = [f"| {p['role']} | {p['rss'] / mib:,.0f} | {p['pss'] / mib:,.0f} |" for p in launched["processes"]]
    builds = []
    for label, b, ratio in (("in place", r["in_place"], r["in_place_ratio"]), ("copy", r["copy"], r["copy_ratio"])):
        for name, t in b["tasks"].items():
            builds.append(
                f"| {name} ({label}) | {b['gb_s']:.2f} | {ratio:.0%} | {t['cache_bytes'] / gb:.3f} | "
                f"{t['cache_bytes'] / t['used_bytes']:.3f} | {b['peak_rss'] / mib:,.0f} |"
            )
    return "\n".join(
        [
            f"# Data at published size: {r['source_gb']:.1f} GB of source ({r['machine']['cpus']} CPUs, load "
            f"{load['before']:.1f} before, {load['after']:.1f} after)",
            "",
            f"Raw sequential read, cold: advection {r['raw_read_gb_s']['advection1d']:.2f} GB/s, CFD "
            f"{r['raw_read_gb_s']['cfd2d']:.2f} GB/s.",
            "",
            "| cache | stage GB/s read | of raw read | cache GB | cache / data used | build peak RSS MiB |",
            "|---|---:|---:|---:|---:|---:|",
            *builds,
            "",
            f"Launch (default FNO, both tasks, 2 ranks x 2 workers) inside a 4 GB memory cgroup: exit "
            f"{launched['exit']}, {launched['oom_kills']} OOM kill(s), cgroup peak {launched['cgroup_peak'] / mib:,.0f}"
            f" MiB (page cache included), {launched['wall_s']:.0f} s, {launched['samples_per_s']:.0f} samples/s, "
            f"data wait {launched['data_wait']:.0%}.",
            "",
            "| process | peak RSS MiB | peak PSS MiB |",
            "|---|---:|---:|",
            *rows,
            "",
            f"Loader alone (null model, 2 workers): {r['loader']['samples_per_s_per_core']:,.0f} samples/s and "
            f"{r['loader']['gb_s_per_core']:.2f} GB/s per core; the FNO consumes "
            f"{r['fno_samples_per_s_per_core']:,.0f} samples/s per core here, and about "
            f"{r['gpu_samples_per_s']:,.0f} samples/s on one H200 (make gpu-check: {GPU_SAMPLES_PER_S:,.0f} "
            f"samples/s measured with {GPU_DATA_WAIT:.0%} data wait, scaled to none).",
            "",
            *[f"- {'PASS' if ok else 'MISS'} {name}" for name, ok in r["targets"].items()],
            "",
        ]
    )
