"""Tests of the memory-mapped datasets and of the equal-steps batch sampler."""

from __future__ import annotations

import pickle
import random
from collections import Counter

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from train.config import TaskConfig
from train.data.cache.build import build_cache
from train.data.dataset import (
    EqualBatchSampler,
    PairDataset,
    WindowDataset,
    keep_batch,
    steps_for_one_pass,
    training_dataset,
    worker_seeding,
)


# ------------------------------------------------------------------------------------------ fixtures
def _adv_cache(tmp_path, n=20, t=9, nx=16, name="adv"):
    data = np.random.default_rng(0).normal(size=(n, t, nx)).astype(np.float32)
    src = tmp_path / f"{name}.hdf5"
    with h5py.File(src, "w") as f:
        f.create_dataset("tensor", data=data)
    return build_cache(name, TaskConfig(pde="advection1d"), src, tmp_path / "cache")


def _darcy_cache(tmp_path, n=20, res=8):
    rng = np.random.default_rng(1)
    src = tmp_path / "darcy.hdf5"
    with h5py.File(src, "w") as f:
        f.create_dataset("nu", data=rng.normal(size=(n, res, res)).astype(np.float32))
        f.create_dataset("tensor", data=rng.normal(size=(n, 1, res, res)).astype(np.float32))
    return build_cache("darcy", TaskConfig(pde="darcy2d"), src, tmp_path / "cache")


@pytest.fixture
def adv(tmp_path):
    return _adv_cache(tmp_path)


@pytest.fixture
def darcy(tmp_path):
    return _darcy_cache(tmp_path)


# -------------------------------------------------------------------------------------- WindowDataset
@pytest.mark.parametrize("k", [1, 3, 8])
def test_window_dataset_length(adv, k):
    ds = WindowDataset(adv, "train", k)
    assert adv.sizes["train"] == 16
    assert len(ds) == 16 * (9 - k)


def test_window_dataset_items_match_the_raw_memmap(adv):
    k = 3
    ds = WindowDataset(adv, "train", k)
    raw = np.asarray(adv.array("train"))
    per = 9 - k
    indices = [0, 1, per - 1, per, per + 2, 5 * per + 4, len(ds) - 1]
    batch = ds.__getitems__(indices)
    assert set(batch) == {"x", "y"}
    assert batch["x"].shape == (len(indices), k, 16, 1)
    assert batch["y"].shape == (len(indices), 16, 1)
    assert batch["x"].dtype == torch.float32
    for row, i in enumerate(indices):
        sample, t0 = i // per, i % per
        np.testing.assert_array_equal(batch["x"][row].numpy(), raw[sample, t0 : t0 + k])
        np.testing.assert_array_equal(batch["y"][row].numpy(), raw[sample, t0 + k])
    # the last window ends on the last frame of the last trajectory
    np.testing.assert_array_equal(batch["y"][-1].numpy(), raw[-1, -1])


@pytest.mark.parametrize("horizon", [2, 5])
def test_windows_with_several_target_frames_stack_them_and_end_on_the_last_frame(adv, horizon):
    k = 3
    ds = WindowDataset(adv, "train", k, horizon)
    per = 9 - k - horizon + 1
    assert len(ds) == 16 * per
    raw = np.asarray(adv.array("train"))
    indices = [0, per - 1, per, len(ds) - 1]
    batch = ds.__getitems__(indices)
    assert batch["x"].shape == (len(indices), k, 16, 1)
    assert batch["y"].shape == (len(indices), horizon, 16, 1)
    for row, i in enumerate(indices):
        sample, t0 = divmod(i, per)
        np.testing.assert_array_equal(batch["x"][row].numpy(), raw[sample, t0 : t0 + k])
        np.testing.assert_array_equal(batch["y"][row].numpy(), raw[sample, t0 + k : t0 + k + horizon])
    np.testing.assert_array_equal(batch["y"][-1, -1].numpy(), raw[-1, -1])
    # The one-step index beside it is untouched: the two horizons read different index files.
    assert len(WindowDataset(adv, "train", k)) == 16 * (9 - k)


def test_window_dataset_getitem_and_order_of_indices(adv):
    ds = WindowDataset(adv, "val", 4)
    raw = np.asarray(adv.array("val"))
    assert len(ds) == 2 * 5
    item = ds[7]  # sample 1, window 2
    np.testing.assert_array_equal(item["x"].numpy(), raw[1, 2:6])
    np.testing.assert_array_equal(item["y"].numpy(), raw[1, 6])
    rev = ds.__getitems__([9, 0, 9])
    np.testing.assert_array_equal(rev["y"][0].numpy(), raw[1, 8])
    np.testing.assert_array_equal(rev["y"][1].numpy(), raw[0, 4])
    np.testing.assert_array_equal(rev["x"][2].numpy(), rev["x"][0].numpy())


