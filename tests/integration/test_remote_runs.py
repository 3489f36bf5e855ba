"""Runs that outlive their machine: real torchrun launches mirrored to a folder remote and to b2sdk's simulated
bucket, stopped by real signals, their machine "lost" (run folder, caches and data deleted), and resumed from
the remote to weights bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path

import pytest

from tests.b2sim import SENTINEL_KEY, Account
from tests.farm import VARIANTS, final_weights, fit_argv
from tests.helpers import REPO, assert_bitwise_equal, folders, launch_in_background, run_cli, wait_for
from tests.integration.test_faults import start, wait_for_step
from train.checkpoint import checkpoint_name, latest_checkpoint, shards
from train.config import load_config
from train.errors import Preempted
from train.launch.stop import stop_on_signals
from train.obs.sinks import read_metrics
from train.pipeline import run_stages
from train.remote import mirror as mirror_module
from train.remote.pointer import read_pointer
from train.remote.store import open_remote, sha1_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reference(farm) -> dict:
    """The final weights of the uninterrupted run, without any remote (the farm's)."""
    return farm.reference("one_step")


def lose_the_machine(tmp: Path) -> None:
    """The run folder, the caches and the data (test_faults' folders(tmp)) go with the machine."""
    for folder in ("runs", "data", "cache"):
        shutil.rmtree(tmp / folder)


# fsdp alone: its checkpoint, a folder of every rank's shards, takes every step a single file does and more; a
# replicated model's stop and resume from the remote on new machines is the multinode tier's (two tests).
@pytest.mark.parametrize("variant", ["fsdp"])
def test_sigterm_leaves_its_checkpoint_on_the_remote_and_a_new_machine_resumes_bitwise(tmp_path, farm, variant):
    """Under fsdp the checkpoint is a folder of every rank's shards: the mirror sends it packed as one file,
    verified, and the new machine unpacks it, checked against its manifest, before the ranks read their shards."""
    reference = farm.reference(variant)
    remote_dir = tmp_path / "shared"
    argv = ["--set", f"run.remote={remote_dir}", *VARIANTS[variant]]
    at = random.Random().randrange(15, 120)
    print(f"SIGTERM to the job at step {at}")
    proc = start(tmp_path / "box", "run", *argv)
    run_dir = tmp_path / "box" / "runs" / "run"
    wait_for_step(proc, run_dir / "metrics.jsonl", at)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)

    assert proc.returncode == 75, err[-4000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    saved = checkpoint_name(marker["global_step"], sharded=variant == "fsdp")
    remote = open_remote(str(remote_dir), "run")
    pointer = read_pointer(remote)  # read after the launcher exited: it waited for this upload
    assert pointer["checkpoint"] == saved, (pointer, err[-3000:])
    local, mirrored = run_dir / "checkpoints" / saved, remote.path(f"checkpoints/{saved}")
    if variant == "fsdp":  # what was sent: the folder packed as one file
        shards.pack(local, tmp_path / "packed")
        local = tmp_path / "packed"
    assert pointer["kept"][0]["sha1"] == sha1_of(local) == sha1_of(mirrored)
    assert f"remote: {remote.url} holds the run up to {saved}, verified" in err
    assert remote.stat("logs/rank0.log") is not None

    lose_the_machine(tmp_path / "box")
    again = run_cli(*fit_argv(tmp_path / "box", "run", *argv))
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"remote: resuming from {saved}, fetched from {remote.url}" in again.stderr
    assert_bitwise_equal(final_weights(run_dir), reference)


def in_process_config(tmp: Path, remote: str):
    """The config fit_argv(tmp, 'run') loads, with a remote."""
    overrides = [a for a in fit_argv(tmp, "run") if "=" in a]
    return load_config(REPO / "configs/tiny.yaml", [*overrides, f"run.remote={remote}"], run_name="run")


def test_b2_mirror_survives_failing_uploads_and_a_corrupt_checkpoint_is_never_resumed_from(
    tmp_path, reference, monkeypatch, caplog
):
    account = Account(monkeypatch)
    monkeypatch.setattr(mirror_module, "BACKOFF_S", 0.01)
    monkeypatch.setattr(mirror_module, "POLL_S", 0.05)
    account.sim.MIN_PART_SIZE = 100_000  # checkpoints still go up in parts, a few of them (B2's is 5 MB)
    # The first uploads fail (whichever file they carry: the lease's claim, then the mirror's first file, tried
    # ATTEMPTS times): training must not notice, a later upload gets through. No renewal of the lease in between.
    from b2sdk.v2 import exception as b2_exception

    account.sim.set_upload_errors([b2_exception.StorageCapExceeded() for _ in range(mirror_module.ATTEMPTS + 1)])
    cfg = in_process_config(tmp_path, "b2://pdebench/runs")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"remote_lease_s": 600.0})})
    run_dir = tmp_path / "runs" / "run"
    at = random.Random().randrange(20, 80)  # the stop also waits for a checkpoint on the remote

    remote = open_remote("b2://pdebench/runs", "run", account.api)

    def stop_at_step():  # a real SIGTERM to this process, which runs the launcher (and torchrun's agent)
        try:
            wait_for_metrics_step(run_dir / "metrics.jsonl", at)
            # ... once the remote holds a checkpoint older than the one the stop writes
            wait_for(lambda: (read_pointer(remote) or {}).get("checkpoint"), "a checkpoint on the remote", 240)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_at_step, daemon=True)
    stopper.start()
    with stop_on_signals(), pytest.raises(Preempted):
        run_stages(cfg, "fit", 2, b2_api=account.api)
    stopper.join()

    failed = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "remote_upload_failed"]
    assert failed and "storage cap" in failed[0]["error"].lower(), failed
    assert "could not claim b2://pdebench/runs/run/lease.json" in caplog.text and "the launch goes on" in caplog.text
    pointer = read_pointer(remote)
    local = latest_checkpoint(run_dir / "checkpoints")
    assert pointer["checkpoint"] == local.name and pointer["kept"][0]["sha1"] == sha1_of(local)
    assert len(pointer["kept"]) == 2, pointer
    assert SENTINEL_KEY not in caplog.text + "".join(p.read_text() for p in (run_dir / "logs").rglob("*.log"))

    lose_the_machine(tmp_path)
    # The newest remote checkpoint replaced by other bytes (a valid B2 upload): only the pointer knows better.
    account.bucket.upload_bytes(os.urandom(5000), f"runs/run/checkpoints/{pointer['checkpoint']}")
    caplog.clear()
    caplog.set_level(logging.INFO)
    run_stages(in_process_config(tmp_path, "b2://pdebench/runs"), "fit", 2, b2_api=account.api)

    older = pointer["kept"][1]["name"]
    assert f"{pointer['checkpoint']} is not used" in caplog.text
    assert f"remote: resuming from {older}" in caplog.text
    assert_bitwise_equal(final_weights(run_dir), reference)
    assert read_pointer(remote)["checkpoint"] == checkpoint_name(160)


