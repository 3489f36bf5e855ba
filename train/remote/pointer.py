"""The remote's pointer ``checkpoints/latest.json``: the checkpoints the remote holds of this run, newest first,
each with the size and SHA1 verified after its upload and the run identity it was written by, and best.pt.
A mirror writes it only after the checkpoint it names is verified there; a restore trusts nothing else."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from train import run_files
from train.checkpoint import BEST, checkpoint_step
from train.errors import DataError
from train.remote.store import Remote

log = logging.getLogger(__name__)

POINTER = run_files.POINTER


_SAID: set[tuple] = set()
"""The rebuilt pointers this process has warned of."""


def read_pointer(remote: Remote) -> dict | None:
    """The remote's checkpoint pointer, or None when it has none (a new run). An unreadable one is rebuilt from
    the checkpoints the remote lists: taken for "no checkpoint yet", it would let a new launch train from step 0
    and its first mirrored checkpoint prune the remote's intact ones."""
    stat = remote.stat(POINTER)
    if stat is None:
        return None
    staging = Path(os.environ.get("TMPDIR", "/tmp"))
    tmp = staging / f".latest.{os.getpid()}.{threading.get_ident()}.json"
    try:
        remote.download(POINTER, tmp)
        pointer = json.loads(tmp.read_text())
    except (OSError, ValueError) as e:
        return rebuilt_pointer(remote, f"{type(e).__name__}: {e}", stat.sha1)
    finally:
        tmp.unlink(missing_ok=True)
    ok = isinstance(pointer, dict) and isinstance(pointer.get("kept"), list)
    ok = ok and all(isinstance(e, dict) and checkpoint_step(str(e.get("name"))) is not None for e in pointer["kept"])
    return pointer if ok else rebuilt_pointer(remote, "not a pointer: no list of kept checkpoints", stat.sha1)


def rebuilt_pointer(remote: Remote, why: str, version: str | None = None) -> dict:
    """A pointer made from the step checkpoints (and best.pt) the remote lists, newest first, each with the size
    and SHA1 the remote holds (B2 checked that SHA1 on upload; a folder's is read from its bytes). Those SHA1s
    vouch for nothing (they are of whatever bytes lie there): the pointer says why it was rebuilt under
    ``rebuilt``, a restore checks each checkpoint's payload against the checksum written into it, and a mirror
    writes a pointer of the intact ones back (:meth:`RunMirror.repair_pointer`). None listed: DataError, the
    launch stops (exit 3) and deletes nothing. ``version``: the unreadable file's SHA1 (it is warned of once)."""
    names = [n.rsplit("/", 1)[-1] for n in remote.names("checkpoints")]
    steps = sorted((s, n) for n in names if (s := checkpoint_step(n)) is not None)
    kept = []
    for step, name in reversed(steps):
        stat = remote.stat(f"checkpoints/{name}")
        if stat is not None and stat.sha1:
            kept.append({"name": name, "step": step, "size": stat.size, "sha1": stat.sha1, "unverified": True})
    if not kept:
        raise DataError(
            f"remote: {remote.url}/{POINTER} cannot be read ({why}) and the remote lists no checkpoint to rebuild it "
            f"from. Nothing was changed; if the run there is to start over, delete {remote.url}/{POINTER}"
        )
    best = remote.stat(f"checkpoints/{BEST}") if BEST in names else None
    said = (remote.url, version, why, kept[0]["name"])
    if said not in _SAID:  # a launch reads the pointer several times (config check, restore, mirror): said once
        _SAID.add(said)
        log.warning(
            "remote: %s/%s cannot be read (%s); rebuilt from the %d checkpoint(s) the remote lists (newest %s)",
            remote.url,
            POINTER,
            why,
            len(kept),
            kept[0]["name"],
        )
    best_entry = None
    if best is not None and best.sha1:
        best_entry = {"name": BEST, "size": best.size, "sha1": best.sha1, "unverified": True}
    return {"checkpoint": kept[0]["name"], "kept": kept, "best": best_entry, "rebuilt": why}


def belongs_to(entry: dict, identity: str | None) -> bool:
    """Whether a pointer entry is a checkpoint of the run ``identity`` (entries written before the pointer
    carried identities count as the run's: the remote's config was checked against this run)."""
    return identity is None or entry.get("run") in (None, identity)


def newest_of_run(pointer: dict | None, identity: str | None) -> dict | None:
    """The newest step checkpoint the pointer lists of the run ``identity`` (None: it lists none)."""
    ours = [e for e in (pointer or {}).get("kept", []) if belongs_to(e, identity) and isinstance(e.get("step"), int)]
    return max(ours, key=lambda e: e["step"], default=None)


def remote_ahead(pointer: dict | None, identity: str | None, local: Path | None) -> dict | None:
    """The pointer's newest checkpoint of this run when it is newer than ``local`` (the run folder's newest step
    checkpoint, None: it holds none): a folder behind its remote must never be mirrored over it, since that would
    move the pointer back and prune the newer checkpoints. None when the remote is not ahead."""
    newest = newest_of_run(pointer, identity)
    since = checkpoint_step(local.name) if local is not None else None
    if newest is None or (since is not None and since >= newest["step"]):
        return None
    return newest
