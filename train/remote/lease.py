"""One live launch per remote run folder: a lease on the remote that the launch holding it keeps renewing.

Two launches of one run on two boxes without a shared disk each hold a run-folder lock of their own
(train.launch.run_lock), so nothing local stops them; against one remote each would prune the other's
checkpoints and move the pointer back to its own older step. So the launcher that writes to a remote claims
``<remote>/<run>/lease.json`` before it restores or writes anything there, renews it from a thread of its own
while it runs (stages, ranks and the final uploads) and deletes it when it ends.

No clock of another machine is ever compared with this one's: a lease found on the remote is live when its
renewal count moves. The claimant watches it for the longer of the holder's period (recorded in the lease) and its
own ``run.remote_lease_s``: a count that moves (or a new claimant) means another live launch, and this one stops
with exit 4 naming it; a count that stays still that long belonged to a launch that died without letting go, whose
lease is then taken over. A lease of a process of this host that no longer exists is taken at once; one whose
holder is a live process of this host is never taken (a stopped launch renews nothing, yet resumes writing).
A remote has no atomic compare-and-swap (B2 has none), so a
claim is read back after it is written: of two launches claiming at the same moment, the one whose claim was
overwritten sees it and stops.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

from train.errors import PreflightError, TrainError
from train.remote.store import LocalFile, Remote, sha1_of

log = logging.getLogger(__name__)

LEASE = "lease.json"
RENEWALS_PER_LEASE = 3
"""Renewals within one lease period: a live holder is seen renewing at least twice by anyone who watches."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (None: unknown here): with the boot's id it tells
    the launch that wrote a lease from another process that later got its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, after the command's name
    except (OSError, ValueError, IndexError):
        return None


def _holder_alive_here(lease: dict) -> bool | None:
    """Whether the launch that wrote ``lease`` is a live process of this host: True, False, or None when it is
    another host's (only its renewals can tell)."""
    pid = lease.get("pid")
    if lease.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    if not _alive(pid):
        return False
    if lease.get("boot_id") and lease.get("boot_id") != _boot_id():
        return False  # written before this host restarted: the pid is another process's now
    started = lease.get("pid_start")
    return started is None or _process_start(pid) in (None, started)


def _describe(lease: dict) -> str:
    if lease.get("unreadable"):
        return (
            f"an unreadable lease file ({lease.get('why', 'not a JSON object')}), written by no launch this one knows"
        )
    return (
        f"launch {lease.get('launch')} on host {lease.get('host')} (pid {lease.get('pid')}, started "
        f"{lease.get('started')}: {lease.get('command')})"
    )


