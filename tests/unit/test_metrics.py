"""Tests of the PDEBench metrics against a direct numpy implementation of their definitions
(docs/data-formats.md, 'Metrics')."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import run_ranks
from train.distributed.collectives import all_reduce_max
from train.engine.metrics import (
    KEYS,
    SCALARS,
    ErrorSums,
    error_sums,
    field_scores,
    finish,
    nrmse_by_step,
    spectrum_bins,
)


def _band_means(per_bin: np.ndarray) -> list[float]:
    """PDEBench's bands over wavenumber bins: [0, 4), [4, 12), [12, end); NaN for a band with no bins."""
    bands = [per_bin[lo:hi] for lo, hi in ((0, 4), (4, 12), (12, None))]
    return [float(np.mean(band)) if len(band) else math.nan for band in bands]


def _fourier_bins(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(batch, *space) fields of one time step and channel -> sqrt(mean_b |P - Y|^2 in each bin) / N, as PDEBench."""
    b, *space = y.shape
    n = int(np.prod(space))
    if len(space) == 1:
        power = np.abs(np.fft.rfft(p, axis=1) - np.fft.rfft(y, axis=1)) ** 2  # (b, nx // 2 + 1)
    else:
        nx, ny = space
        full = np.abs(np.fft.fft2(p) - np.fft.fft2(y)) ** 2
        power = np.zeros((b, min(nx // 2, ny // 2)))
        for i in range(nx // 2):
            for j in range(ny // 2):
                r = math.isqrt(i * i + j * j)
                if r < power.shape[1]:
                    power[:, r] += full[:, i, j]
    return np.sqrt(power.mean(0)) / n


def _boundary(field: np.ndarray) -> np.ndarray:
    """The boundary points of one (*space) field: two end points in 1D, the four edges in 2D."""
    if field.ndim == 1:
        return field[[0, -1]]
    return np.concatenate([field[0, :], field[-1, :], field[:, 0], field[:, -1]])


def reference(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """Every metric on (batch, time, *space, channel), one (time, channel) at a time, in float64."""
    pred, target = pred.astype(np.float64), target.astype(np.float64)
    b, t, *space, c = target.shape
    n = int(np.prod(space))
    per_term = {"rmse": [], "nrmse": [], "brmse": []}
    per_tc = {"crmse": [], "max_error": [], "frmse_low": [], "frmse_mid": [], "frmse_high": []}
    for k in range(t):
        for ch in range(c):
            p, y = pred[:, k, ..., ch], target[:, k, ..., ch]
            for i in range(b):
                err = np.sqrt(np.mean((p[i] - y[i]) ** 2))
                per_term["rmse"].append(err)
                per_term["nrmse"].append(err / np.sqrt(np.mean(y[i] ** 2)))
                per_term["brmse"].append(np.sqrt(np.mean((_boundary(p[i]) - _boundary(y[i])) ** 2)))
            conserved = p.reshape(b, -1).sum(1) - y.reshape(b, -1).sum(1)
            per_tc["crmse"].append(np.sqrt(np.mean(conserved**2)) / n)
            per_tc["max_error"].append(np.max(np.abs(p - y)))
            low, mid, high = _band_means(_fourier_bins(p, y))
            per_tc["frmse_low"].append(low)
            per_tc["frmse_mid"].append(mid)
            per_tc["frmse_high"].append(high)
    # the relative L2 per sample over its whole field (every step and channel), averaged over the samples
    rel_l2 = [np.linalg.norm((pred[i] - target[i]).ravel()) / np.linalg.norm(target[i].ravel()) for i in range(b)]
    return {key: float(np.mean(values)) for key, values in {**per_term, **per_tc, "rel_l2": rel_l2}.items()}


def _fields(shape, seed=0, scale_per_sample=True):
    rng = np.random.default_rng(seed)
    target = rng.normal(size=shape)
    if scale_per_sample:  # very different magnitudes, so nRMSE and RMSE disagree about which sample is worse
        target *= np.logspace(-2, 2, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    pred = target + 0.1 * rng.normal(size=shape) + 0.05 * rng.normal(size=(shape[0], 1, *shape[2:]))
    return pred, target


def _metrics(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    return finish(error_sums(torch.from_numpy(pred), torch.from_numpy(target)))


SHAPES = [(3, 4, 32, 1), (2, 5, 40, 3), (1, 3, 7, 1), (3, 2, 32, 28, 2), (2, 1, 24, 30, 1), (2, 2, 8, 6, 3)]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_metric_matches_numpy(shape):
    pred, target = _fields(shape)
    ref = reference(pred, target)
    got = _metrics(pred, target)
    assert list(got) == list(KEYS)
    for key in KEYS:
        if math.isnan(ref[key]):  # a grid too coarse for the band
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(ref[key], rel=1e-10), key
    assert all(math.isfinite(got[k]) for k in ("rmse", "nrmse", "crmse", "brmse", "max_error", "frmse_low"))


@pytest.mark.parametrize("shape", SHAPES)
def test_nrmse_by_step_matches_numpy_and_averages_to_the_nrmse(shape):
    pred, target = _fields(shape)
    rmse = np.sqrt(((pred - target) ** 2).mean(axis=tuple(range(2, pred.ndim - 1))))  # (sample, time, channel)
    scale = np.sqrt((target**2).mean(axis=tuple(range(2, pred.ndim - 1))))
    want = (rmse / scale).mean(axis=(0, 2))
    sums = error_sums(torch.from_numpy(pred), torch.from_numpy(target))
    got = nrmse_by_step(sums)
    assert got == pytest.approx(want.tolist(), rel=1e-10)
    assert float(np.mean(got)) == pytest.approx(finish(sums)["nrmse"], rel=1e-10)
    first, second = (
        error_sums(*map(torch.from_numpy, (pred[:1], target[:1]))),
        error_sums(*map(torch.from_numpy, (pred[1:], target[1:]))),
    )
    assert nrmse_by_step(first + second) == pytest.approx(got, rel=1e-12)  # ranks' sums add up


def test_sums_have_the_documented_shapes():
    sums = error_sums(torch.zeros(2, 3, 20, 18, 4), torch.ones(2, 3, 20, 18, 4))
    assert sums.scalars.shape == (len(SCALARS),) and sums.scalars.dtype == torch.float64
    assert sums.conservation.shape == sums.max_abs.shape == (3, 4)
    assert sums.spectrum.shape == (3, 4, spectrum_bins((20, 18))) == (3, 4, 9)
    assert spectrum_bins((64,)) == 33  # every rfft mode, Nyquist included
    assert dict(zip(SCALARS, sums.scalars.tolist(), strict=True))["terms"] == 2 * 3 * 4
    assert dict(zip(SCALARS, sums.scalars.tolist(), strict=True))["samples"] == 2


def test_float32_inputs_are_summed_in_float64():
    pred, target = _fields((4, 3, 32, 2), seed=1)
    p32, y32 = pred.astype(np.float32), target.astype(np.float32)
    ref = reference(p32, y32)
    got = _metrics(p32, y32)
    assert error_sums(torch.from_numpy(p32), torch.from_numpy(y32)).spectrum.dtype == torch.float64
    for key in KEYS:
        assert got[key] == pytest.approx(ref[key], rel=1e-9), key


def test_nrmse_is_per_time_step_not_per_trajectory():
    # one trajectory whose target grows 100x over time, with the same absolute error at both times
    target = np.ones((1, 2, 4, 1))
    target[0, 1] *= 100.0
    pred = target + 0.5
    m = _metrics(pred, target)
    assert m["nrmse"] == pytest.approx((0.5 / 1.0 + 0.5 / 100.0) / 2, rel=1e-12)
    assert m["nrmse"] != pytest.approx(0.5 / np.sqrt(np.mean(target**2)), rel=1e-3)
    assert m["rmse"] == pytest.approx(0.5, rel=1e-12)


def _split(shape, cut, seed):
    pred, target = _fields(shape, seed=seed)
    p, y = torch.from_numpy(pred), torch.from_numpy(target)
    return error_sums(p, y), error_sums(p[:cut], y[:cut]), error_sums(p[cut:], y[cut:])


@pytest.mark.parametrize(("shape", "cut"), [((6, 3, 32, 2), 1), ((6, 3, 32, 2), 5), ((5, 2, 28, 26, 2), 2)])
def test_two_ranks_partial_sums_add_up_to_the_whole_batch(shape, cut):
    whole, first, second = _split(shape, cut, seed=3)
    parts = first + second
    for name in ("scalars", "conservation", "spectrum"):
        torch.testing.assert_close(getattr(parts, name), getattr(whole, name), rtol=1e-12, atol=0)
    assert torch.equal(parts.max_abs, torch.maximum(first.max_abs, second.max_abs))
    assert torch.equal(parts.max_abs, whole.max_abs)
    assert finish(parts) == pytest.approx(finish(whole), rel=1e-12)
    # The exact weighted mean and root over all samples, unlike a mean of the parts' results (PDEBench's
    # per-batch averaging): unequal parts, and cRMSE's root of a mean is no mean of roots.
    mean_of_parts = {k: (finish(first)[k] + finish(second)[k]) / 2 for k in KEYS}
    assert finish(whole)["nrmse"] != pytest.approx(mean_of_parts["nrmse"], rel=1e-6)
    assert finish(whole)["crmse"] != pytest.approx(mean_of_parts["crmse"], rel=1e-6)
    assert finish(whole)["max_error"] >= max(finish(first)["max_error"], finish(second)["max_error"])


def test_an_empty_shard_adds_nothing():
    pred, target = _fields((3, 2, 16, 12, 2), seed=5)
    sums = error_sums(torch.from_numpy(pred), torch.from_numpy(target))
    empty = ErrorSums.zeros(2, (16, 12), 2)
    assert finish(empty + sums) == pytest.approx(finish(sums), rel=0, abs=0, nan_ok=True)
    none_scored = error_sums(torch.zeros(0, 2, 16, 12, 2), torch.zeros(0, 2, 16, 12, 2))
    for name in ("scalars", "conservation", "spectrum", "max_abs"):
        assert torch.equal(getattr(none_scored, name), getattr(empty, name)), name


@pytest.mark.parametrize("space", [(64,), (32, 40)])
@pytest.mark.parametrize("offset", [0.5, -2.0])
def test_a_constant_offset_gives_known_values(space, offset):
    rng = np.random.default_rng(6)
    target = 1.0 + rng.random((3, 2, *space, 2))
    m = _metrics(target + offset, target)
    for key in ("rmse", "crmse", "brmse", "max_error"):
        assert m[key] == pytest.approx(abs(offset), rel=1e-12), key
    # A constant is wavenumber 0 only, whose normalised amplitude is the offset; the low band averages 4 bins.
    assert m["frmse_low"] == pytest.approx(abs(offset) / 4, rel=1e-12)
    assert m["frmse_mid"] == pytest.approx(0, abs=1e-14)
    assert m["frmse_high"] == pytest.approx(0, abs=1e-14)


@pytest.mark.parametrize(("space", "high_bins"), [((64,), 21), ((64, 48), 12)])
def test_a_high_frequency_error_lands_in_the_high_band_only(space, high_bins):
    target = np.random.default_rng(7).normal(size=(2, 3, *space, 1))
    x = np.arange(space[0]).reshape(-1, *([1] * (len(space) - 1)))
    wave = 0.3 * np.cos(2 * np.pi * 16 * x / space[0])  # wavenumber 16 along x: bin 16
    pred = target + wave[..., None]
    m = _metrics(pred, target)
    assert m["frmse_low"] == pytest.approx(0, abs=1e-14)
    assert m["frmse_mid"] == pytest.approx(0, abs=1e-14)
    # cos has amplitude 0.3 / 2 at +16 (the only one of its two modes PDEBench's spectrum keeps), and the
    # band averages over its bins 12.. (21 rfft bins up to 32 in 1D, 12 radial bins up to 23 in 2D).
    assert m["frmse_high"] == pytest.approx(0.15 / high_bins, rel=1e-12)
    assert m["rmse"] == pytest.approx(0.3 / np.sqrt(2), rel=1e-12)
    assert m["crmse"] == pytest.approx(0, abs=1e-14)


@pytest.mark.parametrize("shape", [(2, 3, 32, 1), (2, 2, 16, 16, 3), (1, 1, 4, 1)])
def test_a_perfect_prediction_scores_zero_everywhere(shape):
    _, target = _fields(shape, seed=4)
    t = torch.from_numpy(target)
    m = finish(error_sums(t.clone(), t))
    for key in KEYS:
        assert m[key] == 0.0 or (math.isnan(m[key]) and key.startswith("frmse")), key
    assert m["frmse_low"] == 0.0


def test_zero_target_gives_finite_zero_for_a_perfect_prediction():
    zeros = torch.zeros(2, 3, 32, 1)
    m = finish(error_sums(zeros.clone(), zeros))
    assert m == dict.fromkeys(KEYS, 0.0)


def test_a_band_beyond_the_grid_is_nan():
    pred, target = _fields((2, 2, 8, 6, 1), seed=8)  # 3 radial bins: no mid, no high
    m = _metrics(pred, target)
    assert math.isfinite(m["frmse_low"])
    assert math.isnan(m["frmse_mid"]) and math.isnan(m["frmse_high"])


def test_finish_of_nothing_is_nan():
    m = finish(ErrorSums.zeros(3, (16,), 2))
    assert list(m) == list(KEYS)
    assert all(math.isnan(v) for v in m.values())


def test_shape_mismatch_is_rejected():
    with pytest.raises(AssertionError):
        error_sums(torch.zeros(2, 3, 8, 1), torch.zeros(2, 3, 8, 2))
    with pytest.raises(AssertionError):
        error_sums(torch.zeros(2, 8, 1), torch.zeros(2, 8, 1))  # no time axis


def test_reductions_without_a_process_group_are_copies():
    sums = _split((4, 2, 16, 1), 1, seed=9)[0]
    reduced = sums.all_reduce()
    assert finish(reduced) == pytest.approx(finish(sums), rel=0, abs=0, nan_ok=True)
    values = torch.tensor([1.0, -3.0], dtype=torch.float64)
    out = all_reduce_max(values)
    assert torch.equal(out, values) and out is not values


def _reduce_rank(rank: int, out: Path) -> None:
    from train.distributed.env import DistEnv, destroy_distributed, init_distributed

    init_distributed(DistEnv.from_environ("gloo"), 60)
    try:
        pred, target = _fields((5, 3, 32, 28, 2), seed=10)
        mine = slice(rank, None, 2)  # uneven shards: 3 samples and 2
        sums = error_sums(torch.from_numpy(pred[mine]), torch.from_numpy(target[mine]))
        reduced = sums.all_reduce()
        torch.save({"metrics": finish(reduced), "max_abs": reduced.max_abs}, out / f"rank{rank}.pt")
    finally:
        destroy_distributed()


@pytest.mark.distributed
def test_two_gloo_ranks_reduce_to_the_single_process_result(tmp_path):
    run_ranks(_reduce_rank, 2, tmp_path)
    pred, target = _fields((5, 3, 32, 28, 2), seed=10)
    whole = error_sums(torch.from_numpy(pred), torch.from_numpy(target))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["max_abs"], whole.max_abs)
        assert all(math.isfinite(v) for v in got["metrics"].values())
        assert got["metrics"] == pytest.approx(finish(whole), rel=1e-12)


def test_per_field_errors_equal_a_direct_computation():
    rng = np.random.default_rng(3)
    pred, target = rng.normal(size=(4, 3, 16, 2)), rng.normal(size=(4, 3, 16, 2)) + 1.0
    sums = error_sums(torch.from_numpy(pred), torch.from_numpy(target))
    scores = field_scores(sums, ["a", "b"])
    for c, name in enumerate(("a", "b")):
        rmse = np.sqrt(((pred - target)[..., c] ** 2).mean(axis=2))  # per (sample, time)
        nrmse = rmse / np.sqrt((target[..., c] ** 2).mean(axis=2))
        assert scores["rmse_by_field"][name] == pytest.approx(rmse.mean(), rel=1e-12)
        assert scores["nrmse_by_field"][name] == pytest.approx(nrmse.mean(), rel=1e-12)
    assert scores["nrmse_dynamic"] == pytest.approx(
        finish(error_sums(torch.from_numpy(pred), torch.from_numpy(target)))["nrmse"]
    )


def test_a_field_constant_over_its_trajectory_does_not_dominate_the_headline():
    """A flow's density evolves; its velocity is a uniform constant, in one trajectory 0.003. A prediction that
    drifts by 3% of the model's std floor (0.0005) on that channel only: nRMSE divides the drift by 0.003 and is
    dominated by it (0.017 of 0.0191 in the benchmark that found it); over the fields that change it is not."""
    rng = np.random.default_rng(0)
    x = np.linspace(0, 1, 64, endpoint=False)
    density = np.stack([1 + 0.2 * np.sin(2 * np.pi * (x - 0.1 * t)) for t in range(1, 6)])  # (time, x)
    target = np.zeros((2, 5, 64, 2))
    target[..., 0] = density
    target[0, ..., 1], target[1, ..., 1] = 0.5, 0.003  # constant over each trajectory
    pred = target.copy()
    pred[..., 0] += 0.01 * rng.normal(size=pred[..., 0].shape)  # a 1% error on the field that changes
    pred[1, ..., 1] += 0.0005  # a drift of the constant channel
    sums = error_sums(torch.from_numpy(pred), torch.from_numpy(target))
    plain, scores = finish(sums)["nrmse"], field_scores(sums, ["density", "velocity_x"])
    density_only = scores["nrmse_by_field"]["density"]
    assert plain > 4 * density_only  # the plain mean: the constant channel's 17% on one sample is 80% of it
    assert scores["nrmse_dynamic"] == pytest.approx(density_only, rel=1e-9)
    assert scores["constant_fields"] == {"density": 0.0, "velocity_x": 1.0}
