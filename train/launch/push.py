"""Bring a run's remote up to date outside training: after a launch whose remote fell behind (unreachable,
read-only or full for a while), and on every launch that finds nothing left to train or evaluate."""

from __future__ import annotations

import logging

from train.checkpoint import latest_checkpoint
from train.config import Config, run_identity
from train.errors import ConfigError, PreflightError
from train.launch.run_lock import RunLock
from train.remote.lease import RemoteLease
from train.remote.mirror import RunMirror
from train.remote.pointer import read_pointer, remote_ahead
from train.remote.restore import check_remote_config
from train.remote.store import Remote, open_remote
from train.run_dir import RunDir

log = logging.getLogger(__name__)


def catch_up(cfg: Config, run: RunDir, remote: Remote, lease: RemoteLease | None = None) -> bool:
    """Mirror whatever of ``run`` the remote lacks (its newest checkpoint, best.pt, metrics, report, logs),
    waiting up to run.remote_wait_s; True when the remote holds it all (what is missing is logged)."""
    mirror = RunMirror(remote, run, cfg.train.keep_checkpoints, identity=run_identity(cfg), lease=lease)
    return mirror.start().finish(cfg.run.remote_wait_s)


def push_run(cfg: Config, b2_api=None) -> None:
    """``python -m train push``: the run folder to run.remote now; PreflightError (exit 4) when not all of it
    got there."""
    if not cfg.run.remote:
        raise ConfigError("push needs run.remote (b2://bucket/prefix or a folder): --set run.remote=...")
    run = RunDir.of(cfg)
    if not run.config.is_file():
        raise ConfigError(f"{run.root} holds no run (no config.yaml): check --run and run.runs_dir")
    remote = open_remote(cfg.run.remote, run.root.name, b2_api, run.root)
    check_remote_config(cfg, remote)
    newest = latest_checkpoint(run.checkpoints)
    ahead = remote_ahead(read_pointer(remote), run_identity(cfg), newest)
    if ahead is not None:  # another box went on with the run: pushing this folder would rewind the remote
        raise PreflightError(
            f"push: {remote.url} holds {ahead['name']} of this run, newer than {run.root}'s newest "
            f"({newest.name if newest is not None else 'no checkpoint'}); pushing would move the remote back and "
            "delete its newer checkpoints. Nothing was changed. To go on from the remote's step, run the same config "
            "with `python -m train run` (make train), which fetches it; to keep this folder's work apart, push it "
            "under another run name (--run) or to another run.remote"
        )
    # A launch of the run mirrors it itself: push waits for no one (exit 4 while the run is in use, here or on
    # another box holding the remote's lease).
    with RunLock(run), RemoteLease(remote, cfg.run.remote_lease_s) as lease:
        complete = catch_up(cfg, run, remote, lease)
    if not complete:
        raise PreflightError(
            f"remote: {remote.url} does not hold all of {run.root} (the warnings above say what is missing); run "
            "the same command again once the remote is reachable and has room"
        )
    log.info("push: %s holds %s", remote.url, run.root)
