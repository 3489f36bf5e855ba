"""A full disk is reported as a full disk: exit 4, a line naming the path, the free and the needed space, and
nothing lost; with the doctor skipped, or when the disk fills during the run, which no doctor can foresee.

Each test runs the real command in a private mount namespace (``unshare -m``, root) where one folder is a small
tmpfs; tests/disk_probe.py runs the steps there and lists what the tmpfs held after each one.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, in_namespace_with_tmpfs, mount_namespace_problem, run_cli

pytestmark = pytest.mark.integration

# The launcher's error line ("error: disk full: ..."), or the failing rank's line of its summary ("rank 0 exited
# with code 4: DiskFullError: disk full: ...", or "failed with code 4" when torchrun's SIGTERM then reached the
# rank while it shut down)
FULL = re.compile(
    r"^(?:error: |  rank \d+ (?:exited|failed) with code 4: DiskFullError: )disk full: writing (\S+) needs "
    r"([\d.]+ \w+), but its file system has ([\d.]+ \w+) free",
    re.MULTILINE,
)


@pytest.fixture(scope="module", autouse=True)
def namespace():
    problem = mount_namespace_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the full-disk tests must run in CI, but {problem}")
        pytest.skip(problem)


def probe(mount: Path, size: str, steps: list[list]) -> list[dict]:
    proc = in_namespace_with_tmpfs(
        mount, size, sys.executable, str(REPO / "tests" / "disk_probe.py"), str(mount), json.dumps(steps)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def settings(tmp: Path, **folders: Path) -> list[str]:
    where = {"data_dir": tmp / "data", "cache_dir": tmp / "cache", "runs_dir": tmp / "runs", **folders}
    return ["--config", "configs/tiny.yaml", "--nproc", "2", *(f"--set=run.{k}={v}" for k, v in where.items())]


def no_partial_files(files: dict) -> None:
    partial = [name for name in files if name.endswith(".tmp") or ("/." in f"/{name}" and ".tmp" in name)]
    assert not partial, f"partial files were left: {partial}"


def test_a_disk_that_fills_during_training_ends_with_exit_4_and_keeps_every_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    # A checkpoint every 2 steps (about 230 KiB each); the disk has room for the first one and the logs only. The
    # run folder takes about 170 KiB before it (the ranks' 64 KiB error-file reservations, and a page at least a
    # file): 440 KiB free leaves the first checkpoint tens of KiB to spare and the second no room.
    # The doctor is skipped: its disk check would refuse the launch, but no check foresees a disk that others fill.
    args = [*settings(tmp_path), "--set=train.checkpoint_every=2", "--skip-doctor"]
    assert run_cli("cache", *args[:-1]).returncode == 0  # data and caches on the host's disk
    full, _, resumed = probe(
        runs,
        "8m",
        [["fill", str(runs), str(440 << 10)], ["train", "run", *args], ["empty", str(runs)], ["train", "run", *args]],
    )[1:]
    assert full["returncode"] == 4, full["stderr"]
    match = FULL.search(full["stderr"])
    assert match, full["stderr"]
    path, needed, free = match.groups()
    assert path == str(runs / "tiny" / "checkpoints" / "step_00000004.pt"), path
    assert needed.endswith("KiB") and float(needed.split()[0]) > 150, needed  # the checkpoint's tensors
    assert free.endswith(("KiB", " B")) and float(free.split()[0]) < float(needed.split()[0]), free
    assert "Traceback" not in full["stderr"].split("error:", 1)[1]
    checkpoints = {Path(name).name: entry for name, entry in full["files"].items() if "/checkpoints/" in name}
    assert set(checkpoints) == {"step_00000002.pt"}, checkpoints  # the one written before the disk filled
    no_partial_files(full["files"])

    assert resumed["returncode"] == 0, resumed["stderr"]  # the same command, once there is room again
    assert f"resumed from {runs / 'tiny' / 'checkpoints' / 'step_00000002.pt'}" in resumed["stderr"]


def test_a_disk_that_fills_while_ranks_write_their_shards_ends_with_exit_4_and_keeps_the_one_before(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    # fsdp on 2 ranks, a sharded checkpoint (about 580 KiB: two shards, DCP's metadata) every 2 steps; room for one.
    args = [*settings(tmp_path), "--set=dist.parallel=fsdp", "--set=train.checkpoint_every=2", "--skip-doctor"]
    assert run_cli("cache", *args[:-2]).returncode == 0
    full, _, resumed = probe(
        runs,
        "8m",
        [["fill", str(runs), str(1000 << 10)], ["train", "fit", *args], ["empty", str(runs)], ["train", "fit", *args]],
    )[1:]
    assert full["returncode"] == 4, full["stderr"]
    match = FULL.search(full["stderr"])
    assert match, full["stderr"]
    assert match.group(1) == str(runs / "tiny" / "checkpoints" / "step_00000004.dcp"), match.group(1)
    assert "Traceback" not in full["stderr"].split("error:", 1)[1]
    kept = {Path(name).parts[-2] for name in full["files"] if "/checkpoints/" in name}
    assert kept == {"step_00000002.dcp"}, kept  # the folder written before the disk filled, and nothing partial
    assert not [name for name in full["files"] if ".partial" in name]

    assert resumed["returncode"] == 0, resumed["stderr"]
    assert f"resumed from {runs / 'tiny' / 'checkpoints' / 'step_00000002.dcp'}" in resumed["stderr"]


def test_a_cache_build_on_a_full_disk_ends_with_exit_4_not_sigbus(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    args = settings(tmp_path)
    assert run_cli("data", *args).returncode == 0
    (result,) = probe(cache, "160k", [["train", "cache", *args]])  # the advection cache alone needs 240 KiB
    assert result["returncode"] == 4, result["stderr"]  # it was 135: SIGBUS through the memory map
    match = FULL.search(result["stderr"])
    assert match, result["stderr"]
    assert Path(match.group(1)).name.endswith(".npy") and str(cache) in match.group(1)
    assert not any(name.endswith("manifest.json") for name in result["files"]), "an incomplete cache looks complete"
    assert not any(".tmp" in name for name in result["files"]), result["files"]


def test_data_generation_on_a_full_disk_ends_with_exit_4(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (result,) = probe(data, "1m", [["train", "data", *settings(tmp_path)]])  # the advection file is 2 MiB
    assert result["returncode"] == 4, result["stderr"]
    match = FULL.search(result["stderr"])
    assert match, result["stderr"]
    path, needed, _ = match.groups()
    assert Path(path).parent == data / "advection1d" and path.endswith(".hdf5"), path
    assert needed.endswith("MiB") and float(needed.split()[0]) >= 1.5, needed
    assert "Traceback" not in result["stderr"]
    assert not any(name.endswith(".hdf5") for name in result["files"]), "a half-written file under its final name"
    no_partial_files(result["files"])


def test_a_disk_full_for_seconds_under_tensorboards_writer_ends_training_with_exit_4_and_never_hangs(tmp_path):
    """TensorBoard's writer thread died on a full disk and the next add_scalar blocked forever on its queue: the
    step never ended and the stop flag was never read (3 of 5 tries of a 3-second outage). The disk that fills
    here is the TensorBoard folder's alone, so no other write meets it first; every sink now writes in the step."""
    runs = tmp_path / "runs"
    events = runs / "tiny" / "tensorboard"
    events.mkdir(parents=True)
    args = [*settings(tmp_path), "--set=train.steps_per_epoch=600", "--set=train.log_every=1",
            "--set=train.checkpoint_every=100", "--skip-doctor"]  # fmt: skip
    assert run_cli("cache", *args[:-1]).returncode == 0  # data and caches on the host's disk
    metrics = runs / "tiny" / "metrics.jsonl"
    (result,) = probe(events, "8m", [["outage", str(events), str(metrics), "120", "3", "120", "fit", *args]])
    assert result["full_at_step"] >= 120, result
    assert result["returncode"] == 4, result["stderr"]  # None: it hung past the timeout
    assert re.search(rf"disk full: writing {events}/events\.out\.tfevents\.\S+ needs", result["stderr"]), result[
        "stderr"
    ]
    assert (runs / "tiny" / "checkpoints" / "step_00000100.pt").is_file(), "the checkpoint before it stays"


