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
# with code 4: DiskFullError: disk full: ...")
FULL = re.compile(
    r"^(?:error: |  rank \d+ exited with code 4: DiskFullError: )disk full: writing (\S+) needs ([\d.]+ \w+), but "
    r"its file system has ([\d.]+ \w+) free",
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
    # A checkpoint every 2 steps (about 230 KiB each); the disk has room for the first one and the logs only.
    # The doctor is skipped: its disk check would refuse the launch, but no check foresees a disk that others fill.
    args = [*settings(tmp_path), "--set=train.checkpoint_every=2", "--skip-doctor"]
    assert run_cli("cache", *args[:-1]).returncode == 0  # data and caches on the host's disk
    full, _, resumed = probe(
        runs,
        "8m",
        [["fill", str(runs), str(400 << 10)], ["train", "run", *args], ["empty", str(runs)], ["train", "run", *args]],
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
