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
from train.checkpoint import best_checkpoint, checkpoint_step, latest_checkpoint, shards, unreadable
from train.errors import DataError, TrainError
from train.remote.lease import RemoteLease
from train.remote.pointer import POINTER, belongs_to, read_pointer, remote_ahead
from train.remote.store import LocalFile, Remote, sha1_of
from train.run_dir import RunDir

log = logging.getLogger(__name__)

ATTEMPTS = 4
"""Tries of one upload before it is given up until its file changes (or the ranks stop)."""
BACKOFF_S = 2.0
"""Pause after the first failed try; it doubles after each further one."""
POLL_S = 1.0
"""How often the run folder is looked at for a new checkpoint."""
STAGING = run_files.MIRROR_STAGING
# Small files of the run folder, mirrored whenever they change.
RUN_FILES = (run_files.CONFIG, run_files.WANDB_STATE)


def _signature(path: Path) -> tuple[int, int, int]:
    st = shards.content_file(path).stat()  # a sharded checkpoint's manifest, written once per save
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
        lease: RemoteLease | None = None,
        start_over: bool = False,
    ) -> None:
        self.remote, self.run, self.keep, self.node_rank = remote, run, keep, node_rank
        self.identity = identity
        """The run's identity (train.config.run_identity), with which each checkpoint is tagged in the pointer."""
        self.lease = lease
        """This launch's lease on the remote: once another launch took it over, nothing more is written there."""
        self.start_over = start_over
        """train.resume=never: the run starts over, so the remote's checkpoints of its earlier training are neither
        carried on in the pointer nor pruned (left where they are, as the local ones are archived)."""
        self.ahead: dict | None = None
        """The remote's newest checkpoint of this run when it is newer than this folder's newest: then nothing of
        this folder is written there (it would rewind the remote and prune the newer checkpoints)."""
        self.node_local = node_local and node_rank > 0
        self.poll_s = POLL_S if poll_s is None else poll_s
        self.pointer = read_pointer(remote)  # in the caller's thread: missing credentials fail the launch now
        if start_over and self.pointer is not None:  # the earlier training's entries are no longer this run's
            self.pointer = {"checkpoint": None, "kept": [], "best": None}
        self.failures = 0
        self.complete: bool | None = None
        """What :meth:`finish` returned: whether the remote got all of the run (None: not finished yet)."""
        self.mirrored: list[str] = []
        """The step checkpoints this mirror verified on the remote, in order."""
        self._sent: dict[str, tuple] = {}  # name on the remote -> signature of the local file it holds
        self._given_up: dict[str, tuple] = {}
        self._errors: dict[str, str] = {}  # name on the remote -> why its last upload failed
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
        log.info(
            "remote: waiting up to %d s for %sthe metrics, report and logs to reach %s",
            timeout_s,
            what,
            self.remote.url,
        )
        started = time.monotonic()
        self._finishing.set()
        try:
            self._thread.join(timeout_s)
        except KeyboardInterrupt:  # Ctrl-C: stop waiting, but say what the remote lacks
            self._abandoned.set()
            log.warning(
                "remote: interrupted while waiting; %s lacks %s, still in %s (python -m train push sends it)",
                self.remote.url,
                self._missing(newest),
                self.run.root,
            )
            raise
        if self._thread.is_alive():
            self._abandoned.set()
            log.warning(
                "remote: gave up waiting after %d s (run.remote_wait_s); %s lacks %s, still in %s",
                timeout_s,
                self.remote.url,
                self._missing(newest),
                self.run.root,
            )
            return False
        shutil.rmtree(self._staging, ignore_errors=True)
        if not self._reached(newest):
            return False
        log.info(
            "remote: %s holds the run%s (%.0f s)",
            self.remote.url,
            f" up to {newest.name}, verified" if newest else "",
            time.monotonic() - started,
        )
        if self._given_up:
            log.warning("remote: not mirrored: %s (see the warnings above)", ", ".join(sorted(self._given_up)))
        return not self._given_up

    def _reached(self, newest: Path | None) -> bool:
        """Whether the remote, read back, names ``newest`` as its newest checkpoint; a remote left as it was
        (holding a newer one) or short of it is said with why."""
        if self.ahead is not None:
            log.warning(
                "remote: %s was left as it was: it holds %s, newer than this folder's newest (%s)",
                self.remote.url,
                self.ahead["name"],
                newest.name if newest is not None else "none",
            )
            return False
        if newest is None:
            return True
        there, why = self._remote_newest()
        if there != newest.name:
            log.warning(
                "remote: %s did not reach %s (%s); the newest checkpoint its pointer names is %s",
                newest.name,
                self.remote.url,
                why or self._why_not(newest.name),
                there,
            )
            return False
        return True

    def _remote_newest(self) -> tuple[str | None, str | None]:
        """The checkpoint the remote's own pointer names (read back, not remembered), and why it could not be
        read."""
        try:
            return (read_pointer(self.remote) or {}).get("checkpoint"), None
        except TrainError as e:
            return None, f"its pointer could not be read back: {e}"

    def _why_not(self, name: str) -> str:
        if self.lease is not None and self.lease.lost.is_set():
            return "another launch took the remote over; this one writes nothing more there"
        if self.ahead is not None:
            return f"the remote holds {self.ahead['name']}, newer: nothing of this folder is written there"
        error = self._errors.get(f"checkpoints/{name}") or self._errors.get(POINTER)
        if error:
            return f"its last upload failed: {error}"
        if self._errors:  # the uploads before it still failing, their retries took the time
            return f"not sent: the uploads before it failed ({next(iter(self._errors.values()))})"
        return "not uploaded before the launch ended"

    def _missing(self, newest: Path | None) -> str:
        """What the remote lacks, as far as this mirror knows, and why: the newest checkpoint, files given up,
        the rest."""
        missing = (
            [f"{newest.name} ({self._why_not(newest.name)})"] if newest and self.newest_mirrored != newest.name else []
        )
        missing += [
            f"{name} ({self._errors[name]})" if name in self._errors else name for name in sorted(self._given_up)
        ]
        return ", ".join([*missing, "the files of the final pass (metrics, report, logs) not yet sent"])

    # -- the thread ----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        _run_in_the_background()
        try:
            self.repair_pointer()
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
        if self._shared_with_node_0() or self._lease_lost():
            return
        if self.node_local:
            # Rank 0, and with it the run's checkpoints, metrics and report, is on node 0: this node's folder
            # holds only its own ranks' logs worth sending (anything else in it is stale).
            if final and self.run.logs.is_dir():
                for path in sorted(p for p in self.run.logs.rglob("*") if p.is_file()):
                    self._send_file(path.relative_to(self.run.root).as_posix(), final)
            return
        newest = latest_checkpoint(self.run.checkpoints)
        if self._behind_remote(newest):
            return
        sent_checkpoint = newest is not None and self._checkpoint(newest, final)
        if best_checkpoint(self.run.checkpoints) is not None:
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

    def _behind_remote(self, newest: Path | None) -> bool:
        """Whether the remote holds a newer checkpoint of this run than ``newest`` (this folder's): another box
        went on with the run. Nothing of this folder is written there then (said once)."""
        ahead = None if self.start_over else remote_ahead(self.pointer, self.identity, newest)
        if ahead is not None and self.ahead is None:
            log.error(
                "remote: %s holds %s of this run, newer than %s's newest (%s): nothing of this folder is written "
                "there, which would move its pointer back and delete the newer checkpoints",
                self.remote.url,
                ahead["name"],
                self.run.root,
                newest.name if newest is not None else "none",
            )
        self.ahead = ahead
        return ahead is not None

    def repair_pointer(self) -> None:
        """A pointer rebuilt from the remote's listing (the one written was unreadable) vouches for nothing: each
        checkpoint it names is fetched and checked against the checksum written into it, and a pointer of the
        intact ones is written back in place of the unreadable one."""
        pointer = self.pointer
        if not pointer or not pointer.get("rebuilt") or self._shared_with_node_0() or self.node_local:
            return
        checked: dict[str, bool] = {}
        for entry in [*pointer["kept"], *([pointer["best"]] if pointer.get("best") else [])]:
            why = self._payload_problem(f"checkpoints/{entry['name']}", entry["sha1"])
            if why == "":
                return  # the remote could not be read: nothing is rewritten from what was not checked
            checked[entry["name"]] = why is None
            if why is not None:
                log.error(
                    "remote: %s/checkpoints/%s is left out of the rebuilt pointer: %s",
                    self.remote.url,
                    entry["name"],
                    why,
                )
        clean = lambda e: {k: v for k, v in e.items() if k != "unverified"}  # noqa: E731
        kept = [clean(e) for e in pointer["kept"] if checked[e["name"]]]
        best = pointer.get("best")
        repaired = {
            "checkpoint": kept[0]["name"] if kept else None,
            "kept": kept,
            "best": clean(best) if best and checked[best["name"]] else None,
        }
        if self._write_pointer(repaired, final=False):
            log.warning(
                "remote: %s rewritten: %d intact checkpoint(s) of the %d listed",
                f"{self.remote.url}/{POINTER}",
                len(kept),
                len(pointer["kept"]),
            )

    def _payload_problem(self, name: str, sha1: str) -> str | None:
        """Why the remote's ``name`` is not an intact checkpoint (None: it is; "": it could not be fetched)."""
        tmp = self._staging / f".check.{name.replace('/', '__')}"
        try:
            self.remote.download(name, tmp)
            got = sha1_of(tmp)
            if got != sha1:
                return f"SHA1 {got} fetched, {sha1} listed"
            if name.endswith(shards.SUFFIX):  # a packed sharded checkpoint: its files against their manifest
                folder = self._staging / f".check.{name.replace('/', '__')}.unpacked{shards.SUFFIX}"
                try:
                    shards.unpack(tmp, folder)
                except DataError as e:
                    return str(e)
                finally:
                    shards.remove(folder)
                return None
            return unreadable(tmp)
        except (TrainError, OSError) as e:
            log.warning("remote: %s/%s could not be fetched to check it (%s)", self.remote.url, name, e)
            return ""
        finally:
            tmp.unlink(missing_ok=True)

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
        # Only what this run's pointer listed (or this mirror sent) is ever deleted: a checkpoint another run
        # tagged, or one left out of a rebuilt pointer, stays where it is.
        self._prune({e["name"] for e in ours} | set(self.mirrored), {e["name"] for e in pointer["kept"]})
        return True

    def _on_remote(self, path: Path) -> bool:
        """Whether the pointer already lists ``path``'s bytes (a re-launch on the same machine sends nothing)."""
        entries = [*(self.pointer or {}).get("kept", []), (self.pointer or {}).get("best") or {}]
        known = [e for e in entries if e.get("name") == path.name]
        if not known:
            return False
        try:
            if path.is_dir():  # the sha1 of its packed form, which is what was sent
                packed = self._staging / f".on-remote.{path.name}"
                try:
                    shards.pack(path, packed)
                    return known[0].get("sha1") == sha1_of(packed)
                finally:
                    packed.unlink(missing_ok=True)
            return known[0].get("sha1") == sha1_of(path)
        except FileNotFoundError:
            return False

    def _best(self, final: bool) -> None:
        path = best_checkpoint(self.run.checkpoints)
        if path is None:
            return
        name = f"checkpoints/{path.name}"
        if name not in self._sent and self._on_remote(path):
            self._sent[name] = _signature(path)
            return
        staged = self._upload(name, path, final, link=True)
        if staged is None:
            return
        best = {"name": path.name, "size": staged.size, "sha1": staged.sha1}
        if self.identity is not None:
            best["run"] = self.identity
        if self._write_pointer({**(self.pointer or {"checkpoint": None, "kept": []}), "best": best}, final):
            self._sent[name] = staged.signature

    def _send_file(self, name: str, final: bool) -> None:
        staged = self._upload(name, self.run.root / name, final, link=False)
        if staged is not None:
            self._sent[name] = staged.signature

    def _write_pointer(self, pointer: dict, final: bool) -> bool:
        if self._lease_lost():
            return False
        local = self._staging / POINTER.rsplit("/", 1)[-1]
        write_json_atomic(local, pointer)
        if self._upload(POINTER, local, final, link=False, force=True) is None:
            return False
        self.pointer = pointer
        return True

    def _lease_lost(self) -> bool:
        return self.lease is not None and self.lease.lost.is_set()

    def _prune(self, ours: set[str], kept: set[str]) -> None:
        """Delete the remote's step checkpoints of this run (``ours``) that the pointer no longer lists (keep-k
        on the remote)."""
        if self._lease_lost():
            return
        try:
            for name in self.remote.names("checkpoints"):
                base = name.rsplit("/", 1)[-1]
                if base in ours and base not in kept:
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
        try:
            self._snapshot(path, snapshot, link)
        except FileNotFoundError:
            return None  # gone since (keep-k deleted it): the newer file that replaced it follows
        except OSError as e:
            self._failed(name, signature, f"cannot stage it in {self._staging}: {e.strerror or e}", "")
            return None
        try:
            staged = LocalFile(snapshot, snapshot.stat().st_size, sha1_of(snapshot), signature)
            error = None
            for attempt in range(ATTEMPTS):
                if self._abandoned.is_set():
                    return None
                try:
                    self.remote.upload(staged, name)
                    self._given_up.pop(name, None)
                    self._errors.pop(name, None)
                    return staged
                except Exception as e:  # any failure of one upload is that upload's, never the training's
                    error = self._errors[name] = _redacted(self.remote, e)
                if attempt + 1 < ATTEMPTS:
                    pause = BACKOFF_S * 2**attempt
                    log.warning(
                        "remote: uploading %s failed (%s); trying again in %.0f s (%d/%d)",
                        name,
                        error,
                        pause,
                        attempt + 1,
                        ATTEMPTS - 1,
                    )
                    self._abandoned.wait(pause)
            self._failed(name, signature, error or "", f"after {ATTEMPTS} attempts ")
            return None
        except OSError as e:  # the snapshot vanished under the upload: said, and tried again at the next pass
            self._failed(name, signature, f"its staged copy {snapshot} went away: {e.strerror or e}", "")
            return None
        finally:
            snapshot.unlink(missing_ok=True)

    def _snapshot(self, path: Path, snapshot: Path, link: bool) -> None:
        """Freeze ``path``'s bytes as ``snapshot``. FileNotFoundError: ``path`` is gone. A staging folder that
        someone removed (another process in this run folder) is made again, with a warning."""
        for attempt in range(2):
            snapshot.unlink(missing_ok=True)
            try:
                if path.is_dir():  # a sharded checkpoint: its files packed as one, the unit that is sent
                    shards.pack(path, snapshot)
                elif link:
                    os.link(path, snapshot)  # the same bytes, whatever keep-k or the next save does to the name
                else:
                    shutil.copyfile(path, snapshot)  # appended to in place (metrics, logs): a copy freezes it
                return
            except FileNotFoundError:
                if not path.exists() or attempt:
                    raise
                log.warning(
                    "remote: %s was removed while this launch mirrored (by another process in %s?); made again",
                    self._staging,
                    self.run.root,
                )
                self._staging.mkdir(parents=True, exist_ok=True)
            except OSError:
                if not link:
                    raise
                shutil.copyfile(path, snapshot)  # a file system without hard links
                return

    def _failed(self, name: str, signature: tuple, error: str, how: str) -> None:
        self._given_up[name] = signature
        self._errors[name] = error
        self.failures += 1
        log.warning(
            "remote: %s not mirrored %s(%s); training goes on, and it is tried again when it changes and when the "
            "ranks stop",
            name,
            how,
            error,
        )
        self._record_failure(name, error)

    def _record_failure(self, name: str, error: str | None) -> None:
        record = {
            "event": "remote_upload_failed",
            "file": name,
            "remote": self.remote.url,
            "error": error,
            "time": time.time(),
        }
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