def test_a_launch_that_leaves_its_remote_behind_exits_4_not_0(tmp_path):
    """Training succeeded but the remote (a full disk) lacks its checkpoints: exit 0 with warnings let a scheduler
    give the box back, and with it the only copy. Now exit 4, the run intact locally, and a re-run sends the rest."""
    remote = tmp_path / "remote"
    remote.mkdir()
    args = [*settings(tmp_path), f"--set=run.remote={remote}", "--set=run.remote_wait_s=5"]
    assert run_cli("cache", *args).returncode == 0
    (behind,) = probe(remote, "64k", [["train", "run", *args]])  # room for the config, not for a checkpoint
    assert behind["returncode"] == 4, behind["stderr"]
    said = behind["stderr"]
    assert re.search(rf"error: remote: {remote}/tiny does not hold all of {tmp_path}/runs/tiny \(the warnings above "
                     r"say what is missing and why\); nothing is lost here", said), said  # fmt: skip
    assert re.search(r"lacks step_00000010\.pt \((its last upload|not sent: the uploads before it) failed.*the "
                     r"remote's disk is full", said), said  # fmt: skip
    assert (tmp_path / "runs" / "tiny" / "report" / "summary.json").is_file()
    caught_up = run_cli("run", *args)  # the remote has room again (the tmpfs is gone with its namespace)
    assert caught_up.returncode == 0 and "launching" not in caught_up.stderr, caught_up.stderr[-3000:]


