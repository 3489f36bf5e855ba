"""A run continued on a new machine: its newest verified checkpoint, config and history fetched from the remote.

Only when the run folder holds no step checkpoint of its own (a local checkpoint is always at least as new as
what was mirrored from it). A checkpoint is used only when the bytes fetched have the SHA1 the pointer
recorded when it was verified after its upload; one that does not is reported and the next older verified one
is tried, so a corrupt remote file never becomes the starting point of a run.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from train import run_files
from train.atomic import atomic_path
from train.checkpoint import BEST, BEST_SHARDED, checkpoint_step, list_checkpoints, shards, unreadable
from train.config import Config, load_config, run_identity, training_differences
from train.errors import ConfigError, DataError
from train.remote.mirror import RUN_FILES
from train.remote.pointer import POINTER, belongs_to, read_pointer
from train.remote.store import Remote, sha1_of
from train.run_dir import RunDir

log = logging.getLogger(__name__)


def fetch_verified(remote: Remote, name: str, dest: Path, sha1: str | None) -> None:
    """``name`` into ``dest`` (atomically) when its bytes have SHA1 ``sha1`` (None: the remote's own, if known).
    A sharded checkpoint (``dest`` a ``.dcp`` name) is kept there packed as one file: it is unpacked into the
    folder ``dest`` once its files match their manifest."""
    if sha1 is None and (stat := remote.stat(name)) is not None:
        sha1 = stat.sha1
    packed = dest.suffix == shards.SUFFIX
    with atomic_path(dest.parent / f"{dest.name}.packed" if packed else dest) as tmp:
        remote.download(name, tmp)
        got = sha1_of(tmp)
        if sha1 is not None and got != sha1:
            raise DataError(f"{remote.url}/{name}: SHA1 {got}, but {sha1} was verified after its upload")
        if packed:
            shards.unpack(tmp, dest)
    if packed:
        (dest.parent / f"{dest.name}.packed").unlink(missing_ok=True)


def check_remote_config(cfg: Config, remote: Remote) -> None:
    """Refuse a remote that holds another run: a config that differs in what training depends on, or (its
    config.yaml lost or replaced) a pointer whose checkpoints are tagged with another run's identity. On every
    launch that mirrors, whatever train.resume says, since the mirror would replace its config and prune its
    checkpoints."""
    if remote.stat(run_files.CONFIG) is not None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / run_files.CONFIG
            fetch_verified(remote, run_files.CONFIG, path, None)
            try:
                theirs = load_config(path)
            except ConfigError as e:  # said of the remote's file, not of the temporary copy read here
                raise ConfigError(
                    str(e).replace(str(path), f"{remote.url}/{run_files.CONFIG}")
                    + f". Fix or delete {remote.url}/{run_files.CONFIG} (the run's config on its remote)"
                ) from None
        differences = training_differences(theirs, cfg)
        if differences:
            raise ConfigError(
                f"{remote.url} holds a run with a different config ({', '.join(differences)}); pick another run "
                f"name (RUN=... or --run) or another run.remote, or delete {remote.url} to start over"
            )
    pointer = read_pointer(remote)
    identity = run_identity(cfg)
    entries = [*(pointer or {}).get("kept", []), *([pointer["best"]] if (pointer or {}).get("best") else [])]
    foreign = sorted({str(e.get("run")) for e in entries if not belongs_to(e, identity)})
    if foreign:
        names = ", ".join(str(e.get("name")) for e in entries if not belongs_to(e, identity))
        raise ConfigError(
            f"{remote.url} holds checkpoints of another run ({names}, tagged {', '.join(foreign)}; this run is "
            f"{identity}){'' if remote.stat(run_files.CONFIG) else ' and no config.yaml'}: a launch would prune "
            "them. Nothing was changed; pick another run name (RUN=... or --run) or another run.remote, or delete "
            f"{remote.url} if that run is not needed"
        )


def newest_usable(run: RunDir) -> Path | None:
    """The run folder's newest step checkpoint that loads and matches its checksum (unusable ones are left
    where they are: a newer intact copy from the remote replaces one of the same name, the launch plan sets the
    others aside)."""
    return next((p for p in reversed(list_checkpoints(run.checkpoints)) if unreadable(p) is None), None)


def restore_run(cfg: Config, run: RunDir, remote: Remote) -> str | None:
    """Fetch the remote's newest good checkpoint when it is newer than any ``run`` holds (a new machine holds
    none; here, the newest may have been set aside as unreadable); returns its name (None: nothing fetched).
    The caller has checked that the remote holds this run (``check_remote_config``)."""
    local = newest_usable(run)
    pointer = read_pointer(remote)
    if local is None and (pointer is None or not pointer.get("kept")):
        log.info("remote: %s holds no checkpoint of this run yet; starting here", remote.url)
        return None
    identity, since = run_identity(cfg), checkpoint_step(local.name) if local is not None else -1
    # check_remote_config refused any other run's; a local checkpoint at least as new needs nothing fetched
    kept = [e for e in (pointer or {}).get("kept", []) if belongs_to(e, identity) and e.get("step", -1) > since]
    if not kept:
        if local is None:
            log.info("remote: %s holds no checkpoint of this run; starting here", remote.url)
        return None
    chosen = None
    for entry in kept:  # newest first
        name = entry.get("name", "")
        if (run.checkpoints / name).exists():
            log.warning("remote: %s here cannot be used; the remote's copy replaces it if it is intact", name)
        try:
            fetch_verified(remote, f"checkpoints/{name}", run.checkpoints / name, entry.get("sha1"))
            damaged = unreadable(run.checkpoints / name)
            if damaged is not None:  # the bytes the pointer names, but not the bytes that were saved
                shards.remove(run.checkpoints / name)
                raise DataError(f"{remote.url}/checkpoints/{name}: {damaged}")
        except DataError as e:
            log.error("remote: %s is not used (%s); trying the one before it", name, e)
            continue
        chosen = name
        break
    if chosen is None and local is not None:
        log.warning("remote: no newer checkpoint could be fetched intact; continuing from %s", local.name)
        return None
    if chosen is None:
        raise DataError(
            f"none of the {len(kept)} checkpoint(s) that {remote.url}/{POINTER} lists could be fetched "
            f"intact (see the errors above); delete {remote.url} to start the run over, or copy a good checkpoint "
            f"into {run.checkpoints}"
        )
    best = pointer.get("best")
    if best and belongs_to(best, identity):
        name = best.get("name") if best.get("name") in (BEST, BEST_SHARDED) else BEST
        try:
            fetch_verified(remote, f"checkpoints/{name}", run.checkpoints / name, best.get("sha1"))
            damaged = unreadable(run.checkpoints / name)
            if damaged is not None:
                shards.remove(run.checkpoints / name)
                raise DataError(f"{remote.url}/checkpoints/{name}: {damaged}")
        except DataError as e:
            log.warning("remote: %s is not used (%s); validation chooses a new best from here", name, e)
    for name in (run_files.METRICS, *RUN_FILES):
        if not (run.root / name).exists() and remote.stat(name) is not None:
            try:
                fetch_verified(remote, name, run.root / name, None)
            except DataError as e:
                log.warning("remote: %s not fetched (%s)", name, e)
    held = f"{local.name} was its newest intact one" if local is not None else "the run folder held no checkpoint"
    log.info("remote: resuming from %s, fetched from %s (%s)", chosen, remote.url, held)
    return chosen
