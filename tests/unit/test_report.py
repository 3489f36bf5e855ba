"""Tests of the run report: summary.json, summary.md and the PNG plots it links, and the example fields."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from train.data.cache.info import CacheInfo, array_name
from train.engine.evaluate import example_prediction
from train.engine.metrics import KEYS
from train.model.specs import TaskData, TaskSpec
from train.obs import plots
from train.obs.report import report_is_current, write_report
from train.obs.sinks import read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _results(names: list[str]) -> dict[str, dict[str, float]]:
    results = {}
    for i, name in enumerate(names):
        scores = {key: 0.01 * (i + 1) * (j + 1) for j, key in enumerate(KEYS)}
        scores["frmse_high"] = math.nan  # a grid with no high band
        results[name] = {**scores, **{f"baseline_{k}": 2 * v for k, v in scores.items()}, "n_samples": 3 + i}
    return results


def _data(names: list[str]) -> dict[str, dict[str, dict]]:
    split = {"file": "/data/x.h5", "samples": [0, 3], "carved": True}
    return {name: {"train": {**split, "carved": False}, "test": split} for name in names}


def _examples() -> dict[str, dict[str, np.ndarray]]:
    t, x = np.meshgrid(np.linspace(0, 1, 20), np.linspace(0, 2 * np.pi, 64), indexing="ij")
    adv_true = np.sin(x - 2 * t)[..., None]
    gx, gy = np.meshgrid(np.linspace(0, 1, 24), np.linspace(0, 1, 20), indexing="ij")
    darcy_true = (gx * (1 - gx) * gy * (1 - gy))[..., None]
    ns_true = np.stack([np.stack([np.sin(gx + k), np.cos(gy - k)], -1) for k in range(5)])
    return {
        "adv": {"true": adv_true, "pred": adv_true + 0.05 * np.cos(3 * x)[..., None]},
        "darcy": {"input": (gx > 0.5)[..., None] + 0.1, "true": darcy_true, "pred": 1.1 * darcy_true},
        "ns": {"true": ns_true, "pred": ns_true * 0.9},
    }


def _write_metrics(path: Path) -> None:
    records = [
        {"step": 10, "epoch": 0.1, "loss": 0.5, "loss/adv": 0.3, "loss/darcy": 0.2, "lr": 1e-3, "samples_per_s": 600},
        {"step": 20, "epoch": 0.2, "loss": 0.3, "loss/adv": 0.2, "loss/darcy": 0.1, "lr": 1e-3, "grad_norm": 1.5},
        {"step": 20, "epoch": 0.2, "val/adv": 0.25, "val/darcy": 0.12, "val/loss": 0.37},
        {"step": 15, "epoch": 0.15, "loss": 0.4, "loss/adv": 0.25, "loss/darcy": 0.15, "lr": 1e-3},  # resumed
        {"step": 30, "epoch": 0.3, "loss": 0.2, "loss/adv": 0.1, "loss/darcy": 0.1, "lr": 5e-4, "note": "x"},
        {"step": 30, "epoch": 0.3, "val/adv": 0.15, "val/darcy": 0.09, "val/loss": 0.24},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 40, "lo')  # cut by a crash


def _png_ok(path: Path) -> None:
    raw = path.read_bytes()
    assert raw[:8] == PNG_MAGIC, path
    width, height = struct.unpack(">II", raw[16:24])  # the IHDR chunk
    assert width >= 300 and height >= 200, (path, width, height)
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels[..., :3].std() > 0.05, f"{path} is nearly blank"
    assert len(set(map(tuple, pixels[..., :3].reshape(-1, 3)[::37].round(2)))) > 20, f"{path} has few colours"


def _links(md: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = tmp_path / "runs" / "tiny"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "epoch_0002.pt").write_bytes(b"x")
    return run


def test_report_writes_summaries_and_plots(run_dir):
    names = ["adv", "darcy", "ns"]
    _write_metrics(run_dir / "metrics.jsonl")
    checkpoint = run_dir / "checkpoints" / "epoch_0002.pt"
    write_report(run_dir, _results(names), checkpoint, _data(names), _examples())
    report = run_dir / "report"
    expected = {"summary.json", "summary.md", "loss.png", "field_adv.png", "field_darcy.png", "field_ns.png"}
    assert {p.name for p in report.iterdir()} == expected, "missing files, or temporary files left behind"
    for png in report.glob("*.png"):
        _png_ok(png)

    summary = json.loads((report / "summary.json").read_text())
    assert list(summary) == names
    for name in names:
        entry = summary[name]
        for key in KEYS:
            assert key in entry and f"baseline_{key}" in entry, (name, key)
        assert entry["nrmse"] == pytest.approx(_results(names)[name]["nrmse"])
        assert entry["frmse_high"] is None and entry["baseline_frmse_high"] is None  # strict JSON, no NaN
        assert entry["n_samples"] == 3 + names.index(name)
        assert entry["data"] == _data(names)[name]
        assert entry["plots"] == ["loss.png", f"field_{name}.png"]

    md = (report / "summary.md").read_text()
    assert "![loss curves](loss.png)" in md
    for name in names:
        assert f"![{name}](field_{name}.png)" in md
        assert re.search(rf"^\| {name} \| model \| 0\.0\d+ \|", md, re.M), name
        assert re.search(rf"^\| {name} \| baseline \| 0\.\d+ \|", md, re.M), name
    assert "carved from the train file" in md
    assert all((report / link).is_file() for link in _links(md))
    assert report_is_current(run_dir, checkpoint)


def test_the_report_says_where_every_split_came_from(run_dir):
    names = ["adv", "darcy", "ns"]
    sha = "0123456789abcdef0123456789abcdef01234567"
    url = "b2://pdebench/data/full/adv/adv_train.h5"
    b2 = {"origin": "b2", "file": "/data/adv/train.h5", "samples": [3, 30], "carved": False, "url": url,
          "bucket": "pdebench", "key": "data/full/adv/adv_train.h5", "size": 123, "sha1": sha,
          "sha1_verified": True, "uploaded": "2025-05-01T12:00:00.250Z", "file_id": "4_z27"}  # fmt: skip
    carved = {"origin": "carved", "file": "/data/adv/train.h5", "samples": [0, 3], "carved": True,
              "carved_from": url, "convention": "PDEBench's single-file convention: test_fraction=0.1"}  # fmt: skip
    generator = {"coefficient": 1.0, "n_samples": 40, "pde": "darcy2d", "resolution": 16, "seed": 0, "version": 1}
    generated = {"origin": "generated", "file": "/data/darcy/2D_DarcyFlow_beta1.0_Train_n40_r16_s0.hdf5",
                 "samples": [4, 40], "carved": False, "generator": generator}  # fmt: skip
    local = {"origin": "local", "file": "/pdebench/ns_Test.hdf5", "samples": [0, 3], "carved": False, "size": 4096,
             "modified": "2024-12-31T23:59:59.000Z", "xxh3_128": "ab" * 16}  # fmt: skip
    warning = "data adv: no test file (tried b2://pdebench/data/adv/test.h5); carving it from the train file"
    provenance = {
        "adv": {"data": {"train": b2, "test": carved}, "data_warnings": [warning]},
        "darcy": {"data": {"train": generated, "test": {**carved, "file": generated["file"]}}, "data_warnings": []},
        "ns": {"data": {"train": {**local, "file": "/pdebench/ns_Train.hdf5"}, "test": local}, "data_warnings": []},
    }
    checkpoint = run_dir / "checkpoints" / "epoch_0002.pt"

    write_report(run_dir, _results(names), checkpoint, _data(names), {}, provenance=provenance)

    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["adv"]["data"] == {"train": b2, "test": carved}  # the run's record wins over the cache's file
    assert summary["adv"]["data_warnings"] == [warning] and summary["ns"]["data_warnings"] == []
    assert summary["darcy"]["data"]["train"]["generator"] == generator
    assert summary["ns"]["data"]["test"] == local
    md = (run_dir / "report" / "summary.md").read_text()
    assert (
        f"| adv | train | `{url}` (SHA1 {sha}, uploaded 2025-05-01T12:00:00.250Z) | `/data/adv/train.h5` | 3..30 |"
        in md
    )
    assert f"| adv | test | carved from the train file `{url}` (PDEBench's single-file convention" in md
    assert "| darcy | train | generated (pde=darcy2d, n_samples=40, resolution=16, coefficient=1.0, seed=0, " in md
    assert "| ns | test | local file (4096 bytes, modified 2024-12-31T23:59:59.000Z) | `/pdebench/ns_Test.hdf5` |" in md
    assert f"Warnings of the data stage:\n\n- {warning}\n" in md
    provenance["adv"]["data_warnings"] = []
    write_report(run_dir, _results(names), checkpoint, _data(names), {}, provenance=provenance)
    md = (run_dir / "report" / "summary.md").read_text()
    assert "The data stage gave no warnings." in md and "Warnings of the data stage" not in md


def test_time_dependent_tasks_get_an_error_growth_plot(run_dir):
    names = ["adv", "darcy"]
    results = _results(names)
    results["adv"]["nrmse_by_step"] = [0.01, 0.02, 0.05, math.nan]  # a step without a value is left out
    results["adv"]["baseline_nrmse_by_step"] = [0.1, 0.2, 0.4, 0.8]
    results["darcy"]["nrmse_by_step"] = [0.03]  # steady: one "step", no curve
    write_report(run_dir, results, run_dir / "checkpoints" / "epoch_0002.pt", _data(names), {})
    report = run_dir / "report"
    _png_ok(report / "error_growth.png")
    summary = json.loads((report / "summary.json").read_text())
    assert summary["adv"]["plots"] == ["error_growth.png"] and summary["darcy"]["plots"] == []
    assert summary["adv"]["baseline_nrmse_by_step"] == [0.1, 0.2, 0.4, 0.8]
    assert summary["adv"]["nrmse_by_step"] == [0.01, 0.02, 0.05, None]  # strict JSON, no NaN
    assert "![error growth](error_growth.png)" in (report / "summary.md").read_text()


def test_no_time_dependent_task_no_error_growth_plot(run_dir):
    write_report(run_dir, _results(["darcy"]), run_dir / "checkpoints" / "epoch_0002.pt", _data(["darcy"]), {})
    assert not (run_dir / "report" / "error_growth.png").exists()
    assert "error growth" not in (run_dir / "report" / "summary.md").read_text()


def test_missing_metrics_file_gives_no_loss_plot_and_no_broken_link(run_dir):
    names = ["adv"]
    checkpoint = run_dir / "checkpoints" / "epoch_0002.pt"
    stale = run_dir / "report" / "loss.png"
    stale.parent.mkdir()
    stale.write_bytes(PNG_MAGIC)  # an older report's figure
    write_report(run_dir, _results(names), checkpoint, _data(names), {"adv": _examples()["adv"]})
    md = (run_dir / "report" / "summary.md").read_text()
    assert "loss.png" not in md and not stale.exists()
    assert _links(md) == ["field_adv.png"]
    assert all((run_dir / "report" / link).is_file() for link in _links(md))
    assert json.loads((run_dir / "report" / "summary.json").read_text())["adv"]["plots"] == ["field_adv.png"]


def test_a_task_without_an_example_or_with_a_broken_one_has_no_field_plot(run_dir):
    names = ["adv", "darcy"]
    _write_metrics(run_dir / "metrics.jsonl")
    broken = {"darcy": {"true": np.zeros((4, 4, 1))}}  # no "pred": the plot fails, the report must not
    write_report(run_dir, _results(names), run_dir / "checkpoints" / "epoch_0002.pt", _data(names), broken)
    report = run_dir / "report"
    assert not list(report.glob("field_*.png"))
    md = (report / "summary.md").read_text()
    assert _links(md) == ["loss.png"]
    assert json.loads((report / "summary.json").read_text())["darcy"]["plots"] == ["loss.png"]


def test_loss_curves_of_an_empty_or_missing_file_write_nothing(tmp_path):
    assert plots.loss_curves(tmp_path / "absent.jsonl", tmp_path / "a.png") is False
    (tmp_path / "empty.jsonl").write_text("")
    assert plots.loss_curves(tmp_path / "empty.jsonl", tmp_path / "b.png") is False
    (tmp_path / "totals.jsonl").write_text('{"step": 1, "loss": 0.5}\n')  # no per-task key
    assert plots.loss_curves(tmp_path / "totals.jsonl", tmp_path / "c.png") is False
    assert not list(tmp_path.glob("*.png"))


def test_loss_series_keep_file_order_and_ignore_other_keys(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl")
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 6  # the cut last line is skipped
    train = plots._series(records, "loss/")
    val = plots._series(records, "val/", skip=("val/loss",))
    steps = [10, 20, 15, 30]  # as written, the resumed run's repeat included
    assert train == {"adv": (steps, [0.3, 0.2, 0.25, 0.1]), "darcy": (steps, [0.2, 0.1, 0.15, 0.1])}
    assert val == {"adv": ([20, 30], [0.25, 0.15]), "darcy": ([20, 30], [0.12, 0.09])}
    assert plots.loss_curves(tmp_path / "metrics.jsonl", tmp_path / "loss.png") is True
    _png_ok(tmp_path / "loss.png")


class _Persistence(nn.Module):
    """Next frame = last input frame (autoregressive), output = 2 x input (steady)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name, x = next(iter(batch.items()))
        return {name: x[:, -1] * self.gain if name == "adv" else 2 * x * self.gain}