def test_a_folder_this_machine_cannot_write_is_exit_4_naming_its_setting(tmp_path):
    """A read-only run.data_dir, run.cache_dir or run.runs_dir was exit 1 with an OSError traceback while the
    doctor said PASS; predict's --output there was found only after every prediction was computed."""
    import h5py
    import numpy as np

    from tests.unit.test_use import ADV, _checkpoint
    from train.config import to_yaml

    ro = tmp_path / "ro"  # a read-only file system in the namespace
    ro.mkdir()
    source, _, cfg = _checkpoint(tmp_path, "fno", {"adv": ADV})
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    source.rename(run / "checkpoints" / "best.pt")
    with h5py.File(tmp_path / "adv.h5", "w") as f:
        f["tensor"] = np.zeros((2, 8, 32), np.float32)
    predict = ["predict", "--run", str(run), "--input", str(tmp_path / "adv.h5")]
    steps = [
        ["train", "run", *settings(tmp_path, **{name: ro / name})] for name in ("data_dir", "cache_dir", "runs_dir")
    ]
    steps += [["train", "doctor", *settings(tmp_path, cache_dir=ro / "cache")]]
    steps += [["train", *predict, "--output", str(ro / "pred.h5")]]
    steps += [["train", *predict, "--output", str(tmp_path / "p.h5"), "--batch-size", "0"]]
    results = probe(ro, "1m,ro", steps)
    for name, result in zip(("data_dir", "cache_dir", "runs_dir"), results, strict=False):
        assert result["returncode"] == 4, result["stderr"]
        assert f"error: cannot write run.{name}={ro / name}: Read-only file system" in result["stderr"]
        assert "Traceback" not in result["stderr"]
    doctor, unwritable, zero = results[3:]
    assert doctor["returncode"] == 4 and re.search(r"FAIL\s+folders\s+cannot write run\.cache_dir=", doctor["stdout"])
    assert unwritable["returncode"] == 4, unwritable["stderr"]
    assert f"--output {ro / 'pred.h5'}: cannot write in {ro} (Read-only file system)" in unwritable["stderr"]
    assert zero["returncode"] == 2 and "argument --batch-size: '0' is not a whole number >= 1" in zero["stderr"]
