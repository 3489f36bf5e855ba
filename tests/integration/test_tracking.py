"""W&B tracking in offline mode, read back from the files W&B wrote: the scalars of metrics.jsonl, the report's
plots, and the run's true final state for a success, a stop request (exit 75) and a failure; a resumed run
continues the same W&B run."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest

from tests.farm import fit_argv
from tests.helpers import folders, run_cli
from tests.integration.test_faults import DIVERGING, start, wait_for_step
from tests.wandb_offline import offline_runs
from train.obs.sinks import read_metrics

pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')")
pytestmark = pytest.mark.integration

OFFLINE = ["--set", "obs.wandb.mode=offline", "--set", "obs.wandb.project=tests"]


def run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "wandb.json").read_text())["id"]


def test_a_finished_run_has_the_metrics_scalars_the_report_plots_and_state_finished(tmp_path):
    proc = run_cli("run", "--config", "configs/tiny.yaml", "--nproc", "2", *OFFLINE, *folders(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    (wb,) = offline_runs(run_dir)

    assert wb.id == run_id(run_dir) and wb.exit_code == 0 and not wb.preempting
    assert wb.summary["outcome"] == "finished" and wb.summary["exit_code"] == 0 and "error" not in wb.summary
    assert wb.config["train"]["epochs"] == 2 and wb.config["obs"]["wandb"]["mode"] == "offline"
    rows = {row["_step"]: row for row in wb.history}
    sent = 0
    for record in read_metrics(run_dir / "metrics.jsonl"):
        for key, value in record.items():
            if key not in ("step", "epoch") and isinstance(value, float | int) and not isinstance(value, bool):
                assert rows[record["step"]][key] == pytest.approx(value, rel=1e-12), (record["step"], key)
                sent += 1
    assert sent > 20
    plots = {key.split("/")[1] for key in wb.summary if key.startswith("report/") and key.endswith("/_type")}
    assert plots == {p.stem for p in (run_dir / "report").glob("*.png")} and "loss" in plots


def test_a_failed_run_is_marked_failed_with_its_exit_code_and_first_error_line(tmp_path):
    proc = run_cli("fit", "--config", "configs/tiny.yaml", "--nproc", "2", *DIVERGING, *OFFLINE, *folders(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    (wb,) = offline_runs(tmp_path / "runs" / "tiny")

    assert wb.exit_code == 2 and wb.summary["outcome"] == "failed" and wb.summary["exit_code"] == 2
    assert "training diverged: non-finite gradients at step" in wb.summary["error"]
    assert "\n" not in wb.summary["error"] and wb.summary["error"].startswith("rank ")


def test_a_stopped_run_is_marked_preempted_at_its_step_and_the_rerun_continues_the_same_run(tmp_path):
    at = random.Random().randrange(15, 120)
    proc = start(tmp_path, "run", *OFFLINE)
    run_dir = tmp_path / "runs" / "run"
    wait_for_step(proc, run_dir / "metrics.jsonl", at)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    stopped_at = json.loads((run_dir / "preempted.json").read_text())["global_step"]
    (first,) = offline_runs(run_dir)
    assert first.preempting and first.exit_code == 75
    assert first.summary["outcome"] == "preempted" and first.summary["preempted_at_step"] == stopped_at

    again = run_cli(*fit_argv(tmp_path, "run", *OFFLINE))
    assert again.returncode == 0, again.stderr[-3000:]
    first, second = offline_runs(run_dir)
    assert second.id == first.id == run_id(run_dir)
    assert second.summary["outcome"] == "finished" and second.exit_code == 0
    steps = [row["_step"] for row in first.history] + [row["_step"] for row in second.history]
    assert steps == sorted(steps) and steps[-1] == 160  # the redone steps were not sent a second time
