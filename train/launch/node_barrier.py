"""Multi-node launches: the launchers meet before torchrun does, so one node's failure ends every node at once.

Node 0's launcher hosts the c10d store at RDZV_ENDPOINT for its whole launch, from before its doctor until the
last torchrun restart is over; torchrun's agents on every node, node 0's included, join that store as clients
(``is_host=false``). The port the doctor checks is therefore the port the store holds, and a second launcher
on the same host (two "nodes" on one machine) can never bind it first.

Before torchrun starts, every node posts how its own stages ended (doctor, data, cache) and waits for the
others; between stages each node looks whether another has failed. A node that failed, or node 0's launcher
going away, ends all nodes within seconds with the node and the endpoint named, instead of each waiting
dist.timeout_s in torchrun's rendezvous. (A peer that has not yet connected when node 0 gives up after
LINGER_S cannot learn anything, and waits dist.timeout_s for a node 0 that never comes.)
"""

from __future__ import annotations

import datetime
import logging
import socket
import time

from train.errors import DistributedError, PreflightError, StopRequested
from train.launch.topology import Topology

log = logging.getLogger(__name__)

POLL_S = 0.5
# How long node 0 stays up after its own stages failed, so that peers still busy with theirs read why.
LINGER_S = 30
_KEY = "train/launch/node{}"
_SEEN = "train/launch/failure-seen"
OK = "ok"


class NodeBarrier:
    """A context manager: node 0 hosts the store, the others connect; ``wait_for_all`` is the meeting point."""

    def __init__(self, topology: Topology, timeout_s: int):
        assert topology.multi_node, "one node has no one to meet"
        self.topology = topology
        self.timeout_s = timeout_s
        self.endpoint = topology.endpoint
        self._store = None
        self._posted = False

    @property
    def hosting(self) -> bool:
        return self.topology.node_rank == 0

    def __enter__(self) -> NodeBarrier:
        import torch.distributed as dist

        host, port = self.topology.host_port
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.hosting:
            try:
                self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
            except RuntimeError as e:
                raise PreflightError(
                    f"node 0 cannot host the rendezvous at {self.endpoint}: port {port} is already in use on this "
                    f"node ({e}). Stop what holds it (ss -ltnp 'sport = :{port}') or pick another port in "
                    "RDZV_ENDPOINT, the same on every node"
                ) from None
            log.info("hosting the rendezvous of %d nodes at %s", self.topology.nnodes, self.endpoint)
        else:
            self._wait_until_listening(host, port)
            try:
                # Connected already: a short timeout bounds only a port held by something that is no store.
                short = datetime.timedelta(seconds=min(self.timeout_s, 30))
                self._store = dist.TCPStore(host, port, is_master=False, timeout=short)
            except RuntimeError as e:
                raise self._lost(e) from None
        return self

    def _wait_until_listening(self, host: str, port: int) -> None:
        """Poll with plain sockets: the store's own connect retries in C++, deaf to SIGTERM/SIGUSR1 for its whole
        timeout, and logs a stack trace for every attempt."""
        log.info("node %d: waiting for node 0's launcher at %s", self.topology.node_rank, self.endpoint)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                socket.create_connection((host, port), timeout=POLL_S).close()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise DistributedError(
                        f"node 0's launcher never opened the rendezvous at {self.endpoint} within dist.timeout_s="
                        f"{self.timeout_s}s ({e}): start the same command with NODE_RANK=0 and the same RDZV_ENDPOINT "
                        "and RDZV_ID, and check that its host resolves and its port is reachable from this node"
                    ) from None
            time.sleep(POLL_S)

    def _lost(self, error: Exception) -> DistributedError:
        return DistributedError(
            f"lost node 0's launcher at {self.endpoint} before the launch ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}): it failed or was stopped, and its output says why"
        )

    def _outcome(self, node: int) -> str | None:
        key = _KEY.format(node)
        try:
            return self._store.get(key).decode() if self._store.check([key]) else None
        except RuntimeError as e:
            raise self._lost(e) from None

    def check_peers(self) -> None:
        """Between stages: end now if another node has already failed (non-blocking)."""
        for node in range(self.topology.nnodes):
            if node != self.topology.node_rank:
                outcome = self._outcome(node)
                if outcome not in (None, OK):
                    self._store.add(_SEEN, 1)
                    raise DistributedError(
                        f"node {node} failed before the launch, so this node stops too (rendezvous at "
                        f"{self.endpoint}): {outcome}"
                    )

    def _post(self, outcome: str) -> None:
        self._posted = True
        self._store.set(_KEY.format(self.topology.node_rank), outcome)

    def wait_for_all(self) -> None:
        """Post this node's success and wait until every node has posted its own, or one has failed."""
        try:
            self._post(OK)
        except RuntimeError as e:
            raise self._lost(e) from None
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.check_peers()
            missing = [n for n in range(self.topology.nnodes) if self._outcome(n) is None]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"node(s) {', '.join(map(str, missing))} never reached the launch at {self.endpoint} within "
                    f"dist.timeout_s={self.timeout_s}s: start the same command on all {self.topology.nnodes} nodes "
                    f"(NNODES, NODE_RANK=0..{self.topology.nnodes - 1}, the same RDZV_ENDPOINT and RDZV_ID)"
                )
            time.sleep(POLL_S)

    def _linger(self) -> None:
        """Node 0 failed before the launch: keep the store up until every peer has read the failure (peers look
        between their stages), for at most LINGER_S; a peer that reads nothing sees the lost connection."""
        deadline = time.monotonic() + min(self.timeout_s, LINGER_S)
        while self._store.add(_SEEN, 0) < self.topology.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not self._posted and self._store is not None:
            try:
                self._post(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
                if self.hosting and not isinstance(exc, StopRequested):  # a stop must not be delayed
                    self._linger()
            except RuntimeError:
                pass  # node 0 is gone already: the others learn it from the lost connection
        self._store = None  # node 0: closes the store, and with it every peer's connection