class RemoteLease:
    """This launch's claim on a run's remote folder; a context manager (claim on entry, release on exit).
    ``lost`` is set when another launch took the lease over (this one was silent for too long): from then on
    nothing of this launch may write a pointer or delete a file there."""

    def __init__(self, remote: Remote, lease_s: float, command: str | None = None):
        self.remote, self.lease_s = remote, float(lease_s)
        self.launch = uuid.uuid4().hex[:16]
        self.record = {
            "launch": self.launch,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command or " ".join(["python -m train", *sys.argv[1:]]),
            "beat": 0,
            "lease_s": self.lease_s,
            "boot_id": _boot_id(),
            "pid_start": _process_start(os.getpid()),
        }
        self.lost = threading.Event()
        self._stale: str | None = None  # the launch whose silent lease this one took over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the remote file ---------------------------------------------------------------------------------------

    def _read(self) -> dict | None:
        if self.remote.stat(LEASE) is None:
            return None
        with tempfile.TemporaryDirectory() as folder:
            path, text = Path(folder) / LEASE, ""
            try:
                self.remote.download(LEASE, path)
                text = path.read_text()
                lease = json.loads(text)
            except (OSError, ValueError) as e:
                why = "empty" if isinstance(e, ValueError) and not text.strip() else f"{type(e).__name__}: {e}"
                return {"launch": None, "beat": None, "unreadable": True, "why": why}
        if not isinstance(lease, dict):
            return {"launch": None, "beat": None, "unreadable": True, "why": f"a JSON {type(lease).__name__}"}
        return lease

    def _write(self) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / LEASE
            path.write_text(json.dumps(self.record))
            self.remote.upload(LocalFile(path, path.stat().st_size, sha1_of(path)), LEASE)

    # -- claim, renew, release ---------------------------------------------------------------------------------

    def acquire(self) -> RemoteLease:
        held = self._read()
        if held is not None and held.get("launch") != self.launch:
            self._wait_until_free(held)
            self._stale = held.get("launch")
        try:
            self._write()
        except TrainError as e:  # a remote that takes no write now (full, over its cap): training is not stopped
            log.warning(
                "remote: could not claim %s/%s (%s); the launch goes on and claims it at its next renewal, once "
                "the remote takes writes again",
                self.remote.url,
                LEASE,
                e,
            )
        else:
            time.sleep(min(1.0, self.lease_s / 20))  # a claim written at the same moment lands within this
            now = self._read()
            if now is None or now.get("launch") != self.launch:
                raise PreflightError(
                    f"{self.remote.url}: another launch claimed this run's remote at the same moment "
                    f"({_describe(now or {})}); one launch per run. Wait for it to end, or give this run another "
                    "name (RUN=... or --run)"
                )
        self._thread = threading.Thread(target=self._renew_loop, name="remote-lease", daemon=True)
        self._thread.start()
        return self

    def _wait_until_free(self, held: dict) -> None:
        """Return once ``held`` is a lease nobody renews; PreflightError while another launch keeps it."""
        here = _holder_alive_here(held)
        if here is False:
            log.warning(
                "remote: %s/%s was held by %s, which no longer runs; taking it over",
                self.remote.url,
                LEASE,
                _describe(held),
            )
            return
        if here:  # renewals or not, a live launch of this host holds it (stopped, or its remote was slow)
            raise PreflightError(
                f"{self.remote.url} is in use by another launch of this run: {_describe(held)}, a live process on "
                "this host. Two launches of one run would prune each other's checkpoints on the remote. Wait for it "
                "to end or stop it, or give this run another name (RUN=... or --run) or another run.remote"
            )
        # The holder renews within its own period, which may be longer than this launch's: wait the longer one.
        theirs = held.get("lease_s")
        period = max(self.lease_s, float(theirs) if isinstance(theirs, int | float) and theirs > 0 else 0.0)
        log.info(
            "remote: %s/%s is held by %s; watching it for up to %.0f s (the longer of its run.remote_lease_s and "
            "this launch's) to see whether that launch is alive",
            self.remote.url,
            LEASE,
            _describe(held),
            period,
        )
        deadline = time.monotonic() + period
        while time.monotonic() < deadline:
            time.sleep(min(2.0, self.lease_s / (4 * RENEWALS_PER_LEASE)))
            now = self._read()
            if now is None:
                return  # released meanwhile
            if (now.get("launch"), now.get("beat")) != (held.get("launch"), held.get("beat")):
                raise PreflightError(
                    f"{self.remote.url} is in use by another launch of this run: {_describe(now)}, which renewed "
                    "its lease while this one watched. Two launches of one run would prune each other's "
                    "checkpoints on the remote. Wait for it to end or stop it, or give this run another name "
                    "(RUN=... or --run) or another run.remote"
                )
        log.warning(
            "remote: %s/%s of %s was not renewed for %.0f s (run.remote_lease_s): that launch is gone; "
            "taking the run over",
            self.remote.url,
            LEASE,
            _describe(held),
            period,
        )

    def _renew_loop(self) -> None:
        every = self.lease_s / RENEWALS_PER_LEASE
        while not self._stop.wait(every):
            try:
                now = self._read()
                if now is not None and now.get("launch") not in (self.launch, self._stale):
                    self.lost.set()
                    log.error(
                        "remote: %s was taken over by %s (this launch could not renew its lease for "
                        "run.remote_lease_s); nothing more of this launch is written there",
                        self.remote.url,
                        _describe(now),
                    )
                    return
                self.record["beat"] += 1
                self._write()
            except (TrainError, OSError) as e:  # an unreachable remote: tried again at the next renewal
                log.warning(
                    "remote: renewing the lease on %s failed (%s); trying again in %.0f s", self.remote.url, e, every
                )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost.is_set():
            return
        try:
            now = self._read()
            if now is not None and now.get("launch") == self.launch:
                self.remote.delete(LEASE)
        except (TrainError, OSError) as e:
            log.warning(
                "remote: could not release the lease on %s (%s); the next launch takes it over after "
                "run.remote_lease_s",
                self.remote.url,
                e,
            )

    def __enter__(self) -> RemoteLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
