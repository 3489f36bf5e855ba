"""The run's remote copy: uploads verified by SHA1, the pointer, keep-k, stale checkpoints skipped, failures
retried and recorded, and a restore that never starts from bytes the pointer does not vouch for. B2 is b2sdk's
in-process RawSimulator (the real SDK's upload, multipart and download paths); a folder remote is a real
folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from b2sdk.v2 import exception as b2_exception

from tests.b2sim import SENTINEL_KEY, Account
from tests.helpers import REPO
from train.checkpoint import checkpoint_name, sealed
from train.config import load_config
from train.errors import ConfigError, DataError
from train.obs.sinks import read_metrics
from train.remote import mirror as mirror_module
from train.remote.mirror import RunMirror
from train.remote.pointer import POINTER, read_pointer
from train.remote.restore import check_remote_config, restore_run
from train.remote.store import FolderRemote, LocalFile, UploadFailed, open_remote, sha1_of
from train.run_dir import RunDir


@pytest.fixture
def b2(monkeypatch) -> Account:
    return Account(monkeypatch)


@pytest.fixture(params=["folder", "b2"])
def remote(request, tmp_path, monkeypatch):
    if request.param == "folder":
        return open_remote(str(tmp_path / "remote"), "run")
    return open_remote("b2://pdebench/runs", "run", Account(monkeypatch).api)


def checkpoint(run: RunDir, step: int, size: int = 3000) -> Path:
    """A small real step checkpoint (random weights of about ``size`` bytes, sealed with its payload checksum):
    the mirror moves bytes, a restore checks them against that checksum."""
    path = run.checkpoints / checkpoint_name(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(sealed({"model": {"w": torch.randn(max(1, size // 4))}, "progress": {"global_step": step}}), tmp)
    tmp.rename(path)  # as save_checkpoint does: the name appears complete
    return path


def fetched(remote, name: str, tmp_path: Path) -> bytes:
    dest = tmp_path / f"fetched-{name.replace('/', '_')}"
    remote.download(name, dest)
    return dest.read_bytes()


def pointed(remote) -> list[str]:
    return [e["name"] for e in (read_pointer(remote) or {"kept": []})["kept"]]


def wait_until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.01)


def test_each_checkpoint_is_verified_then_pointed_to_and_the_remote_keeps_k(remote, tmp_path):
    run = RunDir(tmp_path / "runs" / "run")
    mirror = RunMirror(remote, run, keep=2, poll_s=0.01).start()
    written = []
    for step in (10, 20, 30):
        written.append(checkpoint(run, step))
        wait_until(lambda step=step: pointed(remote)[:1] == [checkpoint_name(step)], f"step {step} mirrored")
    assert mirror.finish(30)

    assert pointed(remote) == [checkpoint_name(30), checkpoint_name(20)]
    assert remote.names("checkpoints") == ["checkpoints/latest.json", *(f"checkpoints/{p.name}" for p in written[1:])]
    pointer = read_pointer(remote)
    for entry, path in zip(pointer["kept"], written[::-1], strict=False):
        assert (
            entry["sha1"]
            == sha1_of(path)
            == hashlib.sha1(fetched(remote, f"checkpoints/{path.name}", tmp_path)).hexdigest()
        )
        assert entry["size"] == path.stat().st_size
    assert not (run.root / ".mirror").exists()


def test_the_final_pass_sends_best_metrics_report_and_logs(remote, tmp_path):
    run = RunDir(tmp_path / "runs" / "run")
    checkpoint(run, 5)
    (run.checkpoints / "best.pt").write_bytes(b"best")
    (run.root / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
    (run.report / "summary.md").parent.mkdir(parents=True)
    (run.report / "summary.md").write_text("# report")
    (run.logs / "torchrun" / "attempt_0").mkdir(parents=True)
    (run.logs / "rank0.log").write_text("rank 0")
    (run.logs / "torchrun" / "attempt_0" / "stderr.log").write_text("stderr")

    assert RunMirror(remote, run, keep=2, poll_s=0.01).start().finish(30)

    for name, data in [("metrics.jsonl", b'{"step": 5, "loss": 1.0}\n'), ("report/summary.md", b"# report"),
                       ("logs/rank0.log", b"rank 0"), ("logs/torchrun/attempt_0/stderr.log", b"stderr"),
                       ("checkpoints/best.pt", b"best")]:  # fmt: skip
        assert fetched(remote, name, tmp_path) == data, name
    assert read_pointer(remote)["best"]["sha1"] == hashlib.sha1(b"best").hexdigest()


def test_a_relaunch_on_the_same_machine_sends_nothing_already_verified(tmp_path, b2):
    remote = open_remote("b2://pdebench/runs", "run", b2.api)
    run = RunDir(tmp_path / "runs" / "run")
    checkpoint(run, 5)
    assert RunMirror(remote, run, keep=2, poll_s=0.01).start().finish(30)
    uploads = []
    real = b2.sim.upload_file
    b2.sim.upload_file = lambda *a, **k: uploads.append(a[2]) or real(*a, **k)

    assert RunMirror(remote, run, keep=2, poll_s=0.01).start().finish(30)

    assert not [name for name in uploads if name.endswith(".pt")], uploads


def test_a_slow_remote_skips_checkpoints_that_became_stale_while_it_uploaded(tmp_path, b2):
    remote = open_remote("b2://pdebench/runs", "run", b2.api)
    run = RunDir(tmp_path / "runs" / "run")
    started, release, uploaded = threading.Event(), threading.Event(), []
    real = b2.sim.upload_part

    def slow_part(*args, **kwargs):  # every multipart upload of a checkpoint waits for the test
        started.set()
        release.wait(30)
        return real(*args, **kwargs)

    real_start = b2.sim.start_large_file
    b2.sim.start_large_file = lambda *a, **k: uploaded.append(a[3]) or real_start(*a, **k)  # a[3]: the name
    b2.sim.upload_part = slow_part
    mirror = RunMirror(remote, run, keep=3, poll_s=0.01).start()
    checkpoint(run, 1)
    assert started.wait(30)
    checkpoint(run, 2)  # written while step 1 is on its way: stale by the time that upload ends
    checkpoint(run, 3)
    release.set()
    assert mirror.finish(60)

    names = [name.rsplit("/", 1)[-1] for name in uploaded]
    assert checkpoint_name(2) not in names and names[0] == checkpoint_name(1), names
    assert pointed(remote) == [checkpoint_name(3), checkpoint_name(1)]


def test_failed_uploads_are_retried_then_warned_and_recorded_and_a_later_one_gets_through(
    tmp_path, b2, monkeypatch, caplog
):
    monkeypatch.setattr(mirror_module, "BACKOFF_S", 0.01)
    remote = open_remote("b2://pdebench/runs", "run", b2.api)
    run = RunDir(tmp_path / "runs" / "run")
    (run.root).mkdir(parents=True)
    (run.root / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    # Every attempt the mirror makes at the first checkpoint fails (b2sdk itself does not retry this one).
    b2.sim.set_upload_errors([b2_exception.StorageCapExceeded() for _ in range(mirror_module.ATTEMPTS)])
    b2.sim.MIN_PART_SIZE = 100_000  # every file under the simulator's large-file threshold: one call per attempt
    caplog.set_level(logging.INFO)
    mirror = RunMirror(remote, run, keep=2, poll_s=0.01).start()
    checkpoint(run, 1, size=300)
    wait_until(lambda: mirror.failures == 1, "the first checkpoint given up")
    checkpoint(run, 2)
    assert mirror.finish(30)

    assert pointed(remote) == [checkpoint_name(2)]
    failed = [r for r in read_metrics(run.root / "metrics.jsonl") if r.get("event") == "remote_upload_failed"]
    assert [r["file"] for r in failed] == [f"checkpoints/{checkpoint_name(1)}"]
    assert "storage cap" in failed[0]["error"].lower()
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == mirror_module.ATTEMPTS - 1
    assert any("not mirrored after" in r.getMessage() for r in caplog.records)
    assert SENTINEL_KEY not in caplog.text + (run.root / "metrics.jsonl").read_text()


def stalled_upload(tmp_path, b2) -> tuple:
    """A mirror whose upload of step 7 hangs until the returned event is set: (remote, mirror, release)."""
    remote = open_remote("b2://pdebench/runs", "run", b2.api)
    run = RunDir(tmp_path / "runs" / "run")
    release = threading.Event()
    real = b2.sim.upload_part
    b2.sim.upload_part = lambda *a, **k: release.wait(60) and real(*a, **k)
    mirror = RunMirror(remote, run, keep=2, poll_s=0.01).start()
    checkpoint(run, 7)
    return remote, mirror, release


def test_finish_waits_a_bounded_time_and_says_what_is_left(tmp_path, b2, caplog):
    _, mirror, release = stalled_upload(tmp_path, b2)
    start = time.monotonic()
    assert not mirror.finish(0.5)
    assert time.monotonic() - start < 10
    assert "gave up waiting after" in caplog.text and "run.remote_wait_s" in caplog.text
    release.set()


def test_ctrl_c_during_the_final_wait_says_what_the_remote_lacks(tmp_path, b2, caplog, monkeypatch):
    remote, mirror, release = stalled_upload(tmp_path, b2)

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(mirror._thread, "join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mirror.finish(60)
    assert f"interrupted while waiting; {remote.url} lacks {checkpoint_name(7)}" in caplog.text
    assert "python -m train push" in caplog.text
    release.set()


def test_a_full_remote_folder_names_the_remote_not_the_local_folders(tmp_path, monkeypatch):
    import errno

    remote = open_remote(str(tmp_path / "remote"), "run")
    local = tmp_path / "ckpt"
    local.write_bytes(os.urandom(5000))

    def full(source, dest):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("train.remote.store.shutil.copyfile", full)
    with pytest.raises(UploadFailed) as e:
        remote.upload(LocalFile(local, 5000, sha1_of(local)), "checkpoints/step_00000001.pt")
    assert "the remote's disk is full" in str(e.value) and "4.9 KiB needed" in str(e.value)
    assert "run.runs_dir" not in str(e.value) and not list((tmp_path / "remote").rglob("*.tmp"))


def test_an_upload_the_folder_cannot_vouch_for_fails(tmp_path, monkeypatch):
    remote = open_remote(str(tmp_path / "remote"), "run")
    src = tmp_path / "src.bin"
    src.write_bytes(b"the bytes we have")
    real = FolderRemote._put

    def bitrot(self, local, name):
        real(self, local, name)
        self.path(name).write_bytes(b"the bytes it kept")

    monkeypatch.setattr(FolderRemote, "_put", bitrot)
    with pytest.raises(UploadFailed, match="SHA1"):
        remote.upload(LocalFile(src, src.stat().st_size, sha1_of(src)), "x.bin")


# -- restore ---------------------------------------------------------------------------------------------------


def config(tmp_path: Path, *overrides: str):
    return load_config(REPO / "configs/tiny.yaml", [f"run.runs_dir={tmp_path / 'runs'}", *overrides], run_name="run")


def mirrored(tmp_path: Path, remote, steps=(10, 20)) -> tuple[RunDir, dict[int, bytes]]:
    cfg = config(tmp_path)
    run = RunDir.of(cfg)
    run.prepare(cfg)
    mirror = RunMirror(remote, run, keep=2, poll_s=0.01).start()
    data = {}
    for step in steps:
        data[step] = checkpoint(run, step).read_bytes()
        wait_until(lambda step=step: pointed(remote)[:1] == [checkpoint_name(step)], f"step {step} mirrored")
    (run.root / "metrics.jsonl").write_text('{"step": 20, "loss": 1.0}\n')
    (run.root / "wandb.json").write_text('{"id": "abc123", "offset": 0, "step": -1}')
    assert mirror.finish(30)
    return run, data


def box_gone(run: RunDir) -> None:
    import shutil

    shutil.rmtree(run.root)


def test_a_new_machine_fetches_the_newest_checkpoint_config_and_metrics(remote, tmp_path):
    run, data = mirrored(tmp_path, remote)
    box_gone(run)

    assert restore_run(config(tmp_path), run, remote) == checkpoint_name(20)
    assert (run.checkpoints / checkpoint_name(20)).read_bytes() == data[20]
    assert (run.root / "metrics.jsonl").read_text() == '{"step": 20, "loss": 1.0}\n'
    assert (run.root / "config.yaml").is_file()
    assert (run.root / "wandb.json").read_text() == '{"id": "abc123", "offset": 0, "step": -1}'  # the same W&B run
    assert restore_run(config(tmp_path), run, remote) is None  # a local checkpoint always wins


def test_a_remote_checkpoint_whose_bytes_differ_from_the_verified_ones_is_never_used(tmp_path, b2, caplog):
    remote = open_remote("b2://pdebench/runs", "run", b2.api)
    run, data = mirrored(tmp_path, remote)
    box_gone(run)
    # Replaced behind the pointer's back by a valid B2 upload: B2's own SHA1 is consistent, the pointer's is not.
    b2.bucket.upload_bytes(os.urandom(3000), f"runs/run/checkpoints/{checkpoint_name(20)}")

    assert restore_run(config(tmp_path), run, remote) == checkpoint_name(10)
    assert (run.checkpoints / checkpoint_name(10)).read_bytes() == data[10]
    assert not (run.checkpoints / checkpoint_name(20)).exists()
    assert f"{checkpoint_name(20)} is not used" in caplog.text and "SHA1" in caplog.text

    box_gone(run)
    b2.bucket.upload_bytes(os.urandom(3000), f"runs/run/checkpoints/{checkpoint_name(10)}")
    with pytest.raises(DataError, match="none of the 2 checkpoint"):
        restore_run(config(tmp_path), run, remote)
    assert not list(run.checkpoints.glob("*.pt")) and not list(run.checkpoints.glob(".*"))


def test_a_remote_run_with_a_different_config_is_refused(remote, tmp_path):
    run, _ = mirrored(tmp_path, remote)
    box_gone(run)
    with pytest.raises(ConfigError, match=r"different config \(train\.lr\); pick another run name"):
        check_remote_config(config(tmp_path, "train.lr=0.5"), remote)  # on every launch that mirrors
    check_remote_config(config(tmp_path), remote)
    assert not run.checkpoints.exists()


def test_open_remote_rejects_what_it_cannot_use(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"run\.remote=.*cannot create"):
        open_remote(str(blocker), "run")
    with pytest.raises(ConfigError, match=r"run\.remote"):
        load_config(REPO / "configs/tiny.yaml", ["run.remote=s3://bucket/x"])
    with pytest.raises(ConfigError, match=r"run\.remote"):
        load_config(REPO / "configs/tiny.yaml", ["run.remote=b2:///x"])
    with pytest.raises(ConfigError, match=r"run\.remote='b2:/bucket/x' looks like a mistyped URL"):
        load_config(REPO / "configs/tiny.yaml", ["run.remote=b2:/bucket/x"])
    runs = tmp_path / "runs"
    for inside in (runs, runs / "run", runs / "run" / "mirror"):  # the run folder itself, or inside it
        with pytest.raises(ConfigError, match=r"is its own run folder .* \(or inside it, or holds it\)"):
            open_remote(str(inside), "run", run_root=runs / "run")
    open_remote(str(tmp_path / "elsewhere"), "run", run_root=runs / "run")


@pytest.mark.parametrize("damage", [b"{not json", b'{"kept": "nothing"}', b"[]"])
def test_an_unreadable_pointer_is_rebuilt_from_the_listed_checkpoints(remote, tmp_path, damage, caplog):
    run, data = mirrored(tmp_path, remote)
    box_gone(run)
    damaged = tmp_path / "damaged.json"
    damaged.write_bytes(damage)
    remote.upload(LocalFile(damaged, len(damage), sha1_of(damaged)), POINTER)

    pointer = read_pointer(remote)
    assert [e["name"] for e in pointer["kept"]] == [checkpoint_name(20), checkpoint_name(10)]
    assert pointer["kept"][0]["sha1"] == hashlib.sha1(data[20]).hexdigest()
    assert "cannot be read" in caplog.text and "rebuilt from the 2 checkpoint(s)" in caplog.text
    assert restore_run(config(tmp_path), run, remote) == checkpoint_name(20)  # not a fresh start
    assert (run.checkpoints / checkpoint_name(20)).read_bytes() == data[20]


def test_an_unreadable_pointer_without_checkpoints_to_rebuild_it_from_stops_the_launch(tmp_path):
    remote = open_remote(str(tmp_path / "remote"), "run")
    (tmp_path / "remote" / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "remote" / "run" / POINTER).write_text("{broken")
    with pytest.raises(DataError, match=r"lists no checkpoint to rebuild it from\. Nothing was changed"):
        read_pointer(remote)
    assert (tmp_path / "remote" / "run" / POINTER).read_text() == "{broken"


def test_the_pointer_is_json_naming_only_verified_files(tmp_path, b2):
    remote = open_remote("b2://pdebench/runs", "run", b2.api)
    mirrored(tmp_path, remote)
    raw = json.loads(fetched(remote, POINTER, tmp_path))
    assert raw["checkpoint"] == checkpoint_name(20)
    assert {e["name"] for e in raw["kept"]} <= {n.rsplit("/", 1)[-1] for n in remote.names("checkpoints")}


def test_on_several_nodes_node_0_alone_mirrors_the_run_and_a_node_local_folder_sends_its_logs(tmp_path, b2):
    remote = open_remote("b2://pdebench/runs", "run", b2.api)
    own, shared = RunDir(tmp_path / "node1"), RunDir(tmp_path / "shared")
    for run in (own, shared):
        checkpoint(run, 4)  # stale on node 1: rank 0, and with it the run's checkpoints, is on node 0
        run.logs.mkdir(parents=True)
        run.rank_log(1).write_text("rank 1 here\n")
        (run.root / "metrics.jsonl").write_text('{"step": 4}\n')

    assert RunMirror(remote, shared, keep=2, node_rank=1, poll_s=0.01).start().finish(30)
    assert read_pointer(remote) is None and remote.names("") == []
    assert RunMirror(remote, own, keep=2, node_rank=1, node_local=True, poll_s=0.01).start().finish(30)
    assert read_pointer(remote) is None and remote.names("checkpoints") == []
    assert remote.names("") == ["logs/rank1.log"]  # B2 lists the whole prefix: no metrics, no config


def test_a_remote_whose_pointer_names_another_runs_checkpoints_is_refused_and_never_pruned(tmp_path):
    """Run A mirrored here under a config.yaml since lost; run B (another lr) must neither resume from A's
    checkpoints nor prune them: the pointer's identity tags are enough to refuse (exit 2), nothing deleted."""
    from train.config import run_identity

    remote = open_remote(str(tmp_path / "remote"), "run")
    a = config(tmp_path, "train.lr=0.5")
    run = RunDir.of(a)
    run.prepare(a)
    mirror = RunMirror(remote, run, keep=2, identity=run_identity(a), poll_s=0.01).start()
    checkpoint(run, 480)
    wait_until(lambda: pointed(remote)[:1] == [checkpoint_name(480)], "A's checkpoint mirrored")
    assert mirror.finish(30)
    remote.delete("config.yaml")
    box_gone(run)

    b = config(tmp_path)
    assert run_identity(b) != run_identity(a) and run_identity(config(tmp_path, "train.num_workers=3")) == run_identity(
        b
    )
    with pytest.raises(ConfigError, match=r"holds checkpoints of another run \(step_00000480\.pt, tagged .* and no "
                       r"config\.yaml: a launch would prune them\. Nothing was changed"):  # fmt: skip
        check_remote_config(b, remote)
    assert restore_run(b, run, remote) is None  # had the check been skipped: still nothing of A's is taken
    # Nor does a mirror of B, had one been started, delete or carry on A's checkpoint.
    b_run = RunDir.of(b)
    b_run.prepare(b)
    mirror = RunMirror(remote, b_run, keep=2, identity=run_identity(b), poll_s=0.01).start()
    checkpoint(b_run, 10)
    wait_until(lambda: pointed(remote)[:1] == [checkpoint_name(10)], "B's checkpoint mirrored")
    assert mirror.finish(30)
    assert pointed(remote) == [checkpoint_name(10)], "A's entry is not carried on as B's"
    assert remote.stat(f"checkpoints/{checkpoint_name(480)}") is not None, "A's checkpoint is never pruned by B"


