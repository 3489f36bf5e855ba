"""What runs beside the ranks during a launch, in the launcher: the remote mirror and the W&B run.

Both are told how the launch ended, from the launcher's point of view, which is the only one that knows it:
a rank killed by the kernel writes nothing, and a failure on one rank ends the others by signal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator

from train.config import Config, run_identity
from train.launch.stop import stop_signals_deferred
from train.launch.targets import topology_from_environ
from train.launch.topology import Topology
from train.obs.tracking import open_tracker, outcome_of
from train.remote.lease import RemoteLease
from train.remote.mirror import RunMirror
from train.remote.store import Remote
from train.run_dir import RunDir

log = logging.getLogger(__name__)


@contextlib.contextmanager
def watched_launch(
    cfg: Config,
    run: RunDir,
    remote: Remote | None,
    *,
    node_local: bool = False,
    lease: RemoteLease | None = None,
    start_over: bool = False,
    topology: Topology | None = None,
) -> Iterator[RunMirror | None]:
    """Mirror ``run`` to ``remote`` and track it in W&B (each when configured) while the block runs the ranks;
    yields the mirror (None without a remote), whose ``complete`` says afterwards whether the remote got all of
    the run. ``node_local``: this node (not node 0) keeps a run folder of its own, which holds only its ranks'
    logs worth mirroring. ``lease``: this launch's lease on the remote (node 0's). ``start_over``: the launch trains
    the run anew (train.resume=never), so the remote's earlier checkpoints are not this training's. ``topology``:
    where this node sits, as the launch session found it (default: asked of the launch target now)."""
    node_rank = (topology or topology_from_environ(os.environ, run.root.name)).node_rank
    mirror = None
    if remote is not None:  # first: a remote that cannot be reached fails the launch before W&B starts a run
        mirror = RunMirror(
            remote,
            run,
            cfg.train.keep_checkpoints,
            node_rank=node_rank,
            node_local=node_local,
            identity=run_identity(cfg),
            lease=lease,
            start_over=start_over,
        )
        mirror.start()
    try:
        tracker = open_tracker(cfg, run.root) if node_rank == 0 else None  # one W&B run, from the run's node
    except BaseException:
        if mirror is not None:
            mirror.finish(cfg.run.remote_wait_s)
        raise
    error: BaseException | None = None
    try:
        yield mirror
    except BaseException as e:
        error = e
        raise
    finally:
        outcome = outcome_of(error)
        with stop_signals_deferred() as arrived:  # the run is already ending: a second stop must not cut this
            if tracker is not None:
                tracker.finish(outcome, run.report, _preempted_at_step(run))
            if mirror is not None:
                mirror.complete = mirror.finish(cfg.run.remote_wait_s)
        if arrived:
            log.info("a stop request arrived while the launcher finished the remote copy; it ends now")


def _preempted_at_step(run: RunDir) -> int | None:
    """The step rank 0 recorded when it honoured a stop request, if it did."""
    try:
        return int(json.loads(run.preempted_marker.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
