"""scripts/cloud/onstart.sh, run for real: the box's start script ends with the training's own exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration

ONSTART = REPO / "scripts" / "cloud" / "onstart.sh"
SETTINGS = ("TRAIN_DIR", "TRAIN_COMMAND", "CONFIG", "TRAIN_ARGS", "TRAIN_LOG", "ON_EXIT")


def onstart(tmp: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Run the script from ``cwd`` (as a provider would, from anywhere) with a log inside ``tmp``."""
    inherited = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    full = {**inherited, "PYTHON": sys.executable, "TRAIN_LOG": str(tmp / "logs" / "onstart.log"), **env}
    return subprocess.run([str(ONSTART)], cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


def test_the_script_is_executable():
    assert os.access(ONSTART, os.X_OK)


def test_a_config_error_is_the_scripts_exit_code(tmp_path):
    proc = onstart(tmp_path, tmp_path, CONFIG=str(tmp_path / "missing.yaml"))
    log = tmp_path / "logs" / "onstart.log"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"onstart: training failed with exit code 2 (see {log})"
    assert "succeeded" not in proc.stdout
    text = log.read_text()
    assert "missing.yaml" in text and "not found" in text, "the training's output is in the log"
    assert text.strip().endswith(last)


def test_a_successful_command_exits_0(tmp_path):
    args = " ".join(f"--set run.{d}_dir={tmp_path / d}" for d in ("data", "cache", "runs"))
    proc = onstart(tmp_path, tmp_path, TRAIN_COMMAND="data", CONFIG="configs/tiny.yaml", TRAIN_ARGS=args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "onstart: training succeeded"
    # run from elsewhere with a relative CONFIG: the script found the project by its own location
    assert list((tmp_path / "data").rglob("*.hdf5")), "the data stage ran with the arguments of TRAIN_ARGS"


def test_on_exit_runs_after_the_verdict_and_cannot_change_the_code(tmp_path):
    marker = tmp_path / "hook"
    hook = f'echo "hook saw $TRAIN_EXIT_CODE" > {marker}; exit 9'
    proc = onstart(tmp_path, tmp_path, CONFIG=str(tmp_path / "missing.yaml"), ON_EXIT=hook)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert marker.read_text().strip() == "hook saw 2"
    assert "training failed with exit code 2" in proc.stdout
    assert "ON_EXIT failed with exit code 9" in proc.stderr


def test_train_dir_picks_the_project(tmp_path):
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "mine.yaml").write_text((REPO / "configs" / "tiny.yaml").read_text())
    args = " ".join(f"--set run.{d}_dir={tmp_path / d}" for d in ("data", "cache", "runs"))
    proc = onstart(
        tmp_path, REPO, TRAIN_DIR=str(project), TRAIN_COMMAND="data", CONFIG="configs/mine.yaml", TRAIN_ARGS=args
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "onstart: training succeeded" in proc.stdout
