"""What a launch takes from the machine: /dev/shm for worker queues and NCCL, disk for checkpoints and caches.

Plain arithmetic over the config and the caches, so the doctor can compare it with what is free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from train.config import Config
from train.data.acquire.generate import file_bytes
from train.data.acquire.sources import generated_path
from train.data.cache import in_place
from train.data.cache.build import window_span
from train.data.cache.info import CacheInfo
from train.data.dataset import target_frames
from train.data.formats import format_of
from train.data.stream.stage import disk_need
from train.disk import human
from train.model.builtin import MODELS, parameter_count
from train.model.specs import TaskSpec
from train.pdes import LAYOUTS
from train.stores import is_local, local_path
from train.strategies import STRATEGIES

MiB = 1 << 20
NCCL_BUFFSIZE = 4 * MiB  # NCCL's default per-channel buffer (NCCL_BUFFSIZE)
NCCL_SHM_SLACK = 64 * MiB  # NCCL's proxy and bootstrap segments


def sample_bytes(info: CacheInfo, initial_step: int) -> int:
    """Bytes of one training item (inputs and target, float32) as DataLoader workers ship it."""
    points = 1
    for n in info.grid:
        points *= n
    frames = initial_step if info.autoregressive else 1
    return 4 * points * (frames * info.in_channels + info.out_channels)


def shm_need(cfg: Config, nproc: int, caches: Mapping[str, CacheInfo | None], backend: str) -> tuple[int | None, str]:
    """Bytes of /dev/shm this node needs: worker queues (each worker keeps 2 batches in flight, plus a few
    in the loader's reorder buffer) and NCCL's shared-memory transport between local ranks."""
    workers = cfg.train.num_workers
    loaders = 0
    for name, info in caches.items():
        if workers and info is None:
            return None, f"task {name} has no cache yet to size its batches"
        if workers and info is not None:
            batch = cfg.tasks[name].batch_size * sample_bytes(info, cfg.tasks[name].initial_step)
            loaders += nproc * (workers * 2 + 4) * batch
    nccl = 0
    if backend == "nccl" and nproc > 1:
        buffsize = int(os.environ.get("NCCL_BUFFSIZE", NCCL_BUFFSIZE))
        nccl = nproc * (nproc - 1) * 2 * buffsize + NCCL_SHM_SLACK
    return loaders + nccl, f"{human(loaders)} worker queues ({nproc} x {workers} workers) + {human(nccl)} NCCL"


def device_data_need(cfg: Config, caches: Mapping[str, CacheInfo | None]) -> int | None:
    """Bytes one rank's device holds with train.data_on_device: every task's training arrays (float32) and its
    window index (int64); None while a task has no cache yet."""
    total = 0
    for name, info in caches.items():
        if info is None:
            return None
        if not info.autoregressive:
            total += info.array("train", "x").nbytes + info.array("train", "y").nbytes
            continue
        task = cfg.tasks[name]
        total += info.array("train").nbytes + (info.array("train", "const").nbytes if info.const_channels else 0)
        span = window_span(task.initial_step, target_frames(cfg.train), task.window_stride)
        total += 16 * info.sizes["train"] * max(0, info.n_frames - span + 1)
    return total


def _existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (where it would be created)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


ASSUMED_POINTS = 128
"""Grid points per axis assumed for a task whose data is not read yet (not generated here); only the
transformer's position embeddings and the FNO's mode limit depend on it."""


def assumed_specs(cfg: Config) -> dict[str, TaskSpec]:
    """Each task's shapes as far as the config tells before any data is read: a generated task's grid is its
    resolution, any other's ASSUMED_POINTS per axis (rounded up to its patch size)."""
    specs = {}
    for name, task in cfg.tasks.items():
        layout = LAYOUTS[task.pde]
        dims = layout.spatial_dims or 2  # a Well dataset's dimensions are in its files: assume 2D
        points = task.resolution if task.source == "generate" else ASSUMED_POINTS
        n = -(-len(range(0, points, task.spatial_stride)) // task.patch_size) * task.patch_size
        c_in, c_out = format_of(task.pde).assumed_channels(layout)
        specs[name] = TaskSpec((n,) * dims, c_in, c_out, task.patch_size, task.initial_step, layout.autoregressive)
    return specs


def parameter_estimate(cfg: Config) -> int:
    """The model's parameter count before any data is read, built on the meta device from :func:`assumed_specs`;
    0 for a factory of your own, whose size nothing tells before it is built."""
    if cfg.model.name not in MODELS:
        return 0
    return parameter_count(assumed_specs(cfg), cfg.model)


STATE_BYTES_PER_PARAMETER = 16
"""fp32 weights, gradients and AdamW's two moments: what training holds per parameter besides activations."""


def model_state_per_rank(cfg: Config, world_size: int, local_ranks: int) -> tuple[int, int]:
    """(bytes of model state one rank holds under dist.parallel, the same under ddp) before any data is read;
    (0, 0) for a factory of your own."""
    whole = parameter_estimate(cfg) * STATE_BYTES_PER_PARAMETER
    group = cfg.dist.shard_group_size or local_ranks
    return int(whole * STRATEGIES[cfg.dist.parallel].state_share(world_size, group)), whole


def checkpoint_bytes(cfg: Config) -> int:
    """A checkpoint's size: the weights plus AdamW's two moments, in float32."""
    return parameter_estimate(cfg) * 4 * 3


def cache_bytes(task, source: Path | None, size: int) -> int:
    """About what a task's missing cache will take on disk: nothing where it maps its source in place
    (train.data.cache.in_place, as its format says: a PDEBench file read whole from plain float32 storage, which
    generated files are), else the strided share of the source. ``source`` None: a PDEBench file still to generate
    (mapped), or a folder of files, which could be known to map only once they are read (counted as copied)."""
    layout, fmt = LAYOUTS[task.pde], format_of(task.pde)
    whole = task.spatial_stride == 1 and (not layout.autoregressive or task.temporal_stride == 1)
    if fmt.in_place and whole and (source is not None or fmt.whole_file):
        if source is None or not source.is_file():
            return 0
        keys = layout.targets if layout.autoregressive else layout.inputs + layout.targets
        try:
            if in_place.locate(source, tuple(dict.fromkeys(keys)), task) is not None:
                return 0
        except (OSError, KeyError):  # not readable as that layout: the data check says why
            pass
    shrink = task.spatial_stride**layout.spatial_dims * (task.temporal_stride if layout.autoregressive else 1)
    return size // shrink


def needs_by_filesystem(cfg: Config, caches: Mapping[str, CacheInfo | None]) -> list[tuple[Path, int, list[str]]]:
    """(an existing folder on it, bytes needed, what needs them) per filesystem: checkpoints kept plus one being
    written, each missing source file to generate, each missing cache (train.launch.capacity.cache_bytes), and
    each streamed task's node cache (its limit) and val and test files."""
    needs = {Path(cfg.run.runs_dir): (cfg.train.keep_checkpoints + 1) * checkpoint_bytes(cfg)}
    cache_need = data_need = 0
    for name, task in cfg.tasks.items():
        if cfg.streamed(name):  # the node cache's limit, not the dataset
            cache_need += disk_need(cfg, name)
            continue
        if caches.get(name) is None:
            one_file = format_of(task.pde).whole_file  # PDEBench: the dataset may be one file
            if one_file and task.source == "generate":
                source = generated_path(Path(cfg.run.data_dir), name, task)
                generated = file_bytes(task.pde, task.n_samples, task.resolution)
                size = source.stat().st_size if source.is_file() else generated
                data_need += 0 if source.is_file() else generated
            elif one_file:
                source = local_path(task.source)
                size = source.stat().st_size if source.is_file() else 0
            else:  # a folder of files (a generated demo's is small); a remote one is sized after its download
                source = None
                where = Path(cfg.run.data_dir) / name if task.location == "generate" else local_path(task.location)
                files = [where] if where.is_file() else where.rglob("*") if is_local(task.location) else []
                size = sum(p.stat().st_size for p in files if p.is_file())
            cache_need += cache_bytes(task, source, size)
    needs[Path(cfg.run.cache_dir)] = cache_need
    needs[Path(cfg.run.data_dir)] = needs.get(Path(cfg.run.data_dir), 0) + data_need
    by_device: dict[int, tuple[Path, int, list[str]]] = {}
    for folder, need in needs.items():
        root = _existing(folder)
        _, total, folders = by_device.get(root.stat().st_dev, (root, 0, []))
        by_device[root.stat().st_dev] = (root, total + need, [*folders, f"{folder} {human(need)}"])
    return list(by_device.values())


def find_caches(cfg: Config) -> dict[str, CacheInfo | None]:
    """The newest complete cache of each task, if any (its grid sizes the /dev/shm need)."""
    found: dict[str, CacheInfo | None] = {}
    for name in cfg.tasks:
        folder = Path(cfg.run.cache_dir) / name
        infos = [i for p in folder.iterdir() if p.is_dir() and (i := CacheInfo.load(p))] if folder.is_dir() else []
        found[name] = max(infos, key=lambda i: i.path.stat().st_mtime, default=None)
    return found
