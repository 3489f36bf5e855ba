"""The run folder, mirrored to the run's remote by a thread of the launcher while the ranks train.

Why the launcher rather than rank 0: it outlives every rank (a crashed or killed rank's checkpoint and logs
still go out), and its uploads share no interpreter, GIL or CPU thread pool with the training loop, so a
step never waits for the network.

Each pass mirrors the newest step checkpoint only: an older one not yet sent when a newer exists is stale and
skipped, so a slow remote falls behind by at most the upload in flight. A checkpoint is first hard-linked
into ``.mirror/`` (keep-k may delete it locally mid-upload), uploaded, verified, and only then named by the
pointer ``checkpoints/latest.json``, which lists the remote's verified checkpoints newest first (train's
keep_checkpoints of them; older ones are deleted from the remote) and best.pt. metrics.jsonl follows each
mirrored checkpoint; the report and logs go when the ranks have stopped. An upload is tried ``attempts``
times with a doubling pause, then given up until the file changes (or the final pass) with a warning in the
log and a ``remote_upload_failed`` record in metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from train import run_files
from train.atomic import write_json_atomic
from train.checkpoint import BEST, checkpoint_step, latest_checkpoint
from train.errors import DataError
from train.remote.store import LocalFile, Remote, sha1_of
from train.run_dir import RunDir

log = logging.getLogger(__name__)

POINTER = run_files.POINTER
ATTEMPTS = 4
"""Tries of one upload before it is given up until its file changes (or the ranks stop)."""
BACKOFF_S = 2.0
"""Pause after the first failed try; it doubles after each further one."""
POLL_S = 1.0
"""How often the run folder is looked at for a new checkpoint."""
STAGING = run_files.MIRROR_STAGING
# Small files of the run folder, mirrored whenever they change.
RUN_FILES = (run_files.CONFIG, run_files.WANDB_STATE)


def read_pointer(remote: Remote) -> dict | None:
    """The remote's checkpoint pointer, or None when it has none (a new run). An unreadable one is rebuilt from
    the checkpoints the remote lists: taken for "no checkpoint yet", it would let a new launch train from step 0
    and its first mirrored checkpoint prune the remote's intact ones."""
    if remote.stat(POINTER) is None:
        return None
    staging = Path(os.environ.get("TMPDIR", "/tmp"))
    tmp = staging / f".latest.{os.getpid()}.{threading.get_ident()}.json"
    try:
        remote.download(POINTER, tmp)
        pointer = json.loads(tmp.read_text())
    except (OSError, ValueError) as e:
        return rebuilt_pointer(remote, f"{type(e).__name__}: {e}")
    finally:
        tmp.unlink(missing_ok=True)
    ok = isinstance(pointer, dict) and isinstance(pointer.get("kept"), list)
    ok = ok and all(isinstance(e, dict) and checkpoint_step(str(e.get("name"))) is not None for e in pointer["kept"])
    return pointer if ok else rebuilt_pointer(remote, "not a pointer: no list of kept checkpoints")


def rebuilt_pointer(remote: Remote, why: str) -> dict:
    """A pointer made from the step checkpoints (and best.pt) the remote lists, newest first, each with the size
    and SHA1 the remote holds (B2 checked that SHA1 on upload; a folder's is read from its bytes), against which
    a restore checks what it fetches. None listed: DataError, the launch stops (exit 3) and deletes nothing."""
    names = [n.rsplit("/", 1)[-1] for n in remote.names("checkpoints")]
    steps = sorted((s, n) for n in names if (s := checkpoint_step(n)) is not None)
    kept = []
    for step, name in reversed(steps):
        stat = remote.stat(f"checkpoints/{name}")
        if stat is not None and stat.sha1:
            kept.append({"name": name, "step": step, "size": stat.size, "sha1": stat.sha1})
    if not kept:
        raise DataError(
            f"remote: {remote.url}/{POINTER} cannot be read ({why}) and the remote lists no checkpoint to rebuild it "
            f"from. Nothing was changed; if the run there is to start over, delete {remote.url}/{POINTER}"
        )
    best = remote.stat(f"checkpoints/{BEST}") if BEST in names else None
    log.warning(
        "remote: %s/%s cannot be read (%s); rebuilt from the %d checkpoint(s) the remote lists (newest %s)",
        remote.url, POINTER, why, len(kept), kept[0]["name"],
    )  # fmt: skip
    best_entry = {"name": BEST, "size": best.size, "sha1": best.sha1} if best is not None and best.sha1 else None
    return {"checkpoint": kept[0]["name"], "kept": kept, "best": best_entry}


