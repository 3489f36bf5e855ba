"""Multi-node launches: the launchers meet before torchrun does, agree on one plan, and end with one outcome.

Node 0's launcher hosts the c10d store at RDZV_ENDPOINT for its whole launch, from before its doctor until the
last torchrun restart is over; torchrun's agents on every node, node 0's included, join that store as clients
(``is_host=false``). The port the doctor checks is therefore the port the store holds, and a second launcher
on the same host (two "nodes" on one machine) can never bind it first.

Before torchrun starts, every node posts the address it advertises (each node then connects to every other's,
so an address a peer cannot reach fails here, naming it, not in a collective's timeout) and how its own stages
ended (doctor, data, cache), and waits for the others; between stages each node looks whether another has
failed. Node 0 posts the launch plan (train.launch.plan) that the others follow. When the ranks are done, node
0 posts its outcome and every node ends with node 0's exit code; while the ranks run, the other launchers beat
a heart in the store, so a node that vanishes is named by node 0 instead of showing up as a peer's "connection
reset". (A peer that has not yet connected when node 0 gives up after LINGER_S cannot learn anything, and
waits dist.timeout_s for a node 0 that never comes.)
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time

from train.errors import DistributedError, PreflightError, StopRequested
from train.launch.address import advertised_address, is_public
from train.launch.plan import OUTCOME_KEY, PLAN_KEY, LaunchPlan, Outcome
from train.launch.topology import Topology

log = logging.getLogger(__name__)

POLL_S = 0.5
# How long node 0 stays up after its own stages failed, so that peers still busy with theirs read why.
LINGER_S = 30
HEARTBEAT_S = 1.0
# A peer whose heart did not beat for this long while node 0 looked is gone (its launcher died, or its machine).
SILENT_S = 4 * HEARTBEAT_S
REPORT_EVERY_S = 15
_KEY = "train/launch/node{}"
_ADDRESS = "train/launch/address/node{}"
_ALIVE = "train/launch/alive/node{}"
_SEEN = "train/launch/failure-seen"
_OUTCOME_SEEN = "train/launch/outcome-seen"
OK = "ok"


class NodeBarrier:
    """A context manager: node 0 hosts the store, the others connect; ``wait_for_all`` is the meeting point and
    ``conclude`` the end."""

    def __init__(self, topology: Topology, timeout_s: int):
        assert topology.multi_node, "one node has no one to meet"
        self.topology = topology
        self.timeout_s = timeout_s
        self.endpoint = topology.endpoint
        self.address: str | None = None
        """The address this node advertises to its peers (known once ``wait_for_all`` began)."""
        self._store = None
        self._posted = False
        self._probe: socket.socket | None = None
        self._heart: threading.Event | None = None

    @property
    def hosting(self) -> bool:
        return self.topology.node_rank == 0

    def _connect(self, timeout_s: float):
        import torch.distributed as dist

        host, port = self.topology.host_port
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

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
            self._store = self._connect_bounded(min(self.timeout_s, 30))
        return self

    def _connect_bounded(self, timeout_s: float):
        """The store's client, within ``timeout_s`` even when the port is held by a program that accepts the
        connection and never answers (the store's own timeout does not cover its handshake)."""
        result: dict = {}

        def connect() -> None:
            try:
                result["store"] = self._connect(timeout_s)
            except RuntimeError as e:
                result["error"] = e

        thread = threading.Thread(target=connect, name="rendezvous-connect", daemon=True)
        thread.start()
        thread.join(timeout_s + 5)
        if thread.is_alive():  # left blocked: a daemon thread, gone with the process
            raise DistributedError(
                f"{self.endpoint} accepts connections but never answered as a rendezvous store within "
                f"{timeout_s + 5:.0f} s: another program holds that port on node 0's host (ss -ltnp there), or "
                "RDZV_ENDPOINT names the wrong host or port"
            )
        if "error" in result:
            raise self._lost(result["error"])
        return result["store"]

    def _wait_until_listening(self, host: str, port: int) -> None:
        """Poll with plain sockets: the store's own connect retries in C++, deaf to SIGTERM/SIGUSR1 for its whole
        timeout, and logs a stack trace for every attempt."""
        log.info("node %d: waiting for node 0's launcher at %s", self.topology.node_rank, self.endpoint)
        start = time.monotonic()
        reported = start
        while True:
            try:
                socket.create_connection((host, port), timeout=POLL_S).close()
                return
            except OSError as e:
                now = time.monotonic()
                if now - start > self.timeout_s:
                    raise DistributedError(
                        f"node 0's launcher never opened the rendezvous at {self.endpoint} within dist.timeout_s="
                        f"{self.timeout_s}s ({e}): start the same command with NODE_RANK=0 and the same RDZV_ENDPOINT "
                        "and RDZV_ID, and check that its host resolves and its port is reachable from this node"
                    ) from None
                if now - reported >= REPORT_EVERY_S:
                    reported = now
                    log.info(
                        "node %d: still waiting for node 0's launcher at %s (%.0f s of %d s; %s)",
                        self.topology.node_rank,
                        self.endpoint,
                        now - start,
                        self.timeout_s,
                        e,
                    )
            time.sleep(POLL_S)

    def _lost(self, error: Exception) -> DistributedError:
        return DistributedError(
            f"lost node 0's launcher at {self.endpoint} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}): it failed, was stopped or its machine went away, "
            "and its output says why"
        )

    def _get(self, key: str) -> str | None:
        try:
            return self._store.get(key).decode(errors="replace") if self._store.check([key]) else None
        except RuntimeError as e:
            raise self._lost(e) from None

    def _outcome(self, node: int) -> str | None:
        return self._get(_KEY.format(node))

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

    def _wait_for_peers(self, key: str, what: str) -> dict[int, str]:
        """Every node's value under ``key`` (a format of the node), once all have posted; ends on a failure."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.check_peers()
            values = {n: self._get(key.format(n)) for n in range(self.topology.nnodes)}
            missing = [n for n, v in values.items() if v is None]
            if not missing:
                return values  # type: ignore[return-value]
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"node(s) {', '.join(map(str, missing))} never {what} at {self.endpoint} within "
                    f"dist.timeout_s={self.timeout_s}s: start the same command on all {self.topology.nnodes} nodes "
                    f"(NNODES, NODE_RANK=0..{self.topology.nnodes - 1}, the same RDZV_ENDPOINT and RDZV_ID)"
                )
            time.sleep(POLL_S)

    def wait_for_all(self, plan: LaunchPlan | None = None) -> LaunchPlan | None:
        """Post this node's address, check it can reach every peer's, post its success and wait until every node
        has posted its own, or one has failed. Node 0 posts ``plan``; the others return the plan node 0 posted."""
        host, port = self.topology.host_port
        self.address = advertised_address(os.environ, host, port)
        if is_public(self.address):
            log.warning(
                "node %d advertises %s, a public address: anyone who reaches the rendezvous and gloo/NCCL ports can "
                "join or steer this run. Run nodes on a private network or VPN and firewall the ports to the peers "
                "(docs/launching.md, several machines)",
                self.topology.node_rank,
                self.address,
            )
        self._probe = socket.create_server((self.address, 0), backlog=self.topology.nnodes * 4)
        try:
            self._store.set(_ADDRESS.format(self.topology.node_rank), f"{self.address}:{self._probe.getsockname()[1]}")
            if self.hosting and plan is not None:
                self._store.set(PLAN_KEY, plan.to_json())
        except RuntimeError as e:
            raise self._lost(e) from None
        addresses = self._wait_for_peers(_ADDRESS, "reached the launch")
        self._check_reachable(addresses)
        try:
            self._post(OK)
        except RuntimeError as e:
            raise self._lost(e) from None
        self._wait_for_peers(_KEY, "reached the launch")
        if not self.hosting:
            text = self._get(PLAN_KEY)
            plan = LaunchPlan.from_json(text, self.endpoint) if text is not None else None
            self._start_heart()
        return plan

    def _check_reachable(self, addresses: dict[int, str]) -> None:
        for node, posted in addresses.items():
            if node == self.topology.node_rank:
                continue
            host, _, port = posted.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=10).close()
            except (OSError, ValueError) as e:
                raise PreflightError(
                    f"node {node} advertises {host}, which this node ({self.address}) cannot reach ({e}): the ranks "
                    f"would wait out dist.timeout_s connecting to it. Set ADVERTISE_ADDR on node {node} to an "
                    "address of it that the other nodes reach, and open the ports between the nodes"
                ) from None
        log.info("node %d advertises %s; every node reaches every other", self.topology.node_rank, self.address)

    # -- while the ranks run: the other nodes' hearts -------------------------------------------------------

    def _start_heart(self) -> None:
        self._heart = threading.Event()
        threading.Thread(target=self._beat, args=(self._heart,), name="node-heartbeat", daemon=True).start()

    def _beat(self, stop: threading.Event) -> None:
        key = _ALIVE.format(self.topology.node_rank)
        try:
            store = self._connect(min(self.timeout_s, 30))  # its own connection: the main thread uses the other
            while not stop.is_set():
                store.add(key, 1)
                stop.wait(HEARTBEAT_S)
        except RuntimeError:
            pass  # node 0 is gone: the main thread learns it when it next asks

    def silent_peers(self) -> list[int]:
        """Node 0: the peers whose heart stopped (their launcher died, or their machine or network)."""
        counts = [self._store.add(_ALIVE.format(n), 0) for n in range(1, self.topology.nnodes)]
        time.sleep(SILENT_S)
        again = [self._store.add(_ALIVE.format(n), 0) for n in range(1, self.topology.nnodes)]
        return [n for n, a, b in zip(range(1, self.topology.nnodes), counts, again, strict=True) if a == b]

    # -- the end --------------------------------------------------------------------------------------------

    def post_outcome(self, outcome: Outcome, linger_s: float, gone: int = 0) -> None:
        """Node 0: tell every node how the launch ended, and stay until each of those not ``gone`` (silent) has
        read it, for at most ``linger_s``."""
        try:
            self._store.set(OUTCOME_KEY, outcome.to_json())
            deadline = time.monotonic() + linger_s
            expected = self.topology.nnodes - 1 - gone
            while self._store.add(_OUTCOME_SEEN, 0) < expected and time.monotonic() < deadline:
                time.sleep(POLL_S)
        except RuntimeError:
            pass  # the store is node 0's own: it fails only as node 0 goes down

    def read_outcome(self, wait_s: float) -> Outcome:
        """Another node: node 0's outcome, waiting up to ``wait_s`` for node 0 to finish its side."""
        deadline = time.monotonic() + wait_s  # the heart beats on: node 0 may still be finding who failed
        while (text := self._get(OUTCOME_KEY)) is None:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"node 0's launcher at {self.endpoint} did not say how the launch ended within {wait_s:.0f} s"
                )
            time.sleep(POLL_S)
        with contextlib.suppress(RuntimeError):  # node 0 is leaving: it has said what it had to
            self._store.add(_OUTCOME_SEEN, 1)
        return Outcome.from_json(text, self.endpoint)

    def _linger(self) -> None:
        """Node 0 failed before the launch: keep the store up until every peer has read the failure (peers look
        between their stages), for at most LINGER_S; a peer that reads nothing sees the lost connection."""
        deadline = time.monotonic() + min(self.timeout_s, LINGER_S)
        while self._store.add(_SEEN, 0) < self.topology.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._heart is not None:
            self._heart.set()
        if exc is not None and not self._posted and self._store is not None:
            try:
                self._post(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
                if self.hosting and not isinstance(exc, StopRequested):  # a stop must not be delayed
                    self._linger()
            except RuntimeError:
                pass  # node 0 is gone already: the others learn it from the lost connection
        if self._probe is not None:
            self._probe.close()
        self._store = None  # node 0: closes the store, and with it every peer's connection