def lease_file(remote) -> dict | None:
    from train.remote.lease import LEASE

    return json.loads(remote.path(LEASE).read_text()) if remote.stat(LEASE) is not None else None


def test_a_second_launch_of_a_run_finds_its_remote_leased_and_stops_while_the_first_one_renews(tmp_path):
    from train.errors import PreflightError
    from train.remote.lease import RemoteLease

    remote = open_remote(str(tmp_path / "remote"), "run")
    first = RemoteLease(remote, lease_s=1.5, command="box A").acquire()
    held = lease_file(remote)
    assert held["launch"] == first.launch and held["command"] == "box A"
    wait_until(lambda: lease_file(remote)["beat"] >= 1, "the lease renewed")
    with pytest.raises(PreflightError, match=r"in use by another launch of this run: launch .* \(pid \d+, started"):
        RemoteLease(remote, lease_s=1.5, command="box B").acquire()
    assert lease_file(remote)["launch"] == first.launch, "the refused launch wrote nothing"
    first.release()
    assert lease_file(remote) is None
    with RemoteLease(remote, lease_s=1.5) as second:  # released: taken at once
        assert lease_file(remote)["launch"] == second.launch


def test_a_live_holder_is_never_taken_over_and_its_own_lease_period_is_waited(tmp_path, caplog):
    """A launch with run.remote_lease_s=1 watched 1 s, not the holder's recorded 60, and ignored that the holder
    was a live process of this very host: both trained the run on one remote."""
    import socket
    import subprocess
    import sys

    from train.errors import PreflightError
    from train.remote.lease import LEASE, RemoteLease

    remote = open_remote(str(tmp_path / "remote"), "run")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stat = Path(f"/proc/{holder.pid}/stat").read_text()
        live = {"launch": "held", "host": socket.gethostname(), "pid": holder.pid, "started": "now",
                "command": "python -m train run", "beat": 3, "lease_s": 60.0,
                "pid_start": int(stat[stat.rindex(")") + 2 :].split()[19])}  # fmt: skip
        remote.path(LEASE).write_text(json.dumps(live))
        started = time.monotonic()
        with pytest.raises(PreflightError, match=r"in use by another launch of this run: launch held .* a live "):
            RemoteLease(remote, lease_s=1.0).acquire()
        assert time.monotonic() - started < 1.0 and lease_file(remote) == live
    finally:
        holder.kill()
        holder.wait()
    # Its pid reused by another process (another start time): the launch that wrote the lease is gone.
    remote.path(LEASE).write_text(json.dumps(dict(live, pid=os.getpid())))
    with RemoteLease(remote, lease_s=1.0) as lease:
        assert lease_file(remote)["launch"] == lease.launch
    # Another host's lease is watched for its own period when that is the longer one.
    remote.path(LEASE).write_text(json.dumps(dict(live, host="box-b", lease_s=2.5)))
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    with RemoteLease(remote, lease_s=1.0) as lease:
        assert time.monotonic() - started >= 2.5 and lease_file(remote)["launch"] == lease.launch
    assert "was not renewed for 2 s (run.remote_lease_s): that launch is gone" in caplog.text


