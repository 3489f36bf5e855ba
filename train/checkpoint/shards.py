"""Sharded checkpoints: a folder ``step_NNNNNNNN.dcp`` (or ``best.dcp``) in which every rank wrote its own shards
of a sharded model's weights and optimizer state with torch.distributed.checkpoint (DCP), beside rank 0's
``components.pt`` (every other component: progress, schedule, scaler, config, specs, task cards, data
checksums) and ``manifest.json`` (every file of the folder with its size and xxh3-128 checksum).

Atomic as a file checkpoint is: the ranks write into ``.<name>.partial``; rank 0 renames it to its final name
only once every rank's shards, the components and the manifest are on disk (DCP fsyncs its files, rank 0 the
rest). A killed writer leaves the partial folder, which no checkpoint pattern matches and the next save
removes. Replacing an existing folder (best.dcp) moves the old one to ``.<name>.old`` first and deletes it after
the new one is in place; a crash in between leaves that old one, which :func:`recover_replaced` puts back.

A sharded model under the same strategy loads its own shards (:func:`load_shards`; DCP reshards them when the
world size changed). Every other reader (another strategy, one process, Surrogate, predict, export,
init_from, evaluation) gets the whole state in the plain checkpoint's form (:func:`consolidated`), and
``python -m train consolidate`` writes it as one ``.pt`` file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from train import hashing
from train.atomic import fsync_dir
from train.checkpoint.integrity import INTEGRITY, sealed, state_bytes, tampered
from train.disk import free_bytes, full_message
from train.errors import ConfigError, DataError, DiskFullError, DistributedError

SUFFIX = ".dcp"
MANIFEST = "manifest.json"
COMPONENTS = "components.pt"
_CHUNK = 1 << 22


def is_sharded_checkpoint(path: Path) -> bool:
    return path.suffix == SUFFIX and path.is_dir()


def file_digest(path: Path) -> dict[str, Any]:
    """A shard's manifest entry: its size and xxh3-128."""
    return {"bytes": path.stat().st_size, **hashing.file_digest(path, "xxh3_128")}


