"""The run's remote copy: uploads verified by SHA1, the pointer, keep-k, stale checkpoints skipped, failures
retried and recorded, and a restore that never starts from bytes the pointer does not vouch for. B2 is b2sdk's
in-process RawSimulator (the real SDK's upload, multipart and download paths); a folder remote is a real
folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from b2sdk.v2 import exception as b2_exception

from tests.b2sim import SENTINEL_KEY, Account
from tests.helpers import REPO
from train.checkpoint import checkpoint_name
from train.config import load_config
from train.errors import ConfigError, DataError
from train.obs.sinks import read_metrics
from train.remote import mirror as mirror_module
from train.remote.mirror import POINTER, RunMirror, read_pointer
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
    """A stand-in for a step checkpoint: the mirror moves bytes, it never reads them as a checkpoint."""
    path = run.checkpoints / checkpoint_name(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(os.urandom(size))
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
    caplog.set_level(logging.INFO)
    mirror = RunMirror(remote, run, keep=2, poll_s=0.01).start()
    checkpoint(run, 1, size=300)  # under the simulator's large-file threshold: one upload call per attempt
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


def test_checkpoints_another_run_left_in_the_pointer_are_never_taken_for_this_runs(tmp_path, caplog):
    """Run A mirrored here under a config.yaml since lost; run B (another lr) must not resume from A's."""
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
    assert restore_run(b, run, remote) is None
    assert "lists checkpoints of another run (step_00000480.pt)" in caplog.text
    b_run = RunDir.of(b)
    b_run.prepare(b)
    mirror = RunMirror(remote, b_run, keep=2, identity=run_identity(b), poll_s=0.01).start()
    checkpoint(b_run, 10)
    wait_until(lambda: pointed(remote)[:1] == [checkpoint_name(10)], "B's checkpoint mirrored")
    assert mirror.finish(30)
    assert pointed(remote) == [checkpoint_name(10)], "A's entry is not carried on as B's"