def wait_for_metrics_step(metrics: Path, step: int, timeout: float = 240) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [r for r in read_metrics(metrics) if "loss" in r]
        if lines and lines[-1]["step"] >= step:
            return
        time.sleep(0.005)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def test_a_launch_never_writes_to_a_remote_that_holds_another_run(tmp_path):
    """train.resume=never (or local checkpoints) skipped the check: the mirror replaced the other run's config
    and pruned its checkpoints."""
    from train.config import to_yaml

    theirs = tmp_path / "remote" / "tiny"
    (theirs / "checkpoints").mkdir(parents=True)
    other = load_config(REPO / "configs/tiny.yaml", ["train.lr=0.5"], run_name="tiny")
    (theirs / "config.yaml").write_text(to_yaml(other))
    (theirs / "checkpoints" / checkpoint_name(480)).write_bytes(os.urandom(100))
    before = {p: p.read_bytes() for p in theirs.rglob("*") if p.is_file()}
    for resume in ("never", "auto"):
        proc = run_cli("fit", "--config", "configs/tiny.yaml", "--set", f"train.resume={resume}",
                       "--set", f"run.remote={tmp_path / 'remote'}", *folders(tmp_path))  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "holds a run with a different config (train.lr)" in proc.stderr
    assert {p: p.read_bytes() for p in theirs.rglob("*") if p.is_file()} == before