def save_shards(
    final: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, components: dict | None, rank: int
) -> None:
    """Every rank calls: its shards of ``model`` and ``optimizer`` written into ``final`` (a folder), rank 0's
    ``components`` (the checkpoint's other components, sealed as a file checkpoint is) beside them. A failure on
    any rank (a full disk) raises on every rank and leaves nothing under ``final``; what ``final`` held before
    stays."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    partial = final.parent / f".{final.name}.partial"
    if rank == 0:  # one writer per run (the run lock): every partial folder here is a killed writer's leftover
        for leftover in final.parent.glob(f".*{SUFFIX}.partial"):
            shutil.rmtree(leftover, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial, thread_count=1))
        own = {p.name: file_digest(p) for p in sorted(partial.glob(f"__{rank}_*"))}
        failed = None
    except (Exception, CheckpointException) as e:  # on every rank when any rank's write failed (a BaseException)
        own, failed = {}, e
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, own if failed is None else repr(failed))
    if failed is not None or any(isinstance(d, str) for d in digests):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        raise _write_error(failed, partial, digests, folder_bytes(state, len(digests)))
    error: BaseException | None = None
    if rank == 0:
        try:
            _seal_folder(partial, final, components, digests)
        except Exception as e:  # told to every rank below, so that none waits for a folder that never comes
            shutil.rmtree(partial, ignore_errors=True)
            error = e
    told = [repr(error) if error is not None else None]
    dist.broadcast_object_list(told, src=0)
    if error is not None:
        raise error
    if told[0] is not None:
        raise DistributedError(f"rank 0 could not finish the sharded checkpoint {final}: {told[0]:.800}")


def _seal_folder(partial: Path, final: Path, components: dict | None, digests: list[dict]) -> None:
    with open(partial / COMPONENTS, "wb") as f:
        torch.save(sealed(components or {}), f)
        f.flush()
        os.fsync(f.fileno())
    files = {name: d for per_rank in digests for name, d in per_rank.items()}
    absent = sorted(name for name in files if not (partial / name).is_file())
    if absent:  # ranks on other nodes wrote into folders of their own
        raise ConfigError(
            f"dist.checkpoint=sharded: the shards {', '.join(absent[:4])} written by other ranks are not in "
            f"{final.parent} on rank 0's node; a sharded checkpoint needs one folder every rank writes into (a "
            "shared file system). Use dist.checkpoint=auto (one file where the nodes keep run folders of their own) "
            "or full"
        )
    for path in partial.iterdir():  # .metadata, components.pt, and any file a rank did not name
        if path.name not in files and path.name != MANIFEST:
            files[path.name] = file_digest(path)
    manifest = {"format": "dcp", "ranks": len(digests), "files": dict(sorted(files.items()))}
    with open(partial / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(partial)
    replace_folder(partial, final)


def replace_folder(source: Path, final: Path) -> None:
    """Rename ``source`` to ``final``; an existing ``final`` is moved to ``.<name>.old`` first, deleted after."""
    old = final.parent / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(source, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_replaced(folder: Path) -> list[Path]:
    """Put back each ``.<name>.old`` whose replacement never arrived (a crash between the two renames)."""
    restored = []
    for old in folder.glob(f".*{SUFFIX}.old") if folder.is_dir() else ():
        final = folder / old.name[1 : -len(".old")]
        if not final.exists():
            os.rename(old, final)
            restored.append(final)
    return restored


ITEM_BYTES = 2048
"""What DCP writes per tensor beside its bytes, measured with torch 2.13: each shard is a torch.save of its own
(about 1.6 KiB of zip records) plus its entry in .metadata (about 0.2 KiB)."""
COMPONENT_BYTES = 64 << 10
"""components.pt (config, specs, task cards, progress) and manifest.json, at most as written for the built-ins."""


def folder_bytes(state: Any, ranks: int) -> int:
    """About what a sharded checkpoint of ``state`` (the model's and optimizer's state dicts, DTensors at their
    full size) takes on disk, written by ``ranks`` ranks: the tensors' bytes, and every rank's shard of every
    tensor at ITEM_BYTES. For a model of many small tensors the per-shard cost is most of it."""

    def tensors(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, dict):
            return sum(tensors(v) for v in value.values())
        if isinstance(value, list | tuple):
            return sum(tensors(v) for v in value)
        return 0

    return state_bytes(state) + tensors(state) * ranks * ITEM_BYTES + COMPONENT_BYTES


def _write_error(failed: BaseException | None, partial: Path, digests: list, needed: int) -> BaseException:
    """The error every rank raises for a failed sharded write: a DiskFullError when a rank's disk filled."""
    reasons = [d for d in digests if isinstance(d, str)]
    full = _enospc(failed) or any("No space left" in r or "ENOSPC" in r for r in reasons)
    final = partial.parent / partial.name[1 : -len(".partial")]
    if full:
        free = free_bytes(final.parent)
        return DiskFullError(full_message(final, free, needed), final, free, needed)
    if isinstance(failed, Exception):
        return failed
    if failed is not None:  # DCP's CheckpointException is a BaseException: made an ordinary error of the rank
        return RuntimeError(f"sharded checkpoint {final}: writing the shards failed ({failed!r:.800})")
    return DataError(f"sharded checkpoint {final}: a rank's write failed ({'; '.join(reasons)[:800]})")


