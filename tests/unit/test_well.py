"""The Well's schema, read as The Well's own reader reads it: samples, statistics and metrics checked against
``the_well`` itself (a test-only dependency), and every schema violation refused with its file and rule."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tests.well_files import GRIDS, channel_names, well_moments, write_dataset, write_stats
from train.config import TaskConfig
from train.data.acquire.sources import SplitFiles
from train.data.cache.build import build_cache
from train.data.dataset import WindowDataset
from train.data.formats.well import WellReader
from train.engine.well_metrics import vrmse_nrmse
from train.errors import DataError

the_well_data = pytest.importorskip("the_well.data", reason="the-well is a test-only dependency: pip install '.[dev]'")


def _task(**well) -> TaskConfig:
    settings = {"n_steps_input": 2, "n_steps_output": 1, "dt_stride": 1, **well}
    return TaskConfig.model_validate({"pde": "well", "source": "x", "well": settings})


def _files(root: Path, stats: bool = True) -> SplitFiles:
    split = lambda name: tuple(sorted((root / "data" / name).glob("*.hdf5")))  # noqa: E731
    return SplitFiles(split("train"), split("valid"), split("test"), stats_file=root / "stats.yaml" if stats else None)


def _theirs(root: Path, split: str, task: TaskConfig, normalise: bool = True):
    from the_well.data.normalization import ZScoreNormalization

    return the_well_data.WellDataset(
        path=str(root),
        well_split_name=split,
        n_steps_input=task.well.n_steps_input,
        n_steps_output=task.well.n_steps_output,
        min_dt_stride=task.well.dt_stride,
        max_dt_stride=task.well.dt_stride,
        use_normalization=normalise,
        normalization_type=ZScoreNormalization if normalise else None,
    )


@pytest.mark.parametrize(("dims", "stride"), [(2, 1), (2, 2), (3, 1)])
def test_every_sample_equals_the_wells_own_reader(tmp_path, dims, stride):
    root = write_dataset(tmp_path / "rich", dims)
    write_stats(root)
    task = _task(dt_stride=stride)
    info = build_cache("rich", task, _files(root), tmp_path / "cache")
    assert info.statistics == "stats.yaml"
    channels = channel_names(dims)
    assert list(info.channels) == [*channels, "mask", "Re", "amp"]
    assert info.boundary == ([2, 2], [0, 1]) + (([1, 1],) if dims == 3 else ())  # periodic x, wall low y, open
    c, k = len(channels), task.initial_step
    for split, folder in (("train", "train"), ("val", "valid"), ("test", "test")):
        ours = WindowDataset(info, split, k, 1, stride)
        theirs = _theirs(root, folder, task)
        assert len(ours) == len(theirs) > 0
        for i in range(len(theirs)):
            want, got = theirs[i], ours[i]
            np.testing.assert_allclose(got["x"][..., :c], want["input_fields"], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got["y"], want["output_fields"][0], rtol=1e-6, atol=1e-6)
            const = got["x"][0, ..., c:]
            np.testing.assert_allclose(const[..., 0], want["constant_fields"][..., 0], rtol=1e-6, atol=1e-6)
            # Constant scalars reach the model z-scored (The Well's reader leaves them raw): undo it to compare.
            scalars = const[(0,) * dims][1:].double() * torch.tensor(info.const_std[1:]) + torch.tensor(
                info.const_mean[1:]
            )
            np.testing.assert_allclose(scalars, want["constant_scalars"].double(), rtol=1e-6)
            np.testing.assert_array_equal(np.asarray(info.boundary, np.float32), want["boundary_conditions"])


def test_statistics_equal_the_wells_computation(tmp_path):
    root = write_dataset(tmp_path / "rich", 2)
    info = build_cache("rich", _task(), _files(root, stats=False), tmp_path / "cache")
    assert info.statistics == "train split"
    files = sorted((root / "data" / "train").glob("*.hdf5"))
    # The definition exactly; and The Well's script, whose float32 file weights cost it about 1e-5 (relative).
    for theirs, rtol in ((well_moments(files, float32_weights=False), 1e-7), (well_moments(files), 1e-4)):
        mean = np.concatenate([np.ravel(theirs["mean"][n]) for n in ("rho", "pressure", "velocity", "stress")])
        std = np.concatenate([np.ravel(theirs["std"][n]) for n in ("rho", "pressure", "velocity", "stress")])
        np.testing.assert_allclose(info.target_mean, mean, rtol=rtol)
        np.testing.assert_allclose(info.target_std, std, rtol=rtol)
        np.testing.assert_allclose(info.const_mean[0], theirs["mean"]["mask"], rtol=rtol)
        np.testing.assert_allclose(info.const_std[0], theirs["std"]["mask"], rtol=rtol)


def test_a_stats_file_that_disagrees_or_is_not_one_is_not_used(tmp_path, caplog):
    root = write_dataset(tmp_path / "rich", 2)
    write_stats(root)
    text = (root / "stats.yaml").read_text()
    (root / "stats.yaml").write_text("<html><body>503 Service Unavailable</body></html>")
    assert build_cache("a", _task(), _files(root), tmp_path / "cache").statistics == "train split"
    assert "holds no 'mean' and 'std'" in caplog.text
    (root / "stats.yaml").write_text(text.replace("rho:", "rho: 7.0\n  old_rho:", 1))
    assert build_cache("b", _task(), _files(root), tmp_path / "cache").statistics == "train split"
    assert "disagrees with the train split" in caplog.text


def test_metrics_equal_the_wells_own(tmp_path):
    from the_well.benchmark.metrics import NRMSE, VRMSE

    rng = np.random.default_rng(0)
    for grid in ((16,), (8, 6), (4, 5, 6)):
        target = torch.from_numpy(rng.standard_normal((3, 4, *grid, 2)) * 3 + 1)
        pred = target + torch.from_numpy(rng.standard_normal(target.shape) * 0.3)
        meta = types.SimpleNamespace(n_spatial_dims=len(grid))
        vrmse, nrmse = vrmse_nrmse(pred, target)
        torch.testing.assert_close(vrmse, VRMSE()(pred, target, meta), rtol=1e-10, atol=0)
        torch.testing.assert_close(nrmse, NRMSE()(pred, target, meta), rtol=1e-10, atol=0)


def _break(path: Path, edit) -> Path:
    with h5py.File(path, "a") as f:
        edit(f)
    return path


RHO = "t0_fields/rho"
VIOLATIONS = {
    "group 't1_fields' missing": lambda f: f.__delitem__("t1_fields"),
    "root attribute(s) ['n_trajectories'] missing": lambda f: f.attrs.__delitem__("n_trajectories"),
    "'t0_fields/rho' lacks the attribute 'time_varying'": lambda f: f[RHO].attrs.__delitem__("time_varying"),
    "'t0_fields/rho' has shape (2, 9, 8, 6), which contradicts its flags": lambda f: f[RHO].attrs.__setitem__(
        "time_varying", False
    ),
    "bc_type 'sticky' is none of": lambda f: f["boundary_conditions/x_periodic"].attrs.__setitem__("bc_type", "sticky"),
    "grid_type 'spherical' is not supported yet": lambda f: f.attrs.__setitem__("grid_type", "spherical"),
    "'dimensions/y' missing": lambda f: f["dimensions"].__delitem__("y"),
}


@pytest.mark.parametrize("message", VIOLATIONS)
def test_schema_violations_name_the_file_and_the_rule(tmp_path, message):
    root = write_dataset(tmp_path / "rich", 2)
    bad = _break(root / "data" / "train" / "rich_0.hdf5", VIOLATIONS[message])
    with pytest.raises(DataError) as e:
        WellReader(sorted((root / "data" / "train").glob("*.hdf5")))
    assert str(bad) in str(e.value) and message in str(e.value)


def test_files_of_one_split_must_agree(tmp_path):
    root = write_dataset(tmp_path / "rich", 2)
    other = write_dataset(tmp_path / "other", 3)
    shutil.copy(other / "data" / "train" / "rich_1.hdf5", root / "data" / "train" / "rich_9.hdf5")
    with pytest.raises(DataError, match=r"rich_9.hdf5: spatial dims \['x', 'y', 'z'\] differ from"):
        WellReader(sorted((root / "data" / "train").glob("*.hdf5")))


def test_a_field_constant_along_an_axis_may_be_stored_with_or_without_it(tmp_path):
    """The Well's validator omits an axis that does not vary, its reader wants a singleton: both read the same."""
    from train.data.formats.well_writer import WellArray, write_well_file

    grid = GRIDS[2]
    profile = np.linspace(1, 2, grid[1]).astype(np.float32)
    for name, data in (("omitted", profile[None].repeat(2, 0)), ("singleton", profile[None, None].repeat(2, 0))):
        path = write_well_file(
            tmp_path / f"{name}.hdf5", dataset_name="d", n_trajectories=2, time=np.arange(3, dtype=np.float32),
            dims={"x": np.arange(grid[0], dtype=np.float32), "y": np.arange(grid[1], dtype=np.float32)},
            fields={"u": WellArray(np.ones((2, 3, *grid), np.float32)),
                    "wall": WellArray(data, time_varying=False, dim_varying=(False, True))},
        )  # fmt: skip
        (block,) = WellReader([path]).parts(range(2))
        np.testing.assert_array_equal(block["const"][..., 0], np.broadcast_to(profile, (2, *grid)))


