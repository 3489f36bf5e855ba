"""A rank's life under torchrun, the same for training (train.worker) and the smoke test (train.smoke_worker):
tie itself to its launcher, read its command line and the run folder, log to its own file, join the group, run
its work, leave cleanly, and end every failure with an exit code and an error file the launcher reads.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass

from train.config import Config
from train.disk import as_disk_full
from train.distributed.collectives import peer_lost
from train.distributed.env import DistEnv, destroy_distributed, init_distributed, rank_from_environ
from train.distributed.error_file import record_error
from train.distributed.lifeline import hold_for_launcher
from train.errors import DataError, DistributedError, TrainError
from train.heap import freeze_imported
from train.obs.log import setup_logging
from train.run_dir import LaunchRecord, RunDir, rank_arguments

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rank:
    """What a rank's work gets: its run folder, its node's launch record, its arguments, config and group."""

    run: RunDir
    launch: LaunchRecord | None
    args: argparse.Namespace
    cfg: Config
    env: DistEnv


def run_rank(
    prog: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    work: Callable[[Rank], None],
    argv: list[str] | None = None,
    before_joining: Callable[[RunDir], None] | None = None,
) -> int:
    """Start the rank, run ``work``, and return the rank's exit code. ``before_joining`` runs after logging is
    set up and before the process group is joined (a check that needs no peer)."""
    freeze_imported()  # the work's modules are imported by now (train.heap)
    run, launch, rest = rank_arguments(argv)
    if launch is not None:
        hold_for_launcher(launch.launcher_pid, launch.ranks_lock)
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    args = parser.parse_args(rest)
    cfg = run.load_config()
    rank = rank_from_environ()
    setup_logging(f"rank{rank}", run.rank_log(rank), console=rank == 0)
    try:
        if before_joining is not None:
            before_joining(run)
        env = DistEnv.from_environ(cfg.dist.backend, cfg.dist.backend_fallback)
        env = init_distributed(env, cfg.dist.timeout_s, cfg.dist.backend_fallback)
        work(Rank(run, launch, args, cfg, env))
        destroy_distributed(wait_for_peers=True)
    except TrainError as e:
        return _failed(e)
    except Exception as e:
        full = as_disk_full(e, run.root)  # a write anywhere (metrics, logs, the report) on a full disk
        if full is not None:
            return _failed(full)
        changed = run.changed_mapped_sources() if "bus error" in str(e).lower() else []
        if changed:  # a DataLoader worker's SIGBUS, which PyTorch blames on shared memory
            return _failed(DataError(f"a data file read through a memory map changed under it: {'; '.join(changed)}"))
        lost = peer_lost(e)
        if lost is not None:  # a consequence, not this rank's bug: the launcher names the node that went away
            return _failed(DistributedError(f"a peer rank went away during a collective ({lost})"))
        log.exception("unexpected error")  # the traceback in this rank's log file; @record writes the error file
        raise
    finally:
        destroy_distributed()
    return 0


def _failed(error: TrainError) -> int:
    log.error("%s", error)
    record_error(error)  # the launcher reads this file to name the failing rank's error in its summary
    return error.exit_code