def test_an_unreadable_lease_is_said_to_be_one(tmp_path, caplog):
    from train.remote.lease import LEASE, RemoteLease

    remote = open_remote(str(tmp_path / "remote"), "run")
    remote.path(LEASE).write_text("")
    caplog.set_level(logging.INFO)
    with RemoteLease(remote, lease_s=0.5):
        pass
    assert "an unreadable lease file (empty)" in caplog.text and "launch None" not in caplog.text


@pytest.mark.parametrize("host", ["this", "another"])
def test_a_lease_left_by_a_launch_that_died_is_taken_over(tmp_path, host, caplog):
    """A dead process of this host: at once. Another host's silent lease: once it stayed still for
    run.remote_lease_s (its clock is never compared with this one's: a 'renewed' time in the future changes
    nothing)."""
    import socket
    import subprocess
    import sys

    from train.remote.lease import LEASE, RemoteLease

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    remote = open_remote(str(tmp_path / "remote"), "run")
    stale = {"launch": "gone", "host": socket.gethostname() if host == "this" else "box-b", "pid": int(dead.stdout),
             "started": "yesterday", "command": "python -m train run", "beat": 7, "lease_s": 1.0}  # fmt: skip
    remote.path(LEASE).write_text(json.dumps(stale))
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    with RemoteLease(remote, lease_s=2.0) as lease:
        waited = time.monotonic() - started
        assert lease_file(remote)["launch"] == lease.launch
    if host == "this":
        assert waited < 2.0 and "which no longer runs; taking it over" in caplog.text
    else:
        assert waited >= 2.0 and "was not renewed for 2 s (run.remote_lease_s): that launch is gone" in caplog.text