def test_window_dataset_2d_multichannel(tmp_path):
    rng = np.random.default_rng(2)
    keys = ("density", "pressure", "Vx", "Vy")
    src = tmp_path / "cfd2d.hdf5"
    with h5py.File(src, "w") as f:
        for key in keys:
            f.create_dataset(key, data=rng.normal(size=(10, 6, 4, 4)).astype(np.float32))
    info = build_cache("cfd", TaskConfig(pde="cfd2d"), src, tmp_path / "cache")
    ds = training_dataset(info, "train", 2)
    assert isinstance(ds, WindowDataset)
    raw = np.asarray(info.array("train"))
    b = ds.__getitems__([0, 13])  # sample 3, window 1
    assert b["x"].shape == (2, 2, 4, 4, 4)
    np.testing.assert_array_equal(b["x"][1].numpy(), raw[3, 1:3])
    np.testing.assert_array_equal(b["y"][1].numpy(), raw[3, 3])


# ---------------------------------------------------------------------------------------- PairDataset
def test_pair_dataset(darcy):
    ds = training_dataset(darcy, "train", 10)
    assert isinstance(ds, PairDataset)
    assert len(ds) == 16
    xs = np.asarray(darcy.array("train", "x"))
    ys = np.asarray(darcy.array("train", "y"))
    idx = [0, 3, 15, 7]
    b = ds.__getitems__(idx)
    assert b["x"].shape == (4, 8, 8, 1)
    np.testing.assert_array_equal(b["x"].numpy(), xs[idx])
    np.testing.assert_array_equal(b["y"].numpy(), ys[idx])
    one = ds[5]
    np.testing.assert_array_equal(one["x"].numpy(), xs[5])
    np.testing.assert_array_equal(one["y"].numpy(), ys[5])
    test = PairDataset(darcy, "test")
    assert len(test) == 2
    np.testing.assert_array_equal(test[1]["y"].numpy(), np.asarray(darcy.array("test", "y"))[1])


# -------------------------------------------------------------------------------------------- pickling
def test_datasets_pickle_without_arrays(tmp_path):
    info = _adv_cache(tmp_path, n=40, t=11, nx=4096)  # a 7 MB training array, mapped in its source file
    assert info.array("train").nbytes > 5_000_000
    ds = WindowDataset(info, "train", 4)
    before = ds.__getitems__([0, 100, 200])  # maps the arrays
    assert ds._arrays is not None
    blob = pickle.dumps(ds)
    assert len(blob) < 2_000
    assert ds._arrays is not None  # the original keeps its maps
    clone = pickle.loads(blob)
    assert clone._arrays is None
    assert len(clone) == len(ds)
    after = clone.__getitems__([0, 100, 200])
    for key in ("x", "y"):
        assert torch.equal(before[key], after[key])


def test_pair_dataset_pickles_without_arrays(darcy):
    ds = PairDataset(darcy, "train")
    before = ds.__getitems__([1, 2])
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._arrays is None
    assert len(pickle.dumps(ds)) < 2_000
    after = clone.__getitems__([1, 2])
    assert torch.equal(before["x"], after["x"])
    assert torch.equal(before["y"], after["y"])


# -------------------------------------------------------------------------------------------- loader
def _loader_batches(ds, num_workers, epoch):
    sampler = EqualBatchSampler(len(ds), 5, 7, rank=1, world_size=2, seed=3, stream=0)
    sampler.set_epoch(epoch)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=keep_batch, num_workers=num_workers)
    return list(loader), list(sampler)


def test_dataloader_workers_give_identical_batches(adv):
    ds = WindowDataset(adv, "train", 3)
    serial, indices = _loader_batches(ds, 0, epoch=2)
    parallel, _ = _loader_batches(ds, 2, epoch=2)
    assert len(serial) == len(parallel) == 7
    for a, b, idx in zip(serial, parallel, indices, strict=True):
        assert torch.equal(a["x"], b["x"])
        assert torch.equal(a["y"], b["y"])
        direct = ds.__getitems__(idx)
        assert torch.equal(a["x"], direct["x"])
        assert a["x"].shape == (5, 3, 16, 1)


@pytest.mark.parametrize("num_workers", [1, 4])
def test_persistent_workers_follow_the_sampler_across_epochs(adv, num_workers):
    ds = WindowDataset(adv, "train", 3)
    sampler = EqualBatchSampler(len(ds), 5, 4, rank=0, world_size=2, seed=3, stream=0)
    loader = DataLoader(
        ds, batch_sampler=sampler, collate_fn=keep_batch, num_workers=num_workers, persistent_workers=True
    )
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        expected = [ds.__getitems__(idx) for idx in sampler]
        got = list(loader)
        assert len(got) == 4
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])


class _Draws:
    """Each batch is the random draws of the worker that made it."""

    def __len__(self):
        return 8

    def __getitems__(self, indices):
        info = torch.utils.data.get_worker_info()
        return (info.id, np.random.random(), random.random(), float(torch.rand(())))


