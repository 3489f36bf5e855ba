"""Training data on the device (train.data_on_device): the gathered batches are bitwise the loader's, the choice
and its refusal; and the judging of non-finite steps at boundaries (train.engine.nonfinite)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.unit.test_dataset import _adv_cache, _darcy_cache
from tests.well_files import write_dataset
from train.config import TaskConfig, load_config
from train.data.acquire.sources import SplitFiles
from train.data.cache.build import build_cache
from train.data.dataset import EqualBatchSampler, PairDataset, WindowDataset
from train.data.device_data import DeviceLoader, DeviceTask, dataset_bytes, placement
from train.engine.loaders import data_placement
from train.engine.nonfinite import NonFiniteSteps
from train.errors import ConfigError

CPU = torch.device("cpu")


def _same(ours: dict[str, torch.Tensor], loader: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == loader.keys()
    for key in loader:
        assert ours[key].shape == loader[key].shape and ours[key].dtype == loader[key].dtype, key
        assert ours[key].stride() == loader[key].stride(), key  # the same layout: the same kernels downstream
        assert torch.equal(ours[key], loader[key]), key


def _batches(n: int, size: int = 5, draws: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [sorted(rng.choice(n, size, replace=False).tolist()) for _ in range(draws)]


@pytest.mark.parametrize(("k", "horizon", "stride"), [(1, 1, 1), (2, 3, 1), (2, 1, 2)])
def test_windows_gathered_on_the_device_are_bitwise_the_loaders(tmp_path, k, horizon, stride):
    dataset = WindowDataset(_adv_cache(tmp_path), "train", k, horizon, stride)
    device = DeviceTask(dataset, CPU)
    for indices in _batches(len(dataset)):
        _same(device.gather(torch.tensor(indices)), dataset.__getitems__(indices))


def test_pairs_gathered_on_the_device_are_bitwise_the_loaders(tmp_path):
    dataset = PairDataset(_darcy_cache(tmp_path), "train")
    device = DeviceTask(dataset, CPU)
    for indices in _batches(len(dataset)):
        _same(device.gather(torch.tensor(indices)), dataset.__getitems__(indices))


def test_constant_channels_are_appended_on_the_device_as_the_loader_appends_them(tmp_path):
    root = write_dataset(tmp_path / "rich", 2)
    task = TaskConfig.model_validate({"pde": "well", "source": "x", "well": {"n_steps_input": 2}})
    files = SplitFiles(tuple(sorted((root / "data" / "train").glob("*.hdf5"))))
    info = build_cache("rich", task, files, tmp_path / "cache")
    assert info.const_channels
    dataset = WindowDataset(info, "train", 2)
    for indices in _batches(len(dataset), size=3):
        _same(DeviceTask(dataset, CPU).gather(torch.tensor(indices)), dataset.__getitems__(indices))


def test_a_chunked_copy_normalises_as_the_cache_does(tmp_path, monkeypatch):
    import train.data.device_data as device_data

    monkeypatch.setattr(device_data, "CHUNK_BYTES", 1)  # one trajectory per chunk
    dataset = WindowDataset(_adv_cache(tmp_path), "train", 2)
    assert torch.equal(DeviceTask(dataset, CPU).tensors[0], torch.from_numpy(np.asarray(dataset.arrays[0])))


def test_the_device_loader_yields_the_samplers_batches_in_order(tmp_path):
    dataset = WindowDataset(_adv_cache(tmp_path), "train", 2)
    sampler = EqualBatchSampler(len(dataset), 4, 7, 1, 2, 0, 0)
    sampler.set_epoch(3, 2, 6)  # a resumed epoch: batches 2..5
    loader = DeviceLoader(DeviceTask(dataset, CPU), sampler, CPU)
    got = list(loader)
    want = [dataset.__getitems__(b) for b in sampler]
    assert len(got) == len(want) == 4
    for a, b in zip(got, want, strict=True):
        _same(a, b)


def test_auto_keeps_the_loader_on_cpu_and_true_that_does_not_fit_is_refused(tmp_path, repo):
    dataset = WindowDataset(_adv_cache(tmp_path), "train", 2)
    assert dataset_bytes([dataset]) == dataset.arrays[0].nbytes + 2 * dataset.arrays[1].nbytes
    assert not placement("auto", 0.5, [dataset], CPU).on_device
    assert placement(True, 0.5, [dataset], CPU).on_device
    assert not placement(True, 1e-12, [dataset], CPU).on_device
    cfg = load_config(repo / "configs/tiny.yaml", ["train.data_on_device=true", "train.data_on_device_share=1e-12"])
    with pytest.raises(ConfigError, match=r"train\.data_on_device=true but the training arrays take .* free on cpu"):
        data_placement(cfg, [dataset], CPU)


# ---------------------------------------------------------------------------------- non-finite steps
def _record(judge: NonFiniteSteps, flags: list[bool], first_step: int = 1) -> None:
    for i, bad in enumerate(flags):
        judge.record(first_step + i, torch.tensor(bad), torch.tensor([math_nan() if bad else 1.0]))


def math_nan() -> float:
    return float("nan")


def test_skipped_steps_are_judged_at_the_boundary_step_by_step(caplog):
    newest = [None]
    judge = NonFiniteSteps(["adv"], stop=False, max_skipped=2, last_good=lambda: newest[0])
    with caplog.at_level(logging.WARNING):
        _record(judge, [False, True, True, False, True])
        judge.settle()  # two in a row, then one: tolerated, each named
    assert [r.getMessage() for r in caplog.records] == [
        "step 2: non-finite gradients, update skipped (1 in a row)",
        "step 3: non-finite gradients, update skipped (2 in a row)",
        "step 5: non-finite gradients, update skipped (1 in a row)",
    ]
    _record(judge, [True, True], first_step=6)  # the run of bad steps goes on across the boundary
    newest[0] = "runs/x/checkpoints/step_00000004.pt"
    with pytest.raises(ConfigError, match=r"at step 7 \(3 steps in a row\); non-finite loss in: adv"):
        judge.settle()
    assert not judge.pending


def test_on_nonfinite_stop_names_the_first_bad_step_and_the_last_checkpoint():
    judge = NonFiniteSteps(["adv"], stop=True, max_skipped=10, last_good=lambda: "runs/c.pt")
    _record(judge, [False, False, True, True])
    with pytest.raises(ConfigError, match=r"at step 3; .*The last good checkpoint is runs/c\.pt"):
        judge.settle()


def test_a_fused_adamw_told_of_a_bad_step_leaves_weights_and_state_as_they_were():
    from train.config import TrainConfig
    from train.engine.nonfinite import skip_on_device
    from train.engine.optim import build_optimizer

    weight = torch.nn.Parameter(torch.ones(4))
    optimizer, _ = build_optimizer([weight], TrainConfig(), 10)
    assert skip_on_device(optimizer)
    weight.grad = torch.ones(4)
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    before = weight.detach().clone(), {k: v.clone() for k, v in optimizer.state[weight].items()}
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    assert torch.equal(weight, before[0])
    assert all(torch.equal(v, before[1][k]) for k, v in optimizer.state[weight].items())


def test_validation_and_test_trajectories_held_on_the_device_read_as_from_the_cache(tmp_path):
    from train.data.device_data import hold_splits
    from train.model.specs import TaskData, task_spec

    info = _adv_cache(tmp_path)
    task = TaskData("adv", info, task_spec(info, TaskConfig(pde="advection1d", initial_step=2), "adv"))
    rows = np.array([1, 0])  # val and test hold 2 trajectories each
    want = {split: task.trajectories(split, rows) for split in ("val", "test")}
    one = task.trajectories("val", [0]).nbytes
    assert hold_splits([task], CPU, budget=info.sizes["val"] * one) == info.sizes["val"] * one  # test does not fit
    assert set(task.resident) == {"val"}
    assert hold_splits([task], CPU, budget=1 << 30) > 0 and set(task.resident) == {"val", "test"}
    for split, expected in want.items():
        assert torch.equal(task.trajectories(split, rows), expected)
