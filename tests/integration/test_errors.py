"""Bad inputs end in a clear message and the documented exit code, through the CLI, torchrun and make."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import write_yaml
from tests.helpers import REPO, folders, run_cli

pytestmark = pytest.mark.integration


def test_unknown_key_exits_2_naming_the_key(tmp_path):
    proc = run_cli("data", "--config", "configs/tiny.yaml", "--set", "train.epoch=3", *folders(tmp_path))
    assert proc.returncode == 2
    assert "train.epoch" in proc.stderr and "train.epochs" in proc.stderr
    assert not (tmp_path / "data").exists(), "nothing may run after a config error"


def test_wrong_type_in_yaml_exits_2(tmp_path):
    cfg = write_yaml(tmp_path / "bad.yaml", "tasks:\n  a:\n    pde: advection1d\n    batch_size: many\n")
    proc = run_cli("run", "--config", str(cfg), *folders(tmp_path))
    assert proc.returncode == 2
    assert "tasks.a.batch_size" in proc.stderr


def test_missing_config_file_exits_2(tmp_path):
    proc = run_cli("run", "--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert "nope.yaml" in proc.stderr and "not found" in proc.stderr


@pytest.mark.parametrize("command", ["doctor", "run"])
def test_a_process_count_that_is_no_number_is_a_usage_error(tmp_path, command):
    proc = run_cli(command, "--config", "configs/tiny.yaml", "--nproc", "abc", *folders(tmp_path))
    assert proc.returncode == 2, proc.stderr  # it was 4, as if the machine were at fault
    assert "--nproc: 'abc' is not a process count: use auto or a number >= 1" in proc.stderr
    assert not (tmp_path / "data").exists()


def test_missing_data_file_exits_3(tmp_path):
    cfg = write_yaml(tmp_path / "c.yaml", f"tasks:\n  a:\n    pde: advection1d\n    source: {tmp_path}/missing.hdf5\n")
    proc = run_cli("run", "--config", str(cfg), *folders(tmp_path))
    assert proc.returncode == 3
    assert "missing.hdf5" in proc.stderr and "tasks.a.source" in proc.stderr


def test_patch_size_that_does_not_fit_the_grid_exits_2(tmp_path):
    proc = run_cli("run", "--config", "configs/tiny.yaml", "--set", "tasks.darcy2d.patch_size=5", *folders(tmp_path))
    assert proc.returncode == 2
    assert "tasks.darcy2d.patch_size" in proc.stderr


def test_an_error_inside_the_ranks_keeps_its_exit_code_through_torchrun(tmp_path):
    # A learning rate this large turns the loss into Inf/NaN: every rank agrees and stops with a config error.
    proc = run_cli(
        "run", "--config", "configs/tiny.yaml", "--nproc", "2", "--set", "train.lr=1e30",
        "--set", "train.grad_clip=0", *folders(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "non-finite" in proc.stderr and "train.lr" in proc.stderr
    assert "rank" in proc.stderr


def test_make_prints_the_underlying_exit_code(tmp_path):
    proc = subprocess.run(
        ["make", "--no-print-directory", "train", "CONFIG=configs/tiny.yaml", "SET=train.epoch=3"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "exited with code 2" in proc.stderr
    assert "train.epoch" in proc.stderr


def test_a_run_whose_every_checkpoint_is_unreadable_stops_with_exit_3_and_keeps_them(tmp_path):
    """Before, the run silently started over from step 0 and exited 0."""
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_00000005.pt").write_bytes(b"not a checkpoint")
    (checkpoints / "step_00000010.pt").write_bytes(b"")
    proc = run_cli("fit", "--config", "configs/tiny.yaml", *folders(tmp_path))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"every checkpoint in {checkpoints} is unreadable" in proc.stderr and "launching" not in proc.stderr
    assert len(list((checkpoints / "corrupt").iterdir())) == 2
