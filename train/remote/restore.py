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
from train.checkpoint import BEST, list_checkpoints
from train.config import Config, load_config, run_identity, training_differences
from train.errors import ConfigError, DataError
from train.remote.mirror import POINTER, RUN_FILES, belongs_to, read_pointer
from train.remote.store import Remote, sha1_of
from train.run_dir import RunDir

log = logging.getLogger(__name__)


def fetch_verified(remote: Remote, name: str, dest: Path, sha1: str | None) -> None:
    """``name`` into ``dest`` (atomically) when its bytes have SHA1 ``sha1`` (None: the remote's own, if known)."""
    if sha1 is None and (stat := remote.stat(name)) is not None:
        sha1 = stat.sha1
    with atomic_path(dest) as tmp:
        remote.download(name, tmp)
        got = sha1_of(tmp)
        if sha1 is not None and got != sha1:
            raise DataError(f"{remote.url}/{name}: SHA1 {got}, but {sha1} was verified after its upload")


def check_remote_config(cfg: Config, remote: Remote) -> None:
    """Refuse a remote that holds another run (a config that differs in what training depends on): on every launch
    that mirrors, whatever train.resume says, since the mirror would replace its config and prune its checkpoints."""
    if remote.stat(run_files.CONFIG) is None:
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / run_files.CONFIG
        fetch_verified(remote, run_files.CONFIG, path, None)
        differences = training_differences(load_config(path), cfg)
    if differences:
        raise ConfigError(
            f"{remote.url} holds a run with a different config ({', '.join(differences)}); pick another run name "
            f"(RUN=... or --run) or another run.remote, or delete {remote.url} to start over"
        )


def restore_run(cfg: Config, run: RunDir, remote: Remote) -> str | None:
    """Fetch the remote's newest good checkpoint when ``run`` has none; returns its name (None: nothing fetched).
    The caller has checked that the remote holds this run (``check_remote_config``)."""
    if list_checkpoints(run.checkpoints):
        return None
    pointer = read_pointer(remote)
    if pointer is None or not pointer.get("kept"):
        log.info("remote: %s holds no checkpoint of this run yet; starting here", remote.url)
        return None
    identity = run_identity(cfg)
    foreign = [e.get("name") for e in pointer["kept"] if not belongs_to(e, identity)]
    if foreign:
        log.warning("remote: %s lists checkpoints of another run (%s); they are not used", remote.url,
                    ", ".join(map(str, foreign)))  # fmt: skip
    kept = [e for e in pointer["kept"] if belongs_to(e, identity)]
    if not kept:
        log.info("remote: %s holds no checkpoint of this run; starting here", remote.url)
        return None
    chosen = None
    for entry in kept:  # newest first
        name = entry.get("name", "")
        try:
            fetch_verified(remote, f"checkpoints/{name}", run.checkpoints / name, entry.get("sha1"))
        except DataError as e:
            log.error("remote: %s is not used (%s); trying the one before it", name, e)
            continue
        chosen = name
        break
    if chosen is None:
        raise DataError(
            f"none of the {len(kept)} checkpoint(s) that {remote.url}/{POINTER} lists could be fetched "
            f"intact (see the errors above); delete {remote.url} to start the run over, or copy a good checkpoint "
            f"into {run.checkpoints}"
        )
    best = pointer.get("best")
    if best and belongs_to(best, identity):
        try:
            fetch_verified(remote, f"checkpoints/{BEST}", run.checkpoints / BEST, best.get("sha1"))
        except DataError as e:
            log.warning("remote: best.pt is not used (%s); validation chooses a new best from here", e)
    for name in (run_files.METRICS, *RUN_FILES):
        if not (run.root / name).exists() and remote.stat(name) is not None:
            try:
                fetch_verified(remote, name, run.root / name, None)
            except DataError as e:
                log.warning("remote: %s not fetched (%s)", name, e)
    log.info("remote: resuming from %s, fetched from %s (the run folder held no checkpoint)", chosen, remote.url)
    return chosen