def test_a_launch_whose_lease_was_taken_over_writes_no_pointer_and_deletes_nothing(tmp_path):
    """A launch silent for longer than its lease (a stopped process, a network partition) comes back to a remote
    that another launch took over: its mirror must not move that launch's pointer or prune its checkpoints."""
    from train.remote.lease import LEASE, RemoteLease

    remote = open_remote(str(tmp_path / "remote"), "run")
    run, _ = mirrored(tmp_path, remote)
    lease = RemoteLease(remote, lease_s=1.5).acquire()
    mirror = RunMirror(remote, run, keep=1, poll_s=0.01, lease=lease).start()
    theirs = dict(lease_file(remote), launch="other", host="box-b", beat=0)
    remote.path(LEASE).write_text(json.dumps(theirs))  # box B took the run over
    wait_until(lease.lost.is_set, "the takeover noticed")
    before = pointed(remote)
    checkpoint(run, 30)
    assert not mirror.finish(30)
    assert pointed(remote) == before == [checkpoint_name(20), checkpoint_name(10)]
    assert remote.stat(f"checkpoints/{checkpoint_name(10)}") is not None
    lease.release()
    assert lease_file(remote)["launch"] == "other", "a lost lease is not released: it is another launch's"


def test_a_folder_behind_its_remote_never_moves_the_pointer_back_nor_prunes_the_newer(remote, tmp_path, caplog):
    """Box B holds the run as it was at step 10 while the remote went on to step 20 from box A: its mirror pointed
    the remote back at 10, deleted step 20 and replaced the metrics. Nothing of a folder behind the remote is
    written there; a launch that starts the run over (train.resume=never) leaves the earlier checkpoints alone."""
    import shutil

    run, data = mirrored(tmp_path, remote)  # box A: the remote at step 20
    box_b = RunDir(tmp_path / "box-b" / "run")
    shutil.copytree(run.root, box_b.root)
    (box_b.checkpoints / checkpoint_name(20)).unlink()
    (box_b.root / "metrics.jsonl").write_text('{"step": 10, "loss": 2.0}\n')
    everything = lambda: {n: fetched(remote, n, tmp_path) for n in [*remote.names(""), *remote.names("checkpoints")]}  # noqa: E731
    before = everything()

    mirror = RunMirror(remote, box_b, keep=2, poll_s=0.01).start()
    checkpoint(box_b, 15)  # box B trains on from its own step 10: still behind
    assert not mirror.finish(30)
    assert everything() == before
    assert f"holds {checkpoint_name(20)} of this run, newer than {box_b.root}'s newest" in caplog.text
    assert (
        f"was left as it was: it holds {checkpoint_name(20)}, newer than this folder's newest ({checkpoint_name(15)})"
        in (caplog.text)
    )

    fresh = RunMirror(remote, box_b, keep=2, poll_s=0.01, start_over=True).start()
    assert fresh.finish(30)
    assert pointed(remote) == [checkpoint_name(15)]
    assert fetched(remote, f"checkpoints/{checkpoint_name(20)}", tmp_path) == data[20], "left where it was"