def test_rollout_windows_are_reported_when_the_rollout_reaches_them():
    from train.engine.well_metrics import WellSums

    rng = np.random.default_rng(1)
    target = torch.from_numpy(rng.standard_normal((2, 30, 8, 2)))
    pred = (
        target + torch.from_numpy(rng.standard_normal(target.shape)) * torch.linspace(0.1, 1, 30)[None, :, None, None]
    )
    sums = WellSums.zeros(30, 2)
    sums.add(pred, target)
    scores = sums.scores(["u", "v"])
    by_step = vrmse_nrmse(pred, target)[0].mean((0, 2))
    assert scores["vrmse_6_12"] == pytest.approx(float(by_step[6:12].mean()))
    assert scores["vrmse_13_30"] == pytest.approx(float(by_step[13:30].mean()))
    assert scores["vrmse_by_field"]["v"] == pytest.approx(float(vrmse_nrmse(pred, target)[0][..., 1].mean()))
    short = WellSums.zeros(12, 2)
    short.add(pred[:, :12], target[:, :12])
    assert "vrmse_6_12" in short.scores(["u", "v"]) and "vrmse_13_30" not in short.scores(["u", "v"])


def test_use_stats_file_and_the_files_content_decide_the_cache(tmp_path):
    root = write_dataset(tmp_path / "rich", 2)
    write_stats(root)
    used = build_cache("rich", _task(), _files(root), tmp_path / "cache")
    ignored = build_cache("rich", _task(use_stats_file=False), _files(root), tmp_path / "cache")
    assert (used.statistics, ignored.statistics) == ("stats.yaml", "train split") and used.path != ignored.path
    (root / "stats.yaml").write_text((root / "stats.yaml").read_text() + "\n# edited\n")
    assert build_cache("rich", _task(), _files(root), tmp_path / "cache").path != used.path


