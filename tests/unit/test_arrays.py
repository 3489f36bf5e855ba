"""The generic array format (pde: arrays): a solver's arrays read back bitwise as written, channels first or last,
1D to 3D, steady or time-dependent, mapped in place or copied; every bad file is a DataError (exit 3) naming it."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from train.config import validate
from train.data.acquire.sources import stage_data
from train.data.cache.build import build_cache
from train.distributed.env import DistEnv
from train.engine.evaluate import evaluate_split
from train.errors import DataError
from train.model.specs import TaskData, task_spec

SPLITS = ("train", "val", "test")


def _write(path, arrays: dict, attrs: dict | None = None, plain: bool = True):
    """``arrays`` into ``path`` as its suffix says: HDF5 (plain, or chunked and compressed), .npz or .npy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        (array,) = arrays.values()
        np.save(path, array)
    elif path.suffix == ".npz":
        np.savez(path, **arrays, **{k: np.asarray(v) for k, v in (attrs or {}).items()})
    else:
        with h5py.File(path, "w") as f:
            for key, array in arrays.items():
                f.create_dataset(key, data=array, **({} if plain else {"chunks": True, "compression": "gzip"}))
            f.attrs.update(attrs or {})
    return path


def _cache(tmp_path, name: str, task: dict):
    cfg = validate({"tasks": {"t": {"pde": "arrays", "source": str(tmp_path / "src"), **task}}}, "test")
    files = stage_data(cfg)["t"]
    return build_cache("t", cfg.tasks["t"], files, tmp_path / "cache" / name), cfg.tasks["t"]


def _whole(info, part: str = "") -> np.ndarray:
    """Every split's samples, in the file's order (train, val, test), as the cache reads them: physical values."""
    return np.concatenate([info.array(split, part).raw() for split in SPLITS])


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("order", ["channels_last", "channels_first"])
@pytest.mark.parametrize("suffix", [".h5", ".npy", ".npz", "chunked.h5"])
def test_trajectories_read_back_bitwise_as_written(tmp_path, dims, order, suffix):
    grid = (12, 8, 6)[:dims]
    last = np.random.default_rng(dims).normal(size=(10, 5, *grid, 3)).astype(np.float32)
    written = last if order == "channels_last" else np.moveaxis(last, -1, 2)
    _write(tmp_path / "src" / f"u{suffix}", {"u": written}, plain=suffix != "chunked.h5")
    task = {"files": {"train_file": f"u{suffix}"}, "arrays": {"order": order}, "initial_step": 1, "patch_size": 2}
    info, _ = _cache(tmp_path, "c", task)
    assert (info.grid, info.n_frames, info.in_channels, info.sizes) == (grid, 5, 3, {"train": 8, "val": 1, "test": 1})
    np.testing.assert_array_equal(_whole(info), last)
    mapped = suffix in (".h5", ".npy") and order == "channels_last"
    assert (info.in_place is not None) == mapped, "a plain channels-last float32 array is mapped, nothing else"
    assert info.channels == ("u_0", "u_1", "u_2")


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("suffix", [".h5", ".npz"])
def test_steady_pairs_read_back_bitwise_with_their_names(tmp_path, dims, suffix):
    grid = (9, 7, 5)[:dims]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(10, *grid, 2)).astype(np.float32), rng.normal(size=(10, *grid, 1)).astype(np.float32)
    _write(tmp_path / "src" / f"pairs{suffix}", {"a": x, "sol": y}, {"fields": ["kappa", "source", "pressure"]})
    files = {"train_file": f"pairs{suffix}"}
    task = {"files": files, "arrays": {"steady": True, "input_key": "a", "target_key": "sol"}}
    info, cfg = _cache(tmp_path, "c", {**task, "patch_size": 1})
    assert not info.autoregressive and (info.in_channels, info.out_channels) == (2, 1)
    assert (info.in_place is not None) == (suffix == ".h5"), "plain HDF5 pairs are mapped, an .npz copied"
    np.testing.assert_array_equal(_whole(info, "x"), x)
    np.testing.assert_array_equal(_whole(info, "y"), y)
    assert task_spec(info, cfg, "t").fields == ("arrays/kappa", "arrays/source", "pressure")