def flip_a_weight_bit(path: Path) -> None:
    """One bit of the newest weights flipped where the file stays a loadable checkpoint (bit rot)."""
    state = torch.load(path, weights_only=True)
    state["model"]["w"].view(torch.int32)[0] ^= 1 << 20
    torch.save(state, path)  # the old payload checksum kept: what a flipped bit on the disk leaves


def test_a_rebuilt_pointer_vouches_for_no_corrupt_bytes_and_is_written_back(tmp_path, caplog):
    from train.config import run_identity
    from train.launch.doctor import check_remote

    remote = open_remote(str(tmp_path / "remote"), "run")
    run, data = mirrored(tmp_path, remote)
    box_gone(run)
    flip_a_weight_bit(remote.path(f"checkpoints/{checkpoint_name(20)}"))
    remote.path(POINTER).write_text("{garbage")
    cfg = config(tmp_path, f"run.remote={tmp_path / 'remote'}")
    assert check_remote(cfg).status == "warn" and "NOT verified" in check_remote(cfg).detail

    assert restore_run(cfg, run, remote) == checkpoint_name(10)  # not the rotten newest
    assert (run.checkpoints / checkpoint_name(10)).read_bytes() == data[10]
    assert not (run.checkpoints / checkpoint_name(20)).exists()
    assert "its payload hashes to" in caplog.text
    assert caplog.text.count("latest.json cannot be read") == 1, "said once, not at every read of the pointer"

    # The launch's mirror checks what the rebuilt pointer lists and writes back a pointer of the intact ones.
    mirror = RunMirror(remote, run, keep=2, identity=run_identity(cfg), poll_s=0.01).start()
    assert mirror.finish(30)
    pointer = json.loads(remote.path(POINTER).read_text())
    assert [e["name"] for e in pointer["kept"]] == [checkpoint_name(10)] and "rebuilt" not in pointer
    assert not any("unverified" in e for e in pointer["kept"])
    assert remote.stat(f"checkpoints/{checkpoint_name(20)}") is not None, "left for inspection, not pruned"
    assert (
        check_remote(cfg).status == "pass" and "newest checkpoint step_00000010.pt verified" in check_remote(cfg).detail
    )
    # A corrupt file behind an intact pointer was called "the newest verified checkpoint" too.
    flip_a_weight_bit(remote.path(f"checkpoints/{checkpoint_name(10)}"))
    check = check_remote(cfg)
    assert check.status == "warn" and re.search(r"step_00000010\.pt has SHA1 \w+, not the \w+ verified", check.detail)