def test_a_remote_inside_the_run_folder_is_refused_before_anything_runs(tmp_path):
    runs = tmp_path / "runs"
    proc = run_cli("fit", "--config", "configs/tiny.yaml", "--set", f"run.remote={runs}", *folders(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "is its own run folder" in proc.stderr and not (tmp_path / "data").exists()


def test_a_remote_that_fell_behind_catches_up_by_push_and_by_any_relaunch(tmp_path, farm):
    """A finished run whose remote got nothing (here: none was set; an unreachable or full one ends the same):
    `push` sends it, and a relaunch with nothing left to train brings another remote up to date as well."""
    farm.tiny(into=tmp_path)  # a finished tiny run
    for how, remote in (("push", tmp_path / "pushed"), ("run", tmp_path / "caught-up")):
        proc = run_cli(how, "--config", "configs/tiny.yaml", "--set", f"run.remote={remote}", *folders(tmp_path))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "launching" not in proc.stderr
        pointer = read_pointer(open_remote(str(remote), "tiny"))
        assert pointer["checkpoint"] == checkpoint_name(10), how
        assert (remote / "tiny" / "report" / "summary.json").is_file() and (remote / "tiny" / "metrics.jsonl").is_file()
    nowhere = run_cli("push", "--config", "configs/tiny.yaml", *folders(tmp_path))
    assert nowhere.returncode == 2 and "push needs run.remote" in nowhere.stderr


def test_push_from_a_box_behind_the_remote_is_refused_and_changes_nothing(tmp_path, farm):
    """Box A finished the run (its remote at step 10); box B, holding the run folder as it was at step 5, pushed
    with the same config: exit 0, the remote's step 10 deleted, its pointer back at 5, metrics and logs replaced."""
    remote = tmp_path / "shared"
    box_a, box_b = tmp_path / "a", tmp_path / "b"
    farm.tiny(into=box_a)
    pushed = run_cli("push", "--config", "configs/tiny.yaml", "--set", f"run.remote={remote}", *folders(box_a))
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    shutil.copytree(box_a, box_b)
    run_b = box_b / "runs" / "tiny"
    (run_b / "checkpoints" / checkpoint_name(10)).unlink()
    metrics = (run_b / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_b / "metrics.jsonl").write_text("".join(metrics[: len(metrics) // 2]))
    before = {p: p.read_bytes() for p in remote.rglob("*") if p.is_file()}

    behind = run_cli("push", "--config", "configs/tiny.yaml", "--set", f"run.remote={remote}", *folders(box_b))
    assert behind.returncode == 4, behind.stderr[-3000:]
    assert f"holds {checkpoint_name(10)} of this run, newer than {run_b}'s newest ({checkpoint_name(5)})" in (
        behind.stderr
    )
    assert "Nothing was changed" in behind.stderr and "python -m train run" in behind.stderr
    assert {p: p.read_bytes() for p in remote.rglob("*") if p.is_file()} == before


def test_one_run_is_written_to_its_remote_by_one_launch_at_a_time(tmp_path):
    """push during a launch deleted the launch's staging folder and silently stopped its mirror; a second box's
    launch of the run pruned the first's checkpoints and moved the pointer back to its own older step."""
    remote = tmp_path / "shared"
    run = ["--set", f"run.remote={remote}", "--set", "run.remote_lease_s=3", "--set", "train.epochs=1",
           "--set", "train.steps_per_epoch=5000", "--set", "train.checkpoint_every=20"]  # fmt: skip
    box_a, box_b = tmp_path / "a", tmp_path / "b"
    a = launch_in_background("fit", "--config", "configs/tiny.yaml", *run, *folders(box_a))
    store = open_remote(str(remote), "tiny")
    wait_for(lambda: (read_pointer(store) or {}).get("checkpoint"), "box A's first checkpoint on the remote", 240, a)

    pushed = run_cli("push", "--config", "configs/tiny.yaml", *run, *folders(box_a))
    assert pushed.returncode == 4 and "is in use by another launch" in pushed.stderr, pushed.stderr[-3000:]
    second = run_cli("fit", "--config", "configs/tiny.yaml", *run, *folders(box_b))
    assert second.returncode == 4, second.stderr[-3000:]
    assert re.search(r"is in use by another launch of this run: launch \w+ on host \S+ \(pid \d+", second.stderr)
    assert not list((box_b / "runs" / "tiny" / "checkpoints").glob("*.pt")), "box B restored nothing"
    assert json.loads((remote / "tiny" / "lease.json").read_text())["pid"] == a.pid, "box A's lease is intact"

    os.killpg(a.pid, signal.SIGTERM)
    _, err = a.communicate(timeout=300)
    assert a.returncode == 75, err[-3000:]
    stopped_at = latest_checkpoint(box_a / "runs" / "tiny" / "checkpoints").name
    assert read_pointer(store)["checkpoint"] == stopped_at, "box A's mirror went on to the end"
    assert f"remote: {store.url} holds the run up to {stopped_at}, verified" in err
    assert not (remote / "tiny" / "lease.json").exists(), "released when box A's launch ended"
    taken = run_cli("evaluate", "--config", "configs/tiny.yaml", *run, *folders(box_b))  # box B takes the run over
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert f"remote: resuming from {stopped_at}, fetched from {store.url}" in taken.stderr
    assert (remote / "tiny" / "report" / "summary.json").is_file() and read_pointer(store)["checkpoint"] == stopped_at