def _task(root: Path, name: str, autoregressive: bool) -> TaskData:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    if autoregressive:
        np.save(root / array_name("test"), rng.normal(size=(2, 6, 32, 2)).astype(np.float32))
        grid, frames, k = (32,), 6, 2
    else:
        np.save(root / array_name("test", "x"), rng.normal(size=(2, 8, 6, 1)).astype(np.float32))
        np.save(root / array_name("test", "y"), rng.normal(size=(2, 8, 6, 1)).astype(np.float32))
        grid, frames, k = (8, 6), 1, 1
    channels = 2 if autoregressive else 1
    info = CacheInfo(
        path=root, pde=name, autoregressive=autoregressive, grid=grid, n_frames=frames, in_channels=channels,
        out_channels=channels, sizes={"train": 0, "val": 0, "test": 2}, input_mean=(1.0,) * channels,
        input_std=(3.0,) * channels, target_mean=(10.0, -5.0)[:channels], target_std=(2.0, 4.0)[:channels], splits={},
    )  # fmt: skip
    spec = TaskSpec(grid, channels, channels, 4, k, autoregressive)
    return TaskData(name, info, spec)


def test_example_prediction_returns_denormalised_fields_of_sample_0(tmp_path):
    model = _Persistence()
    adv = _task(tmp_path / "adv", "adv", autoregressive=True)
    ex = example_prediction(model, adv)
    assert set(ex) == {"true", "pred"}
    traj = (np.load(tmp_path / "adv" / "test.npy")[0] - 1.0) / 3.0  # the cache holds physical values
    scale, shift = np.array([2.0, 4.0]), np.array([10.0, -5.0])
    assert ex["true"].shape == ex["pred"].shape == (4, 32, 2)  # frames 2..5, the predicted ones
    np.testing.assert_allclose(ex["true"], traj[2:] * scale + shift, rtol=1e-5)
    np.testing.assert_allclose(ex["pred"], np.broadcast_to(traj[1] * scale + shift, (4, 32, 2)), rtol=1e-5)

    darcy = _task(tmp_path / "darcy", "darcy", autoregressive=False)
    ex = example_prediction(model, darcy)
    x = (np.load(tmp_path / "darcy" / "test_x.npy")[0] - 1.0) / 3.0  # normalised as the model reads it
    y = (np.load(tmp_path / "darcy" / "test_y.npy")[0] - 10.0) / 2.0
    assert ex["input"].shape == ex["true"].shape == ex["pred"].shape == (8, 6, 1)
    np.testing.assert_allclose(ex["input"], x * 3 + 1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ex["true"], y * 2 + 10, rtol=1e-5)
    np.testing.assert_allclose(ex["pred"], 2 * x * 2 + 10, rtol=1e-5)
    assert model.training  # left as it was found

    plots.field_comparison(ex, "darcy", tmp_path / "darcy.png")
    _png_ok(tmp_path / "darcy.png")