def _enospc(error: BaseException | None) -> bool:
    """Whether ``error`` (DCP's CheckpointException holds each rank's failure) comes from a full disk."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


def load_shards(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank calls: its shards of the weights and optimizer state read from ``path`` (resharded by DCP
    when the world size differs from the one that wrote them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    except CheckpointException as e:  # a BaseException: keys of another model, as an ordinary error
        raise RuntimeError(f"the shards in {path} do not load into this model: {e!r:.800}") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def components(path: Path) -> dict[str, Any]:
    """The components rank 0 wrote beside the shards (everything but the weights and optimizer state)."""
    return torch.load(path / COMPONENTS, map_location="cpu", weights_only=True)


def consolidated(path: Path) -> dict[str, Any]:
    """The whole checkpoint in a file checkpoint's form: the full weights, the optimizer state indexed by
    parameter position (as ``Optimizer.state_dict`` writes it), and the other components. Read in this process
    alone (no collective): any reader, any world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # The empty planner fills ``state`` with whatever the metadata names, whole: what dcp_to_torch_save does.
    state: dict[str, Any] = {}
    reader, planner = dcp.FileSystemReader(path), _EmptyStateDictLoadPlanner()
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    optimizer = state.get("optimizer", {})
    names = [name for group in optimizer.get("param_groups", []) for name in group["params"]]
    rest = {k: v for k, v in components(path).items() if k != INTEGRITY}  # it sealed the components alone
    return {**rest, "model": state.get("model", {}), "optimizer": by_position(optimizer, names)}


def damaged(path: Path) -> str | None:
    """Why the folder ``path`` is not an intact sharded checkpoint (a file missing, of another size or content
    than its manifest says, its components' own checksum failing), or None when it is."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read ({type(e).__name__}: {e})"
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want["bytes"]:
            return f"{name} holds {file.stat().st_size} bytes, {want['bytes']} were written"
        got = file_digest(file)["xxh3_128"]
        if got != want["xxh3_128"]:
            return f"{name} hashes to {got}, but {want['xxh3_128']} was written"
    try:
        return tampered(components(path))
    except Exception as e:  # any unreadable components file
        return f"{COMPONENTS}: {type(e).__name__}: {e}"


def pack(folder: Path, dest: Path) -> None:
    """The folder's files as one uncompressed tar at ``dest``, the same bytes for the same files (sorted, no
    times, owners or modes): how the remote mirror sends and keeps a sharded checkpoint, as one unit."""
    import tarfile

    with tarfile.open(dest, "w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(folder.iterdir()):
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
            with open(path, "rb") as f:
                tar.addfile(info, f)


def unpack(packed: Path, final: Path) -> None:
    """A checkpoint :func:`pack` made, unpacked as the folder ``final`` once its files match their manifest (an
    existing ``final`` is replaced); nothing is left under ``final``'s name otherwise."""
    import tarfile

    partial = final.parent / f".{final.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with tarfile.open(packed) as tar:
            for member in tar.getmembers():
                if not member.isfile() or member.name != Path(member.name).name or member.name in ("", ".", ".."):
                    raise DataError(f"{packed}: {member.name!r} is no file of a sharded checkpoint")
                source = tar.extractfile(member)
                assert source is not None, "a regular member has its bytes"
                with source, open(partial / member.name, "wb") as out:
                    shutil.copyfileobj(source, out, _CHUNK)
                    out.flush()
                    os.fsync(out.fileno())
        why = damaged(partial)
        if why is not None:
            raise DataError(f"{packed} does not hold an intact sharded checkpoint: {why}")
        fsync_dir(partial)
        replace_folder(partial, final)
    except tarfile.TarError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise DataError(f"{packed} is no packed sharded checkpoint ({e})") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def content_file(path: Path) -> Path:
    """The file whose bytes stand for a checkpoint's content (to hash it, or to see that it changed): a file
    checkpoint itself, or a sharded checkpoint's manifest, written last and naming every file's checksum."""
    return path / MANIFEST if is_sharded_checkpoint(path) else path


def by_position(optimizer: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (DCP's, FSDP2's) keyed by position in ``names`` instead, as
    ``Optimizer.state_dict`` writes it: the one form every strategy loads."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in optimizer.get("state", {}).items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer.get("param_groups", [])],
    }


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
