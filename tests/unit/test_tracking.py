"""The W&B tracker's launcher-side pieces: the outcome of a launch from how it ended, and the config error
without the wandb package."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO
from train.config import load_config
from train.errors import ConfigError, DataError, Preempted, StopRequested
from train.launch.torchrun import WorkerFailure
from train.obs.tracking import check_tracking, outcome_of


def test_without_the_wandb_package_a_wandb_mode_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without the extra imports
    check_tracking(load_config(REPO / "configs/tiny.yaml"))  # disabled by default: no import at all
    with pytest.raises(ConfigError, match=r"obs\.wandb\.mode=offline needs the wandb package.*\[wandb\]"):
        check_tracking(load_config(REPO / "configs/tiny.yaml", ["obs.wandb.mode=offline"]))


def test_the_outcome_names_the_state_the_exit_code_and_the_first_error_line():
    assert outcome_of(None) == outcome_of(None).__class__("finished", 0)
    assert (outcome_of(Preempted("stopped")).state, outcome_of(Preempted("x")).exit_code) == ("preempted", 75)
    assert outcome_of(StopRequested("stopped")).state == "preempted"
    failure = WorkerFailure(3, "training failed:\n  rank 1 exited with code 3: DataError: bad file\n  per-rank logs: x")
    failed = outcome_of(failure)
    assert (failed.state, failed.exit_code, failed.error) == (
        "failed",
        3,
        "rank 1 exited with code 3: DataError: bad file",
    )
    assert outcome_of(DataError("no such file\nmore")).error == "no such file"
    assert outcome_of(RuntimeError("boom")) == failed.__class__("failed", 1, "RuntimeError: boom")
    assert outcome_of(KeyboardInterrupt()).exit_code == 130