def test_a_1d_steady_example_is_drawn_as_profiles(tmp_path):
    x = np.linspace(0, 1, 50)
    example = {"input": np.cos(6 * x)[:, None], "true": np.sin(3 * x)[:, None], "pred": np.sin(3.2 * x)[:, None]}
    plots.field_comparison(example, "steady1d", tmp_path / "steady1d.png")
    _png_ok(tmp_path / "steady1d.png")


def test_the_report_has_a_heading_for_every_metric():
    from train.engine.metrics import KEYS
    from train.obs.report import HEADINGS

    assert set(HEADINGS) == set(KEYS)


def test_the_summary_score_of_many_tasks_weighs_each_relative_to_its_own_baseline():
    from train.obs.report import summary_score

    results = {"a": {"nrmse": 0.1, "baseline_nrmse": 1.0}, "b": {"nrmse": 4.0, "baseline_nrmse": 1.0},
               "c": {"nrmse": float("nan"), "baseline_nrmse": 1.0}}  # fmt: skip
    score = summary_score(results)
    assert score["tasks"] == 3 and score["mean_nrmse"] == pytest.approx(2.05)  # c has nothing to score
    assert score["nrmse_to_baseline"] == pytest.approx((0.1 * 4.0) ** 0.5)  # geometric: 10x better, 4x worse
