"""Trainer features through the CLI and torchrun (2 gloo ranks): early stopping, resume policies, accumulation
and weighted task sampling end to end."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers import folders, run_cli
from train.checkpoint import BEST, MODEL, latest_checkpoint, list_checkpoints, load_checkpoint
from train.obs.sinks import read_metrics

pytestmark = pytest.mark.integration

TINY = ["--config", "configs/tiny.yaml", "--nproc", "2"]


def test_early_stopping_stops_every_rank_at_the_same_step_and_evaluates_the_best(tmp_path):
    # min_delta so large that only the first validation improves: stop after 2 more, at step 6 of 10.
    proc = run_cli(
        "run", *TINY, *folders(tmp_path), "--set", "train.val_every=2", "--set", "train.early_stop_patience=2",
        "--set", "train.early_stop_min_delta=1e9",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "tiny"
    stops = [re.findall(r"early stop at step (\d+)", (run / "logs" / f"rank{r}.log").read_text()) for r in range(2)]
    assert stops == [["6"], ["6"]]
    progress = load_checkpoint(latest_checkpoint(run / "checkpoints"))["progress"]
    assert progress["early_stopped"] and progress["global_step"] == 6
    assert load_checkpoint(run / "checkpoints" / BEST)["progress"]["global_step"] == 2
    assert "Checkpoint: `best.pt`" in (run / "report" / "summary.md").read_text()
    # A finished run is not trained again.
    again = run_cli("fit", *TINY, *folders(tmp_path), "--set", "train.val_every=2", "--set",
                    "train.early_stop_patience=2", "--set", "train.early_stop_min_delta=1e9")  # fmt: skip
    assert again.returncode == 0 and "launching" not in again.stderr


def test_resume_never_archives_and_a_path_must_match_the_model(tmp_path, farm):
    farm.tiny(into=tmp_path)  # a trained tiny run
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())

    fresh = run_cli("fit", *TINY, *folders(tmp_path), "--set", "train.resume=never")
    assert fresh.returncode == 0, fresh.stderr[-4000:]
    assert "resumed from" not in fresh.stderr
    (archive,) = checkpoints.glob("archive-*")
    assert sorted(p.name for p in archive.iterdir()) == before

    source = latest_checkpoint(checkpoints)
    other = ["--run", "wider", "--set", f"train.resume={source}"]
    bad = run_cli("fit", *TINY, *folders(tmp_path), *other, "--set", "model.d_model=48", "--set", "model.n_layers=2")
    assert bad.returncode == 2
    assert "cannot resume from" in bad.stderr
    assert (
        "model.transformer.d_model (32 there, 48 here)" in bad.stderr
        and "model.transformer.n_layers (1 there, 2 here)" in bad.stderr
    )
    assert not list_checkpoints(tmp_path / "runs" / "wider" / "checkpoints")

    good = run_cli("fit", *TINY, *folders(tmp_path), "--run", "continued", "--set", f"train.resume={source}",
                   "--set", "train.epochs=3")  # fmt: skip
    assert good.returncode == 0, good.stderr[-4000:]
    assert f"resumed from {source}" in good.stderr
    progress = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "continued" / "checkpoints"))["progress"]
    assert progress["global_step"] == 15 and progress["epoch"] == 3


def test_weighted_sampling_with_accumulation_trains_and_logs_every_task(tmp_path):
    proc = run_cli(
        "run", *TINY, *folders(tmp_path), "--set", "train.task_sampling=weighted", "--set", "train.accumulate_steps=2",
        "--set", "tasks.darcy2d.sampling_weight=3", "--set", "train.log_every=5",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "one drawn per rank and step" in proc.stderr and "x 2 micro-batch(es)" in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert all(r["loss/darcy2d"] is not None for r in train_records)


def test_a_checkpoint_whose_name_is_not_the_step_it_records_is_set_aside(tmp_path, farm):
    """step_5 renamed step_12 (or a consolidated best saved under a step's name) became the newest checkpoint and
    resumed as "global step 5" without a word."""
    farm.tiny(into=tmp_path)
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    (checkpoints / "step_00000005.pt").rename(checkpoints / "step_00000012.pt")
    again = run_cli("fit", *TINY, *folders(tmp_path))
    assert again.returncode == 0, again.stderr[-4000:]
    assert "it records global step 5, but its name says step 12" in again.stderr
    assert "already holds 2 trained epochs" in again.stderr and "launching" not in again.stderr  # step 10's
    assert load_checkpoint(latest_checkpoint(checkpoints))["progress"]["global_step"] == 10
    assert [p.name[:16] for p in (checkpoints / "corrupt").iterdir()] == ["step_00000012.pt"]


def test_an_unreadable_checkpoint_is_set_aside_and_the_run_goes_on_from_the_newest_readable_one(tmp_path, farm):
    farm.tiny(into=tmp_path)  # a trained tiny run: checkpoints at steps 5 and 10, and best.pt
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    newest = checkpoints / "step_00000010.pt"
    straight = load_checkpoint(newest)[MODEL]
    cut = newest.read_bytes()[: newest.stat().st_size // 2]
    newest.write_bytes(cut)  # cut short, as a full disk or an interrupted copy leaves a file

    again = run_cli("fit", *TINY, *folders(tmp_path))
    assert again.returncode == 0, again.stderr[-4000:]  # it was exit 3: "delete it"
    assert "checkpoint step_00000010.pt cannot be read" in again.stderr
    assert "Continuing from the one before it (step_00000005.pt)" in again.stderr
    assert f"resumed from {checkpoints / 'step_00000005.pt'}" in again.stderr
    (kept,) = (checkpoints / "corrupt").glob("step_00000010.pt.*")
    assert kept.read_bytes() == cut  # moved aside, never deleted
    redone = load_checkpoint(newest)[MODEL]
    assert all(torch.equal(redone[k], straight[k]) for k in straight)  # the same step 10, trained again

    (checkpoints / BEST).write_bytes(b"not a checkpoint")
    scored = run_cli("evaluate", *TINY, *folders(tmp_path))
    assert scored.returncode == 0, scored.stderr[-4000:]
    assert "best.pt cannot be read" in scored.stderr
    assert "evaluation scores the newest step checkpoint (step_00000010.pt) instead" in scored.stderr
    assert "delete" not in scored.stderr
    assert len(list((checkpoints / "corrupt").glob("best.pt.*"))) == 1
    assert "Checkpoint: `step_00000010.pt`" in (tmp_path / "runs" / "tiny" / "report" / "summary.md").read_text()


def test_a_run_whose_model_ends_non_finite_exits_2_and_its_skipped_steps_are_logged_as_skipped(tmp_path):
    """lr 1e37 with train.on_nonfinite=skip: every step after the first skipped within max_skipped_steps, the test
    metrics NaN; it exited 0, logged each skipped window as "loss": 0 and failed inside its closing log lines."""
    argv = [*TINY, *folders(tmp_path), "--set", "train.lr=1e37", "--set", "train.on_nonfinite=skip",
            "--set", "train.max_skipped_steps=1000", "--set", "train.log_every=1"]  # fmt: skip
    for attempt in ("trains", "finds it trained"):
        proc = run_cli("run", *argv)
        assert proc.returncode == 2, (attempt, proc.stderr[-4000:])
        assert "training diverged: the test metrics of" in proc.stderr and "are not finite" in proc.stderr
        assert "Logging error" not in proc.stderr and "Traceback" not in proc.stderr
    assert "test nRMSE n/a" in proc.stderr
    records = [r for r in read_metrics(tmp_path / "runs" / "tiny" / "metrics.jsonl") if "samples_per_s" in r]
    skipped = [r for r in records if r.get("skipped_steps")]
    assert len(skipped) >= 8 and all(r["loss"] != 0 for r in records)
    assert all(r["loss"] is None and r["loss/darcy2d"] is None for r in skipped[1:]), skipped
    summary = json.loads((tmp_path / "runs" / "tiny" / "report" / "summary.json").read_text())
    assert summary["darcy2d"]["nrmse"] is None and summary["darcy2d"]["baseline_nrmse"] > 0