def _draws(rank, seed=0):
    torch.manual_seed(0)  # as on every rank after model init: torch's own worker seeds would be equal across ranks
    loader = DataLoader(
        _Draws(),
        batch_sampler=[[i] for i in range(8)],
        collate_fn=keep_batch,
        num_workers=2,
        worker_init_fn=worker_seeding(seed, rank),
    )
    return {worker: draws for worker, *draws in loader}  # the last batch of each worker


def test_workers_are_seeded_from_seed_rank_and_worker():
    rank0, rank1 = _draws(0), _draws(1)
    assert sorted(rank0) == [0, 1]
    values = [v for draws in (rank0, rank1) for d in draws.values() for v in d]
    assert len(set(values)) == len(values)  # no two workers of any rank draw alike, from any generator
    assert _draws(0) == rank0  # and a run repeats
    assert _draws(0, seed=1) != rank0


# ------------------------------------------------------------------------------------------- sampler
def _all_ranks(n, batch, steps, world, seed=0, stream=0, epoch=0):
    out = []
    for rank in range(world):
        s = EqualBatchSampler(n, batch, steps, rank, world, seed, stream)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n", [1, 3, 7, 24, 25, 100, 1000])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sampler_equal_steps_for_any_size(n, world):
    steps, batch = 4, 2
    per_rank = _all_ranks(n, batch, steps, world)
    for batches in per_rank:
        assert len(batches) == steps
        for b in batches:
            assert len(b) == batch
            assert all(isinstance(i, int) and 0 <= i < n for i in b)
            assert b == sorted(b)
    assert len(EqualBatchSampler(n, batch, steps, 0, world, 0, 0)) == steps


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sampler_one_pass_covers_each_index_once(world):
    steps, batch = 5, 3
    n = steps * world * batch
    per_rank = _all_ranks(n, batch, steps, world, seed=7)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(n))
    sets = [{i for b in batches for i in b} for batches in per_rank]
    for r in range(world):
        for q in range(r + 1, world):
            assert not sets[r] & sets[q]  # ranks disjoint


def test_sampler_larger_dataset_is_read_partially_without_repeats():
    n, steps, batch, world = 1000, 3, 4, 2
    per_rank = _all_ranks(n, batch, steps, world)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == steps * batch * world
    assert len(set(seen)) == len(seen)


def test_sampler_small_dataset_is_passed_over_several_times():
    # 6 items, 2 ranks x 3 per batch: every step is one whole pass
    n, steps, batch, world = 6, 4, 3, 2
    per_rank = _all_ranks(n, batch, steps, world, seed=1)
    for step in range(steps):
        together = per_rank[0][step] + per_rank[1][step]
        assert sorted(together) == list(range(n))
        assert not set(per_rank[0][step]) & set(per_rank[1][step])
    counts = Counter(i for batches in per_rank for b in batches for i in b)
    assert counts == dict.fromkeys(range(n), steps)


def test_sampler_two_passes_cover_each_index_once_per_pass():
    n, steps, batch, world = 12, 4, 3, 2  # 24 indices: passes = steps 0-1 and steps 2-3
    per_rank = _all_ranks(n, batch, steps, world, seed=5)
    for first, last in ((0, 2), (2, 4)):
        seen = [i for batches in per_rank for b in batches[first:last] for i in b]
        assert sorted(seen) == list(range(n))


def test_sampler_epochs_differ_and_repeat():
    def order(seed, epoch, stream=0):
        s = EqualBatchSampler(50, 4, 5, 0, 2, seed, stream)
        s.set_epoch(epoch)
        return list(s)

    assert order(0, 0) == order(0, 0)
    assert order(3, 5) == order(3, 5)
    assert order(0, 0) != order(0, 1)
    assert order(0, 1) != order(0, 2)
    assert order(0, 0) != order(1, 0)
    assert order(0, 0) != order(0, 0, stream=1)  # tasks draw independent orders


def test_sampler_set_epoch_after_iteration():
    s = EqualBatchSampler(50, 4, 5, 1, 2, 0, 0)
    a = list(s)
    s.set_epoch(1)
    b = list(s)
    s.set_epoch(0)
    assert list(s) == a
    assert a != b


def test_sampler_order_is_a_shuffle():
    # not the identity order: a sampler that forgot to shuffle would pass every other test of one pass
    batches = _all_ranks(100, 10, 10, 1, seed=0)[0]
    flat = [i for b in batches for i in b]
    assert flat != sorted(flat)


@pytest.mark.parametrize(
    ("n", "batch", "world", "steps"), [(100, 10, 1, 10), (100, 10, 2, 5), (5, 10, 2, 1), (99, 10, 2, 4)]
)
def test_steps_for_one_pass(n, batch, world, steps):
    assert steps_for_one_pass(n, batch, world) == steps
