"""One run over every neural-operator family, from generated files in each published layout (the FNO paper's
.mat v5 and v7.3, neuraloperator's .pt, PDEArena's HDF5): data, caches, training, evaluation with the relative
L2 error, the report; and predict, which writes each format back."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import folders, run_cli

pytestmark = pytest.mark.integration

TASKS = {
    "fno_burgers": {"n_samples": 24, "resolution": 128, "files": {"n_train": 16, "n_test": 4}, "batch_size": 4},
    "fno_darcy": {"n_samples": 16, "resolution": 33, "spatial_stride": 2, "files": {"n_train": 12, "n_test": 4}},
    "fno_ns": {"n_samples": 12, "resolution": 16, "files": {"n_train": 8, "n_test": 2}, "batch_size": 2},
    "neuralop_darcy": {"n_samples": 12, "resolution": 16},
    "neuralop_burgers": {"n_samples": 12, "resolution": 16},
    "pdearena_ns": {"n_samples": 12, "resolution": 16, "batch_size": 2},
}


def test_every_operator_family_trains_evaluates_and_reports(tmp_path):
    tasks = {name: {"pde": name, "batch_size": 4, "patch_size": 1, **task} for name, task in TASKS.items()}
    config = {
        "tasks": tasks,
        "model": {"name": "fno", "fno": {"modes": 4, "width": 8, "layers": 2}},
        "train": {"epochs": 1, "steps_per_epoch": 3, "log_every": 1},
        "compile": {"enabled": False},
        "run": {"name": "ops"},
    }
    path = tmp_path / "ops.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_cli("run", "--config", str(path), "--nproc", "1", *folders(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "runs" / "ops"
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert set(summary) == set(TASKS)
    for name, scores in summary.items():
        assert 0 < scores["rel_l2"] < 10 and 0 < scores["baseline_rel_l2"] < 10, (name, scores)
    darcy = summary["fno_darcy"]["data"]
    assert darcy["train"]["samples"] == [0, 12] and darcy["test"]["samples"] == [0, 4]
    assert darcy["test"]["file"].endswith("piececonst_r421_N1024_smooth2.mat")
    assert "rel. L2" in (run / "report" / "summary.md").read_text()

    # predict writes each format back (the Darcy test file as a .mat, a PDEArena rollout as PDEArena's HDF5, ...),
    # every key of the input it does not predict copied as it was: they were dropped (Burgers' visc, NS's a and t,
    # PDEArena's coordinates and spacings) and Darcy's bool input written as float32.
    data = tmp_path / "data"
    written = {
        "fno_darcy": (data / "fno_darcy" / "piececonst_r421_N1024_smooth2.mat", tmp_path / "pred.mat"),
        "fno_ns": (next((data / "fno_ns").glob("*.mat")), tmp_path / "ns.mat"),
        "pdearena_ns": (next((data / "pdearena_ns").glob("*test*.h5")), tmp_path / "test.h5"),
        "neuralop_darcy": (next((data / "neuralop_darcy").rglob("*test*.pt")), tmp_path / "darcy.pt"),
        "neuralop_burgers": (next((data / "neuralop_burgers").rglob("*test*.pt")), tmp_path / "burgers.pt"),
    }
    for task, (source, out) in written.items():
        proc = run_cli("predict", "--run", str(run), "--task", task, "--input", str(source), "--output", str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
        scores = json.loads((tmp_path / f"{out.name}.scores.json").read_text())[task]
        assert scores["n_samples"] == _reader(task, source).n_samples == _reader(task, out).n_samples
        assert scores["rel_l2"] > 0
        before, after = _keys(source), _keys(out)
        assert set(before) == set(after), (task, set(before) ^ set(after))
        for key, (dtype, shape) in before.items():
            predicted = key in ("u", "vx", "vy", "y", "sol")
            assert predicted or after[key][0] == dtype, (task, key, dtype, after[key])
            if task != "fno_darcy" and not predicted:  # at stride 1 the copies are the input's own
                assert after[key][1] == shape, (task, key, shape, after[key])
    assert _keys(written["neuralop_darcy"][1])["x"][0] == "torch.bool"


def _keys(path) -> dict[str, tuple[str, tuple]]:
    """Each array of a data file (.mat, .pt, PDEArena's HDF5) as (dtype, shape)."""
    import h5py
    import scipy.io
    import torch

    from train.data.formats.fno_mat import mat_version

    if path.suffix == ".pt":
        return {k: (str(v.dtype), tuple(v.shape)) for k, v in torch.load(path, weights_only=True).items()}
    if path.suffix == ".mat" and mat_version(path) == "5":
        arrays = scipy.io.loadmat(path)
        return {k: (str(v.dtype), v.shape) for k, v in arrays.items() if not k.startswith("__")}
    if path.suffix == ".mat":  # v7.3: HDF5, the axes reversed, the class in an attribute
        with h5py.File(path) as f:
            return {k: (v.attrs["MATLAB_class"].decode(), v.shape[::-1]) for k, v in f.items()}
    with h5py.File(path) as f:
        (group,) = f.values()
        return {k: (str(v.dtype), v.shape) for k, v in group.items()}


def _reader(pde: str, path):
    from train.config import TaskConfig
    from train.data.formats import open_reader

    return open_reader(path, TaskConfig(pde=pde, spatial_stride=2 if pde == "fno_darcy" else 1))