def test_val_and_test_files_of_their_own_and_the_files_record_of_its_axes(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {
        split: rng.normal(size=(n, 4, 16, 1)).astype(np.float32) for split, n in zip(SPLITS, (6, 2, 3), strict=True)
    }
    for split, array in arrays.items():
        _write(tmp_path / "src" / f"{split}.h5", {"u": array}, {"periodic": [True], "extent": [22.0], "dt": 0.25})
    files = {f"{split}_file": f"{split}.h5" for split in SPLITS}
    info, cfg = _cache(tmp_path, "c", {"files": files, "initial_step": 1, "patch_size": 4})
    assert info.sizes == {"train": 6, "val": 2, "test": 3}
    for split, array in arrays.items():
        np.testing.assert_array_equal(info.array(split).raw(), array)
    assert task_spec(info, cfg, "t").periodic == (True,)
    coordinates = __import__("json").loads((info.path / "manifest.json").read_text())["coordinates"]
    assert coordinates["x"][:2] == [0.0, 22.0 / 16] and coordinates["t"] == [0.0, 0.25, 0.5, 0.75]


BAD = {
    "a missing channel axis": ({"u": np.zeros((4, 5, 16), np.float32)}, {}, {}, r"'u' has shape \(4, 5, 16\)"),
    "four spatial axes": ({"u": np.zeros((4, 5, 2, 2, 2, 2, 1), np.float32)}, {}, {}, "1 to 3 spatial axes"),
    "names for other channels": (
        {"u": np.zeros((4, 5, 16, 2), np.float32)},
        {},
        {"fields": ["u"]},
        r"1 field name\(s\) \['u'\] for 2",
    ),
    "a NaN": (
        {
            "u": np.where(np.arange(16) == 3, np.nan, 0)
            .astype(np.float32)[None, None, :, None]
            .repeat(4, 0)
            .repeat(5, 1)
        },
        {},
        {},
        r"non-finite values \(NaN/Inf\) in 'u' at sample 0",
    ),
    "the file's dt against the config's": (
        {"u": np.zeros((4, 5, 16, 1), np.float32)},
        {"dt": 0.5},
        {"arrays": {"dt": 0.1}},
        r"attribute dt=0.5 contradicts tasks.<name>.arrays.dt=0.1",
    ),
    "the file's periodic axes against the config's": (
        {"u": np.zeros((4, 5, 16, 1), np.float32)},
        {"periodic": [True]},
        {"periodic": False},
        r"attribute periodic=\[True\] contradicts tasks.<name>.periodic=\[False\]",
    ),
    "a key the file lacks": ({"v": np.zeros((4, 5, 16, 1), np.float32)}, {}, {}, r"no array 'u' \(arrays: \['v'\]\)"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_file_is_exit_3_naming_the_file_and_what_is_wrong(tmp_path, case):
    arrays, attrs, task, message = BAD[case]
    path = _write(tmp_path / "src" / "u.h5", arrays, attrs, plain=False)
    with pytest.raises(DataError, match=message) as error:
        _cache(tmp_path, "c", {"files": {"train_file": "u.h5"}, "initial_step": 1, "patch_size": 4, **task})
    assert str(path) in str(error.value) and error.value.exit_code == 3


@pytest.mark.parametrize("suffix", [".h5", ".npy", ".npz"])
def test_a_truncated_file_is_exit_3(tmp_path, suffix):
    path = _write(tmp_path / "src" / f"u{suffix}", {"u": np.ones((8, 5, 64, 1), np.float32)})
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match="truncated or damaged") as error:
        _cache(tmp_path, "c", {"files": {"train_file": f"u{suffix}"}, "initial_step": 1, "patch_size": 4})
    assert str(path) in str(error.value) and error.value.exit_code == 3


class _NextFrame(torch.nn.Module):
    """The exact next frame of u(t, x) = a(x) + 0.1 t, in the cache's normalised units."""

    def __init__(self, name: str, step: float):
        super().__init__()
        self.name, self.step = name, step

    def forward(self, inputs: dict) -> dict:
        return {self.name: inputs[self.name][:, -1] + self.step}


def test_test_trajectories_longer_than_train_are_scored_to_their_end(tmp_path):
    """Frames known exactly: a model that predicts them has zero error at every step of the long rollout, and
    the rollout has as many steps as the test trajectories have frames after the input window."""
    rng = np.random.default_rng(2)
    law = lambda n, t: (rng.normal(size=(n, 1, 16, 1)) + 0.1 * np.arange(t)[None, :, None, None]).astype(  # noqa: E731
        np.float32
    )
    _write(tmp_path / "src" / "train.h5", {"u": law(8, 6)})
    _write(tmp_path / "src" / "test.h5", {"u": law(3, 40)})
    files = {"train_file": "train.h5", "test_file": "test.h5"}
    info, cfg = _cache(tmp_path, "c", {"files": files, "initial_step": 2, "patch_size": 4})
    assert (info.n_frames, info.frames("test"), info.array("test").shape) == (6, 40, (3, 40, 16, 1))
    task = TaskData("t", info, task_spec(info, cfg, "t"))
    env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    step = 0.1 / float(info.target_std[0])
    scores = evaluate_split(_NextFrame("t", step), [task], env, "test", batch_size=2)["t"]
    assert len(scores["nrmse_by_step"]) == 38 and max(scores["nrmse_by_step"]) < 1e-5
    assert list(scores["nrmse_at_step"]) == ["1", "10", "last"] and scores["baseline_nrmse_by_step"][-1] > 0.1
    wrong = evaluate_split(_NextFrame("t", 2 * step), [task], env, "test", batch_size=2)["t"]
    growth = wrong["nrmse_by_step"]
    assert growth[-1] > growth[9] > growth[0] > 0  # an error that compounds is seen to the end


def test_a_test_file_shorter_than_train_or_on_another_grid_is_refused(tmp_path):
    _write(tmp_path / "src" / "train.h5", {"u": np.zeros((8, 6, 16, 1), np.float32)})
    for name, shape in (("short.h5", (3, 5, 16, 1)), ("grid.h5", (3, 6, 32, 1))):
        _write(tmp_path / "src" / name, {"u": np.zeros(shape, np.float32)})
        files = {"train_file": "train.h5", "test_file": name}
        with pytest.raises(DataError, match="val and test trajectories may be longer than the training ones"):
            _cache(tmp_path, name, {"files": files, "initial_step": 2, "patch_size": 4})


def test_arrays_settings_belong_to_pde_arrays_only():
    from train.config import TaskConfig

    with pytest.raises(ValueError, match="'arrays' settings are for pde: arrays, not pde: fno_burgers"):
        TaskConfig(pde="fno_burgers", arrays={"key": "a"})
    with pytest.raises(ValueError, match=r"files\.val_file is for pde: arrays"):
        TaskConfig(pde="fno_burgers", files={"val_file": "v.mat"})
    assert TaskConfig(pde="arrays").arrays.key == "u" and TaskConfig(pde="arrays").files.train_file == "train.h5"
