"""A launch, from the launcher's first stage to its ranks' last exit: the run-folder lock, and across nodes the
launchers' meeting point, their shared plan and their shared outcome. Used by every command that starts ranks
(run, fit, evaluate, smoke)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from train.config import Config
from train.errors import DistributedError, Preempted, StopRequested, TrainError
from train.launch.node_barrier import NodeBarrier
from train.launch.plan import LaunchPlan, Outcome
from train.launch.run_lock import RunLock
from train.launch.targets import topology_from_environ
from train.launch.topology import Topology
from train.run_dir import RunDir

log = logging.getLogger(__name__)


class NodeOutcome(TrainError):
    """Another node ends as node 0's launch ended: with its exit code and its message."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.exit_code = code


@dataclass
class LaunchSession:
    barrier: NodeBarrier | None
    """None on one node."""
    cfg: Config
    topology: Topology
    """Where this node sits, asked of the launch target once (train.launch.targets) and passed on."""

    @property
    def hosts_rendezvous(self) -> bool:
        """This launcher holds the rendezvous port itself (node 0 of several): the doctor must not test it."""
        return self.barrier is not None and self.barrier.hosting

    @property
    def leads(self) -> bool:
        """This launcher decides the launch: one node, or node 0 of several."""
        return self.barrier is None or self.barrier.hosting

    @property
    def address(self) -> str | None:
        """The address this node advertises to its peers (None on one node), once ready."""
        return self.barrier.address if self.barrier is not None else None

    def between_stages(self) -> None:
        """End now when a stop was requested or another node already failed."""
        StopRequested.check()
        if self.barrier is not None:
            self.barrier.check_peers()

    def ready_to_launch(self, plan: LaunchPlan | None = None) -> LaunchPlan | None:
        """Wait for every node to be ready to start its ranks (none starts after a stop request). Node 0 (or the
        only node) passes its ``plan``; every node gets back the plan node 0 decided."""
        StopRequested.check()
        if self.barrier is not None:
            plan = self.barrier.wait_for_all(plan)
        StopRequested.check()
        return plan

    def conclude(self, error: TrainError | None) -> None:
        """After the ranks: every node ends as node 0 did. Node 0 names a peer that vanished while the ranks ran
        and posts its outcome; the others raise node 0's (or return on its success)."""
        if self.barrier is None:
            if error is not None:
                raise error
            return
        dist = self.cfg.dist
        if self.barrier.hosting:
            silent = []
            if error is not None and not isinstance(error, Preempted):
                silent = self.barrier.silent_peers()
                if silent:
                    first = " ".join(line.strip() for line in str(error).splitlines()[:2])
                    error = DistributedError(
                        f"node(s) {', '.join(map(str, silent))} stopped answering while the ranks ran (the launcher "
                        "was killed, or the machine or its network went away), so the ranks here lost their peers "
                        f"({first}). Re-run the same command on every node: the run resumes from the newest "
                        "checkpoint"
                    )
            code = 0 if error is None else error.exit_code
            outcome = Outcome(code, str(error or ""))
            self.barrier.post_outcome(outcome, linger_s=dist.shutdown_timeout_s + 60, gone=len(silent))
            if error is not None:
                raise error
            return
        try:
            outcome = self.barrier.read_outcome(self.cfg.run.remote_wait_s + dist.shutdown_timeout_s + 60)
        except DistributedError as lost:
            if error is not None:
                raise DistributedError(f"{lost}; this node's ranks ended with: {error}") from None
            raise
        if outcome.code == 0:
            if error is not None:
                log.warning("this node's ranks ended with an error, but node 0's launch succeeded: %s", error)
            return
        if outcome.code == Preempted.exit_code:
            raise Preempted(f"node 0: {outcome.message}")
        raise NodeOutcome(outcome.code, f"node 0's launch failed (exit {outcome.code}): {outcome.message}")


@contextlib.contextmanager
def launch_session(cfg: Config, run: RunDir) -> Iterator[LaunchSession]:
    topology = topology_from_environ(os.environ, cfg.run.name or run.root.name)
    with RunLock(run, topology.node_rank):
        if not topology.multi_node:
            yield LaunchSession(None, cfg, topology)
            return
        with NodeBarrier(topology, cfg.dist.timeout_s) as barrier:
            yield LaunchSession(barrier, cfg, topology)