def belongs_to(entry: dict, identity: str | None) -> bool:
    """Whether a pointer entry is a checkpoint of the run ``identity`` (entries written before the pointer
    carried identities count as the run's: the remote's config was checked against this run)."""
    return identity is None or entry.get("run") in (None, identity)


def _signature(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


class RunMirror:
    """Mirrors ``run`` to ``remote`` from a background thread; :meth:`finish` ends it, waiting a bounded time."""

    def __init__(
        self,
        remote: Remote,
        run: RunDir,
        keep: int,
        *,
        node_rank: int = 0,
        node_local: bool = False,
        identity: str | None = None,
        poll_s: float | None = None,
    ) -> None:
        self.remote, self.run, self.keep, self.node_rank = remote, run, keep, node_rank
        self.identity = identity
        """The run's identity (train.config.run_identity), with which each checkpoint is tagged in the pointer."""
        self.node_local = node_local and node_rank > 0
        self.poll_s = POLL_S if poll_s is None else poll_s
        self.pointer = read_pointer(remote)  # in the caller's thread: missing credentials fail the launch now
        self.failures = 0
        self.mirrored: list[str] = []
        """The step checkpoints this mirror verified on the remote, in order."""
        self._sent: dict[str, tuple] = {}  # name on the remote -> signature of the local file it holds
        self._given_up: dict[str, tuple] = {}
        self._finishing, self._abandoned = threading.Event(), threading.Event()
        self._staging = run.root / STAGING
        shutil.rmtree(self._staging, ignore_errors=True)  # snapshots of an earlier launch
        self._staging.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="remote-mirror", daemon=True)

    def start(self) -> RunMirror:
        self._thread.start()
        return self

    @property
    def newest_mirrored(self) -> str | None:
        return self.pointer["checkpoint"] if self.pointer else None

    def finish(self, timeout_s: float) -> bool:
        """Mirror what is left (newest checkpoint, best.pt, metrics, report, logs) within ``timeout_s``; True
        when everything got there."""
        if self._shared_with_node_0():
            self._finishing.set()
            self._thread.join(timeout_s)
            log.info("remote: %s is node 0's run folder too; node 0's launcher mirrors it", self.run.root)
            return True
        newest = None if self.node_local else latest_checkpoint(self.run.checkpoints)
        what = f"{newest.name}, " if newest else ""
        log.info("remote: waiting up to %d s for %sthe metrics, report and logs to reach %s", timeout_s, what,
                 self.remote.url)  # fmt: skip
        started = time.monotonic()
        self._finishing.set()
        try:
            self._thread.join(timeout_s)
        except KeyboardInterrupt:  # Ctrl-C: stop waiting, but say what the remote lacks
            self._abandoned.set()
            log.warning("remote: interrupted while waiting; %s lacks %s, still in %s (python -m train push sends it)",
                        self.remote.url, self._missing(newest), self.run.root)  # fmt: skip
            raise
        if self._thread.is_alive():
            self._abandoned.set()
            log.warning("remote: gave up waiting after %d s (run.remote_wait_s); what did not reach %s is still in %s",
                        timeout_s, self.remote.url, self.run.root)  # fmt: skip
            return False
        shutil.rmtree(self._staging, ignore_errors=True)
        if newest is not None and self.newest_mirrored != newest.name:
            log.warning("remote: %s did not reach %s (see the warnings above); the newest checkpoint there is %s",
                        newest.name, self.remote.url, self.newest_mirrored)  # fmt: skip
            return False
        log.info("remote: %s holds the run%s (%.0f s)", self.remote.url,
                 f" up to {newest.name}, verified" if newest else "", time.monotonic() - started)  # fmt: skip
        if self._given_up:
            log.warning("remote: not mirrored: %s (see the warnings above)", ", ".join(sorted(self._given_up)))
        return not self._given_up

    def _missing(self, newest: Path | None) -> str:
        """What the remote lacks, as far as this mirror knows: the newest checkpoint, files given up, the rest."""
        missing = [newest.name] if newest is not None and self.newest_mirrored != newest.name else []
        missing += sorted(self._given_up)
        return ", ".join([*missing, "the files of the final pass (metrics, report, logs) not yet sent"])

    # -- the thread ----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        _run_in_the_background()
        try:
            while not self._finishing.is_set():
                self._pass(final=False)
                self._finishing.wait(self.poll_s)
            self._pass(final=True)
        except Exception:  # a bug here must cost the mirror, never the training
            log.exception("remote: the mirror stopped; training goes on without it")

    def _shared_with_node_0(self) -> bool:
        """Another node whose run folder is node 0's too (a shared file system): node 0's launcher mirrors it."""
        return self.node_rank > 0 and not self.node_local

    def _pass(self, final: bool) -> None:
        if self._shared_with_node_0():
            return
        if self.node_local:
            # Rank 0, and with it the run's checkpoints, metrics and report, is on node 0: this node's folder
            # holds only its own ranks' logs worth sending (anything else in it is stale).
            if final and self.run.logs.is_dir():
                for path in sorted(p for p in self.run.logs.rglob("*") if p.is_file()):
                    self._send_file(path.relative_to(self.run.root).as_posix(), final)
            return
        newest = latest_checkpoint(self.run.checkpoints)
        sent_checkpoint = newest is not None and self._checkpoint(newest, final)
        if (self.run.checkpoints / BEST).is_file():
            self._best(final)
        for name in RUN_FILES:
            if (self.run.root / name).is_file():
                self._send_file(name, final)
        if sent_checkpoint or final:
            self._send_file(run_files.METRICS, final)
        if final:
            for folder in (self.run.report, self.run.logs):
                for path in sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else ():
                    self._send_file(path.relative_to(self.run.root).as_posix(), final)

    def _checkpoint(self, path: Path, final: bool) -> bool:
        name = f"checkpoints/{path.name}"
        if name not in self._sent and self._on_remote(path):
            self._sent[name] = _signature(path)  # mirrored by an earlier launch
            return False
        staged = self._upload(name, path, final, link=True)
        if staged is None:
            return False
        entry = {"name": path.name, "step": checkpoint_step(path.name), "size": staged.size, "sha1": staged.sha1}
        if self.identity is not None:
            entry["run"] = self.identity
        old = self.pointer or {}
        # Entries of another run are never carried on (the launch checked the remote's config, but a pointer
        # written by another run under a missing or replaced config.yaml must not name its checkpoints as ours).
        ours = [e for e in old.get("kept", []) if belongs_to(e, self.identity)]
        older = [e for e in ours if e.get("step", -1) < entry["step"]]
        pointer = {"checkpoint": path.name, "kept": [entry, *older][: self.keep], "best": old.get("best")}
        if not self._write_pointer(pointer, final):
            return False
        self._sent[name] = staged.signature
        self.mirrored.append(path.name)
        for stale in [n for n in self._given_up if checkpoint_step(n.rsplit("/", 1)[-1]) is not None]:
            del self._given_up[stale]  # superseded by this one
        log.info("remote: %s verified on %s (SHA1 %s)", path.name, self.remote.url, staged.sha1)
        self._prune({e["name"] for e in pointer["kept"]})
        return True

    def _on_remote(self, path: Path) -> bool:
        """Whether the pointer already lists ``path``'s bytes (a re-launch on the same machine sends nothing)."""
        entries = [*(self.pointer or {}).get("kept", []), (self.pointer or {}).get("best") or {}]
        known = [e for e in entries if e.get("name") == path.name]
        try:
            return bool(known) and known[0].get("sha1") == sha1_of(path)
        except FileNotFoundError:
            return False

    def _best(self, final: bool) -> None:
        name = f"checkpoints/{BEST}"
        if name not in self._sent and self._on_remote(self.run.checkpoints / BEST):
            self._sent[name] = _signature(self.run.checkpoints / BEST)
            return
        staged = self._upload(name, self.run.checkpoints / BEST, final, link=True)
        if staged is None:
            return
        best = {"name": BEST, "size": staged.size, "sha1": staged.sha1}
        if self.identity is not None:
            best["run"] = self.identity
        if self._write_pointer({**(self.pointer or {"checkpoint": None, "kept": []}), "best": best}, final):
            self._sent[name] = staged.signature

    def _send_file(self, name: str, final: bool) -> None:
        staged = self._upload(name, self.run.root / name, final, link=False)
        if staged is not None:
            self._sent[name] = staged.signature

    def _write_pointer(self, pointer: dict, final: bool) -> bool:
        local = self._staging / POINTER.rsplit("/", 1)[-1]
        write_json_atomic(local, pointer)
        if self._upload(POINTER, local, final, link=False, force=True) is None:
            return False
        self.pointer = pointer
        return True

    def _prune(self, kept: set[str]) -> None:
        """Delete the remote's step checkpoints that the pointer no longer lists (keep-k on the remote)."""
        try:
            for name in self.remote.names("checkpoints"):
                base = name.rsplit("/", 1)[-1]
                if checkpoint_step(base) is not None and base not in kept:
                    self.remote.delete(name)
        except Exception as e:
            log.warning("remote: could not delete old checkpoints on %s (%s); they stay", self.remote.url, e)

    def _upload(self, name: str, path: Path, final: bool, *, link: bool, force: bool = False) -> LocalFile | None:
        """Snapshot ``path`` and upload it as ``name``, with retries; None when unchanged, gone or failed."""
        try:
            signature = _signature(path)
        except FileNotFoundError:
            return None
        if not force and (self._sent.get(name) == signature or (not final and self._given_up.get(name) == signature)):
            return None
        snapshot = self._staging / name.replace("/", "__")
        snapshot.unlink(missing_ok=True)
        try:
            if link:
                os.link(path, snapshot)  # the same bytes, whatever keep-k or the next save does to the name
            else:
                shutil.copyfile(path, snapshot)  # appended to in place (metrics, logs): a copy freezes it
        except FileNotFoundError:
            return None
        except OSError:
            shutil.copyfile(path, snapshot)  # a file system without hard links
        try:
            staged = LocalFile(snapshot, snapshot.stat().st_size, sha1_of(snapshot), signature)
            error = None
            for attempt in range(ATTEMPTS):
                if self._abandoned.is_set():
                    return None
                try:
                    self.remote.upload(staged, name)
                    self._given_up.pop(name, None)
                    return staged
                except Exception as e:  # any failure of one upload is that upload's, never the training's
                    error = _redacted(self.remote, e)
                if attempt + 1 < ATTEMPTS:
                    pause = BACKOFF_S * 2**attempt
                    log.warning("remote: uploading %s failed (%s); trying again in %.0f s (%d/%d)", name, error,
                                pause, attempt + 1, ATTEMPTS - 1)  # fmt: skip
                    self._abandoned.wait(pause)
            self._given_up[name] = signature
            self.failures += 1
            log.warning("remote: %s not mirrored after %d attempts (%s); training goes on, and it is tried again "
                        "when it changes and when the ranks stop", name, ATTEMPTS, error)  # fmt: skip
            self._record_failure(name, error)
            return None
        finally:
            snapshot.unlink(missing_ok=True)

    def _record_failure(self, name: str, error: str | None) -> None:
        record = {"event": "remote_upload_failed", "file": name, "remote": self.remote.url, "error": error,
                  "time": time.time()}  # fmt: skip
        line = (json.dumps(record) + "\n").encode()
        # One write on an O_APPEND descriptor: the line lands whole between rank 0's own lines.
        fd = os.open(self.run.root / run_files.METRICS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _run_in_the_background() -> None:
    """Give this thread the CPU only when the ranks leave it idle: hashing and sending checkpoints is real work,
    and on a machine whose cores the ranks (and their data loaders) keep busy it would otherwise slow steps.
    When the ranks stop, the cores are idle and the final uploads run at full speed."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))  # Linux: per thread
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def _redacted(remote: Remote, error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    for secret in getattr(remote, "_secrets", ()):
        text = text.replace(secret, "***")
    return text
