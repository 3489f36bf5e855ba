"""Tests of the PDEBench error sums against a direct numpy implementation of RMSE and nRMSE."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from train.engine.metrics import SUMS, error_sums, finish


def reference(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """PDEBench's metrics on (batch, time, *space, channel), one (sample, time, channel) term at a time."""
    b, t, *space, c = target.shape
    nrmse, rmse = [], []
    for i in range(b):
        for k in range(t):
            for ch in range(c):
                p = pred[i, k, ..., ch].astype(np.float64).ravel()
                y = target[i, k, ..., ch].astype(np.float64).ravel()
                assert p.size == int(np.prod(space))
                err = np.sqrt(np.mean((p - y) ** 2))
                rmse.append(err)
                nrmse.append(err / np.sqrt(np.mean(y**2)))
    return {"nrmse": float(np.sum(nrmse)), "rmse": float(np.sum(rmse)), "count": float(len(rmse))}


def _fields(shape, seed=0, scale_per_sample=True):
    rng = np.random.default_rng(seed)
    target = rng.normal(size=shape)
    if scale_per_sample:  # very different magnitudes, so nRMSE and RMSE disagree about which sample is worse
        target *= np.logspace(-2, 2, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    pred = target + 0.1 * rng.normal(size=shape)
    return pred, target


@pytest.mark.parametrize(
    "shape",
    [(3, 4, 16, 1), (2, 5, 32, 3), (3, 2, 8, 6, 2), (2, 1, 4, 4, 1), (1, 3, 7, 1)],
)
def test_error_sums_match_numpy(shape):
    pred, target = _fields(shape)
    ref = reference(pred, target)
    sums = error_sums(torch.from_numpy(pred), torch.from_numpy(target))
    assert sums.dtype == torch.float64
    assert sums.shape == (len(SUMS),)
    got = dict(zip(SUMS, sums.tolist(), strict=True))
    assert got["count"] == ref["count"] == shape[0] * shape[1] * shape[-1]
    assert got["nrmse"] == pytest.approx(ref["nrmse"], rel=1e-12)
    assert got["rmse"] == pytest.approx(ref["rmse"], rel=1e-12)


def test_error_sums_float32_inputs_are_summed_in_float64():
    pred, target = _fields((4, 3, 16, 2), seed=1)
    p32, y32 = pred.astype(np.float32), target.astype(np.float32)
    ref = reference(p32, y32)
    got = error_sums(torch.from_numpy(p32), torch.from_numpy(y32))
    assert float(got[0]) == pytest.approx(ref["nrmse"], rel=1e-10)
    assert float(got[1]) == pytest.approx(ref["rmse"], rel=1e-10)


def test_nrmse_is_per_time_step_not_per_trajectory():
    # one trajectory whose target grows 100x over time, with the same absolute error at both times
    target = np.ones((1, 2, 4, 1))
    target[0, 1] *= 100.0
    pred = target + 0.5
    m = finish(error_sums(torch.from_numpy(pred), torch.from_numpy(target)))
    expected = (0.5 / 1.0 + 0.5 / 100.0) / 2  # mean of per-time ratios
    assert m["nrmse"] == pytest.approx(expected, rel=1e-12)
    whole_trajectory = 0.5 / np.sqrt(np.mean(target**2))
    assert m["nrmse"] != pytest.approx(whole_trajectory, rel=1e-3)
    assert m["rmse"] == pytest.approx(0.5, rel=1e-12)


def test_finish_divides_by_count():
    pred, target = _fields((3, 4, 8, 2), seed=2)
    ref = reference(pred, target)
    m = finish(error_sums(torch.from_numpy(pred), torch.from_numpy(target)))
    assert set(m) == {"nrmse", "rmse"}
    assert m["nrmse"] == pytest.approx(ref["nrmse"] / ref["count"], rel=1e-12)
    assert m["rmse"] == pytest.approx(ref["rmse"] / ref["count"], rel=1e-12)
    assert finish(torch.tensor([6.0, 3.0, 4.0], dtype=torch.float64)) == {"nrmse": 1.5, "rmse": 0.75}


def test_finish_of_nothing_is_nan():
    m = finish(torch.zeros(3, dtype=torch.float64))
    assert np.isnan(m["nrmse"])
    assert np.isnan(m["rmse"])


@pytest.mark.parametrize("cut", [1, 2, 5])
def test_sums_of_parts_equal_the_whole(cut):
    pred, target = _fields((6, 3, 8, 4, 2), seed=3)
    p, y = torch.from_numpy(pred), torch.from_numpy(target)
    whole = error_sums(p, y)
    parts = error_sums(p[:cut], y[:cut]) + error_sums(p[cut:], y[cut:])
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=0)
    assert finish(parts) == pytest.approx(finish(whole), rel=1e-12)
    # the exact weighted mean, unlike a mean of per-batch means over unequal batches
    mean_of_means = (finish(error_sums(p[:cut], y[:cut]))["nrmse"] + finish(error_sums(p[cut:], y[cut:]))["nrmse"]) / 2
    assert finish(whole)["nrmse"] != pytest.approx(mean_of_means, rel=1e-6)  # unequal parts: 6 is never cut in half


@pytest.mark.parametrize("shape", [(2, 3, 16, 1), (2, 2, 4, 4, 3)])
def test_perfect_prediction_scores_zero(shape):
    _, target = _fields(shape, seed=4)
    t = torch.from_numpy(target)
    sums = error_sums(t.clone(), t)
    assert float(sums[0]) == 0.0
    assert float(sums[1]) == 0.0
    assert float(sums[2]) == shape[0] * shape[1] * shape[-1]
    assert finish(sums) == {"nrmse": 0.0, "rmse": 0.0}


def test_zero_target_gives_finite_zero_for_a_perfect_prediction():
    zeros = torch.zeros(2, 3, 8, 1)
    sums = error_sums(zeros.clone(), zeros)
    assert torch.isfinite(sums).all()
    assert finish(sums)["nrmse"] == 0.0


def test_shape_mismatch_is_rejected():
    with pytest.raises(AssertionError):
        error_sums(torch.zeros(2, 3, 8, 1), torch.zeros(2, 3, 8, 2))
    with pytest.raises(AssertionError):
        error_sums(torch.zeros(2, 8, 1), torch.zeros(2, 8, 1))  # no time axis