def test_a_dataset_without_constants_has_no_constant_channels(tmp_path):
    from train.data.formats.well_writer import WellArray, write_well_file

    for split, n in (("train", 3), ("valid", 1), ("test", 1)):
        write_well_file(
            tmp_path / "d" / "data" / split / "f.hdf5", dataset_name="d", n_trajectories=n,
            time=np.arange(5, dtype=np.float32), dims={"x": np.arange(8, dtype=np.float32)},
            fields={"u": WellArray(np.random.default_rng(0).random((n, 5, 8), np.float32))},
        )  # fmt: skip
    info = build_cache("d", _task(), _files(tmp_path / "d", stats=False), tmp_path / "cache")
    assert (info.const_channels, info.in_channels, info.out_channels, info.channels) == (0, 1, 1, ("u",))
    assert WindowDataset(info, "train", 2)[0]["x"].shape == (2, 8, 1)


def _set_scalar_names(names):
    return lambda f: f["scalars"].attrs.__setitem__("field_names", np.asarray(names, dtype=h5py.string_dtype()))


DISAGREEMENTS = {
    # where, the edit, what the message names: a file read with another file's channels, codes or name
    "scalars swapped in train": ("train/rich_1", _set_scalar_names(["amp", "Re", "clock"]), "constant scalars"),
    "scalars swapped in test": ("test/rich_0", _set_scalar_names(["amp", "Re", "clock"]), "constant scalars"),
    "a constant scalar missing": ("train/rich_1", _set_scalar_names(["amp", "clock"]), "constant scalars"),
    "boundary in train": ("train/rich_1", lambda f: f["boundary_conditions/x_periodic"].attrs.__setitem__(
        "bc_type", "WALL"), "boundary conditions"),
    "boundary in test": ("test/rich_0", lambda f: f["boundary_conditions/x_periodic"].attrs.__setitem__(
        "bc_type", "WALL"), "boundary conditions"),
    "dataset_name in test": ("test/rich_0", lambda f: f.attrs.__setitem__("dataset_name", "other"), "dataset_name"),
}  # fmt: skip


@pytest.mark.parametrize("case", DISAGREEMENTS)
def test_files_that_disagree_with_train_stop_the_data_stage_naming_both(tmp_path, case):
    """Trained and scored with exit 0 (train's boundary codes used for all, Re and amp channels swapped), or a
    ValueError (exit 1) at the cache or once the ranks had started: now exit 3 at the data stage."""
    from tests.helpers import REPO
    from train.config import load_config
    from train.data.acquire.sources import stage_data

    root = write_dataset(tmp_path / "rich", 2)
    where, edit, words = DISAGREEMENTS[case]
    bad = _break(root / "data" / f"{where}.hdf5", edit)
    cfg = load_config(REPO / "configs" / "well.yaml", [f"tasks.gray_scott.source={root}",
                                                       f"run.data_dir={tmp_path / 'data'}"])  # fmt: skip
    with pytest.raises(DataError) as e:
        stage_data(cfg)
    assert e.value.exit_code == 3
    assert str(e.value).startswith(f"{bad}: {words}") and str(root / "data" / "train" / "rich_0.hdf5") in str(e.value)


def test_a_datasets_own_stats_file_is_used_when_a_split_is_carved_from_train(tmp_path, caplog):
    """With no valid folder, val is carved from the train files, so the train split is a part of what the
    dataset's stats.yaml describes: the correct file was called wrong ("disagrees with the train split")."""
    root = write_dataset(tmp_path / "rich", 2)
    write_stats(root)
    shutil.rmtree(root / "data" / "valid")
    split = lambda name: tuple(sorted((root / "data" / name).glob("*.hdf5")))  # noqa: E731
    files = SplitFiles(split("train"), None, split("test"), stats_file=root / "stats.yaml")
    task = TaskConfig.model_validate({**_task().model_dump(), "val_fraction": 0.4})
    info = build_cache("carved", task, files, tmp_path / "cache")
    assert info.sizes["val"] > 0 and "disagrees" not in caplog.text
    assert info.statistics != "train split", info.statistics
