"""A launch, from the launcher's first stage to its ranks' last exit: the run-folder lock, and across nodes the
launchers' meeting point. Used by every command that starts ranks (run, fit, evaluate, smoke)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from train.config import Config
from train.errors import StopRequested
from train.launch.node_barrier import NodeBarrier
from train.launch.run_lock import RunLock
from train.launch.topology import topology_from_environ
from train.run_dir import RunDir


@dataclass
class LaunchSession:
    barrier: NodeBarrier | None
    """None on one node."""

    @property
    def hosts_rendezvous(self) -> bool:
        """This launcher holds the rendezvous port itself (node 0 of several): the doctor must not test it."""
        return self.barrier is not None and self.barrier.hosting

    def between_stages(self) -> None:
        """End now when a stop was requested or another node already failed."""
        StopRequested.check()
        if self.barrier is not None:
            self.barrier.check_peers()

    def ready_to_launch(self) -> None:
        """Wait for every node to be ready to start its ranks (none starts after a stop request)."""
        StopRequested.check()
        if self.barrier is not None:
            self.barrier.wait_for_all()
        StopRequested.check()


@contextlib.contextmanager
def launch_session(cfg: Config, run: RunDir) -> Iterator[LaunchSession]:
    topology = topology_from_environ(os.environ, cfg.run.name or run.root.name)
    with RunLock(run, topology.node_rank):
        if not topology.multi_node:
            yield LaunchSession(None)
            return
        with NodeBarrier(topology, cfg.dist.timeout_s) as barrier:
            yield LaunchSession(barrier)
