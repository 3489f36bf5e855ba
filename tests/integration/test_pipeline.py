"""The whole pipeline through the CLI and torchrun (2 gloo ranks) on the tiny config."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml

from tests.helpers import folders, run_cli

pytestmark = pytest.mark.integration

TINY = ["--config", "configs/tiny.yaml", "--nproc", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, farm):
    """A copy of the farm's tiny run (data, caches, run folder), shared by the tests that launch into it."""
    return farm.tiny(into=tmp_path_factory.mktemp("pipeline"))


def test_run_writes_the_run_folder_contract(farm):
    tmp = farm.tiny()  # read only: the farm's own
    run = tmp / "runs" / "tiny"
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["run"]["name"] == "tiny" and set(config["tasks"]) == {"advection1d", "darcy2d"}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    fields = {"step", "loss", "loss/advection1d", "loss/darcy2d", "lr", "samples_per_s", "step_time_s", "data_wait"}
    assert train_records and all(fields | {"rss_mib", "shm_used_mib"} <= r.keys() for r in train_records)
    assert all(0 <= r["data_wait"] <= 1 and r["samples_per_s"] > 0 and r["rss_mib"] > 50 for r in train_records)
    assert train_records[0]["launch_to_first_step_s"] > 0
    assert [r["step"] for r in train_records] == sorted(r["step"] for r in train_records)
    assert any("val/darcy2d" in r and "val/loss" in r for r in records)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "best.pt",
        "step_00000005.pt",
        "step_00000010.pt",
    ]
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 500
    assert {"rank0.log", "rank1.log"} <= {p.name for p in (run / "logs").iterdir()}
    assert "training" in (run / "logs" / "rank1.log").read_text()
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert set(summary) == {"advection1d", "darcy2d"}
    for scores in summary.values():
        for key in ("nrmse", "rmse", "baseline_nrmse"):
            assert math.isfinite(scores[key]) and scores[key] > 0
        assert {"crmse", "brmse", "max_error", "frmse_low", "frmse_mid", "frmse_high"} <= scores.keys()
    md = (run / "report" / "summary.md").read_text()
    assert "advection1d" in md and "darcy2d" in md
    # Generated data is named by its settings, and the run folder records them.
    generated = tmp / "data" / "advection1d" / "1D_Advection_Sols_beta0.1_n40_r64_s0.hdf5"
    settings = {"pde": "advection1d", "n_samples": 40, "resolution": 64, "coefficient": 0.1, "seed": 0, "version": 1}
    inputs = json.loads((run / "inputs.json").read_text())
    assert set(inputs["advection1d"]) == {"cache", "latent", "data", "data_warnings"}
    train = inputs["advection1d"]["data"]["train"]
    assert {k: train[k] for k in ("origin", "file", "generator", "carved")} == {
        "origin": "generated", "file": str(generated), "generator": settings, "carved": False,
    }  # fmt: skip
    assert inputs["advection1d"]["data"]["test"]["carved_from"] == str(generated)
    assert inputs["darcy2d"]["data"]["train"]["file"].endswith("/2D_DarcyFlow_beta1.0_Train_n40_r16_s0.hdf5")
    assert (
        inputs["advection1d"]["data_warnings"] == [] and summary["advection1d"]["data"] == inputs["advection1d"]["data"]
    )
    assert (
        "| advection1d | train | generated (pde=advection1d, n_samples=40, resolution=64, coefficient=0.1, seed=0" in md
    )
    growth = summary["advection1d"]["nrmse_by_step"]  # the rollout's error per predicted step; darcy2d is steady
    assert len(growth) > 1 and len(summary["darcy2d"]["nrmse_by_step"]) == 1
    assert sum(growth) / len(growth) == pytest.approx(summary["advection1d"]["nrmse"], rel=1e-9)
    for png in ("loss.png", "error_growth.png", "field_advection1d.png", "field_darcy2d.png"):
        assert (run / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in md
    assert not list(tmp.rglob("*.tmp")), "temporary files left behind"


def test_rerun_is_a_no_op(trained):
    tmp = trained
    checkpoints = sorted((tmp / "runs" / "tiny" / "checkpoints").iterdir())
    before = {p: p.stat().st_mtime_ns for p in checkpoints}
    report = tmp / "runs" / "tiny" / "report" / "summary.json"
    report_before = report.stat().st_mtime_ns
    proc = run_cli("run", *TINY, *folders(tmp))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launching" not in proc.stderr
    assert "up to date" in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in checkpoints} == before
    assert report.stat().st_mtime_ns == report_before


