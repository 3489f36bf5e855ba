"""Data that changes under a run: its caches map the source files where they lie, so a rewritten file is read
as it is now. A run must never continue, be scored, or save a checkpoint on other bytes without a word: exit 3
naming the file and both checksums (train.accept_changed_data goes on), and a file that shrank under the map
is named when the ranks die of SIGBUS, not /dev/shm."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import h5py
import pytest

from tests.helpers import folders, launch_in_background, run_cli, wait_for
from train.checkpoint import list_checkpoints
from train.obs.sinks import read_metrics

pytestmark = pytest.mark.integration

MAPPED = ["--config", "configs/tiny.yaml", "--nproc", "2", "--set", "tasks.advection1d.temporal_stride=1",
          "--set", "train.log_every=1"]  # fmt: skip


def argv(tmp: Path, *extra: str) -> list[str]:
    return [*MAPPED, *folders(tmp), *extra]


def source(tmp: Path) -> Path:
    (path,) = (tmp / "data" / "advection1d").glob("*.hdf5")
    return path


def rewrite(path: Path) -> None:
    """The same file with other values, as a re-generation or a fixed dataset would leave it."""
    with h5py.File(path, "r+") as f:
        f["tensor"][0] = f["tensor"][0] * 2.0 + 1.0


def logged(tmp: Path, step: int) -> bool:
    return any(r.get("step", -1) >= step for r in read_metrics(tmp / "runs" / "tiny" / "metrics.jsonl"))


def test_a_run_refuses_to_continue_on_data_changed_since_its_checkpoints(tmp_path):
    assert run_cli("cache", *argv(tmp_path)).returncode == 0
    long = ["--set", "train.steps_per_epoch=150", "--set", "train.checkpoint_every=10"]  # stopped at step 15
    proc = launch_in_background("fit", *argv(tmp_path, *long))
    wait_for(lambda: logged(tmp_path, 15), "step 15", 240, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    before = sorted(p.name for p in list_checkpoints(tmp_path / "runs" / "tiny" / "checkpoints"))

    rewrite(source(tmp_path))
    for command in ("fit", "evaluate"):  # neither trained further nor scored on the new bytes
        refused = run_cli(command, *argv(tmp_path, *long))
        assert refused.returncode == 3, refused.stderr[-3000:]
        message = refused.stderr.split("error: ", 1)[1]
        assert re.search(rf"was trained on other data than this launch found: task advection1d: {source(tmp_path)} "
                         r"\(xxh3_128 \w{32} then, \w{32} now\)", message), message  # fmt: skip
        assert "train.accept_changed_data=true" in message and "launching" not in refused.stderr
    assert sorted(p.name for p in list_checkpoints(tmp_path / "runs" / "tiny" / "checkpoints")) == before

    accepted = run_cli("fit", *argv(tmp_path, *long, "--set", "train.accept_changed_data=true"))
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert "continuing on the new data (train.accept_changed_data)" in accepted.stderr


@pytest.mark.parametrize("mtime", ["new", "restored"])
def test_a_file_rewritten_while_training_reads_it_is_never_saved_as_trained_on(tmp_path, mtime):
    """The loss went from 1.03 to 256.8 and the checkpoints went on; now the next checkpoint is refused. With its
    size and mtime restored after the rewrite (loss 1.2 -> 1627, exit 0, the old checksum recorded), the file's
    change time still tells."""
    assert run_cli("cache", *argv(tmp_path)).returncode == 0
    proc = launch_in_background("fit", *argv(tmp_path, "--set", "train.steps_per_epoch=400",
                                             "--set", "train.checkpoint_every=20"))  # fmt: skip
    wait_for(lambda: logged(tmp_path, 25), "step 25", 240, proc)
    before = source(tmp_path).stat()
    rewrite(source(tmp_path))
    if mtime == "restored":
        os.utime(source(tmp_path), ns=(before.st_atime_ns, before.st_mtime_ns))
        assert source(tmp_path).stat().st_size == before.st_size
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-3000:]
    assert f"data changed while this run trained on it: {source(tmp_path)} (was rewritten" in err
    steps = [int(p.name[5:13]) for p in list_checkpoints(tmp_path / "runs" / "tiny" / "checkpoints")]
    assert steps and max(steps) <= 40, steps  # none saved after the rewrite was seen


def test_a_file_that_shrank_under_the_map_is_named_when_the_ranks_die_of_sigbus(tmp_path):
    assert run_cli("cache", *argv(tmp_path)).returncode == 0
    proc = launch_in_background("fit", *argv(tmp_path, "--set", "train.steps_per_epoch=400"))
    wait_for(lambda: logged(tmp_path, 10), "step 10", 240, proc)
    os.truncate(source(tmp_path), source(tmp_path).stat().st_size // 3)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 135, err[-3000:]
    assert re.search(rf"rank \d was killed by SIGBUS: a data file read through a memory map changed under it: "
                     rf"{source(tmp_path)} \(shrank: \d+ bytes mapped, \d+ bytes now\)", err), err[-3000:]  # fmt: skip
    assert "/dev/shm" not in err.split("training failed:", 1)[1]