def test_unusable_local_checkpoints_are_replaced_from_the_remote_not_a_reason_to_stop(remote, tmp_path, caplog):
    """Every local checkpoint unreadable with the remote intact ended with exit 3 and advice to delete the
    folder: the launch itself fetches the remote's newest intact one (only one newer than a usable local one)."""
    run, data = mirrored(tmp_path, remote)
    for step in (10, 20):
        path = run.checkpoints / checkpoint_name(step)
        path.write_bytes(path.read_bytes()[:500])  # cut short
    assert restore_run(config(tmp_path), run, remote) == checkpoint_name(20)
    assert (run.checkpoints / checkpoint_name(20)).read_bytes() == data[20]
    assert "step_00000020.pt here cannot be used" in caplog.text
    assert restore_run(config(tmp_path), run, remote) is None  # now the local one is as new as the remote's


def test_a_remotes_invalid_config_is_named_by_its_remote_place_and_a_keys_needs_are_said_in_full(tmp_path, monkeypatch):
    """The error named a deleted temporary copy; a missing B2 key was said to need only to "read" the bucket."""
    from train.errors import PreflightError

    remote = open_remote(str(tmp_path / "remote"), "run")
    remote.path("config.yaml").write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"(?s){re.escape(str(remote.path('config.yaml')))}: not valid YAML.*Fix or "
                       r"delete .*/config\.yaml \(the run's config on its remote\)") as e:  # fmt: skip
        check_remote_config(config(tmp_path), remote)
    assert "/tmp/tmp" not in str(e.value)
    monkeypatch.delenv("B2_APPLICATION_KEY_ID", raising=False)
    monkeypatch.delenv("B2_APPLICATION_KEY", raising=False)
    with pytest.raises(PreflightError, match=r"an application key that can list, read, write and delete files"):
        open_remote("b2://bucket/runs", "run").stat("config.yaml")