def test_a_report_is_stale_once_the_checkpoint_it_scores_changed(tmp_path, farm):
    """The report scores best.pt, but was called up to date by the newest step checkpoint's time: a best.pt
    replaced after the report was never scored."""
    farm.tiny(into=tmp_path)
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    shutil.copyfile(checkpoints / "step_00000005.pt", checkpoints / "best.pt")
    proc = run_cli("run", *TINY, *folders(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "report in" not in proc.stderr and "report written to" in proc.stderr


def test_a_run_folder_belongs_to_one_config(trained):
    tmp = trained
    # DataLoader workers too: the datasets travel to them as paths and map the caches themselves.
    more = ["--set", "train.epochs=3", "--set", "train.num_workers=2", "--run", "tiny_more"]
    proc = run_cli("fit", *TINY, *folders(tmp), *more)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kept = sorted(p.name for p in (tmp / "runs" / "tiny_more" / "checkpoints").iterdir())
    assert kept == ["best.pt", "step_00000010.pt", "step_00000015.pt"]  # keep_checkpoints=2, plus the best
    # The same name with other training settings must refuse: its checkpoints belong to the old config.
    proc = run_cli("fit", *TINY, *folders(tmp), "--set", "train.epochs=3")
    assert proc.returncode == 2
    assert "train.epochs" in proc.stderr and "different config" in proc.stderr


def test_an_interrupted_run_resumes_from_its_newest_checkpoint(trained):
    tmp = trained
    # The state a crash during epoch 2 leaves behind: epoch 1's checkpoint, no report.
    shutil.copytree(tmp / "runs" / "tiny", tmp / "runs" / "tiny_resume")
    (tmp / "runs" / "tiny_resume" / "checkpoints" / "step_00000010.pt").unlink()
    shutil.rmtree(tmp / "runs" / "tiny_resume" / "report")
    proc = run_cli("run", *TINY, *folders(tmp), "--run", "tiny_resume")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr and "(epoch 1, step 0 of the epoch, global step 5)" in proc.stderr
    assert "validation at step 5" not in proc.stderr and "validation at step 10" in proc.stderr
    assert (tmp / "runs" / "tiny_resume" / "checkpoints" / "step_00000010.pt").is_file()
    assert (tmp / "runs" / "tiny_resume" / "report" / "summary.json").is_file()


def test_evaluate_alone_rewrites_the_report(trained):
    tmp = trained
    report = tmp / "runs" / "tiny" / "report" / "summary.json"
    report.unlink()
    proc = run_cli("evaluate", *TINY, *folders(tmp))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fit" not in proc.stderr.split("--stages", 1)[1].split()[0]
    assert set(json.loads(report.read_text())) == {"advection1d", "darcy2d"}


def test_single_process_run(tmp_path):
    proc = run_cli("run", "--config", "configs/tiny.yaml", "--nproc", "1", *folders(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "runs" / "tiny" / "report" / "summary.json").is_file()
    assert not (tmp_path / "runs" / "tiny" / "logs" / "rank1.log").exists()


def test_latent_cache_run_trains_around_a_frozen_encoder(trained):
    tmp = trained
    encoder = tmp / "runs" / "tiny" / "checkpoints" / "step_00000010.pt"
    latent_args = [f"--set=tasks.{name}.latent_encoder={encoder}" for name in ("advection1d", "darcy2d")]
    proc = run_cli("run", *TINY, *folders(tmp), "--run", "latent", *latent_args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("advection1d", "darcy2d"):
        assert len(list((tmp / "cache" / name).glob("latent-*"))) == 1
    before = torch.load(encoder, weights_only=True)["model"]
    after = torch.load(tmp / "runs" / "latent" / "checkpoints" / "step_00000010.pt", weights_only=True)["model"]
    for name in ("advection1d", "darcy2d"):
        for part in ("encode.weight", "encode.bias", "position"):
            assert torch.equal(after[f"codecs.{name}.{part}"], before[f"codecs.{name}.{part}"]), part
        assert not torch.equal(after[f"codecs.{name}.decode.1.weight"], before[f"codecs.{name}.decode.1.weight"])
    summary = json.loads((tmp / "runs" / "latent" / "report" / "summary.json").read_text())
    assert all(math.isfinite(s["nrmse"]) for s in summary.values())
