"""The relative L2 error against neuraloperator's own ``LpLoss`` (a test-only dependency), the metric of the FNO
papers' tables: a steady 2D field, and a rollout whose whole predicted field is flattened as the FNO paper's
time-dependent scripts flatten it."""

from __future__ import annotations

import pytest
import torch
from neuralop.losses import LpLoss

from train.engine.metrics import error_sums, finish


def _ours(pred: torch.Tensor, target: torch.Tensor) -> float:
    """Our rel_l2 of (batch, time, *space, channel) fields, summed over two halves of the batch as two ranks'
    shards would be."""
    half = len(pred) // 2
    return finish(error_sums(pred[:half], target[:half]) + error_sums(pred[half:], target[half:]))["rel_l2"]


def test_rel_l2_of_a_steady_field_is_lploss():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(6, 1, 17, 19, 1, generator=g, dtype=torch.float64)  # (batch, one step, x, y, channel)
    pred = target + 0.1 * torch.randn(target.shape, generator=g, dtype=torch.float64)
    reference = LpLoss(d=2, p=2, reduction="sum").rel(pred[:, 0, ..., 0], target[:, 0, ..., 0]) / len(pred)
    assert _ours(pred, target) == pytest.approx(float(reference), rel=1e-6)


def test_rel_l2_of_a_rollout_flattens_every_step_and_channel():
    g = torch.Generator().manual_seed(1)
    target = torch.randn(4, 5, 8, 8, 2, generator=g, dtype=torch.float64)  # 5 predicted steps, 2 channels
    pred = target * 1.05 + 0.02 * torch.randn(target.shape, generator=g, dtype=torch.float64)
    flat = LpLoss(d=1, p=2, reduction="sum").rel(pred.reshape(len(pred), -1), target.reshape(len(target), -1))
    assert _ours(pred, target) == pytest.approx(float(flat) / len(pred), rel=1e-6)


def test_rel_l2_is_zero_for_a_perfect_prediction_and_one_for_zero():
    target = torch.rand(3, 2, 16, 1, dtype=torch.float64) + 0.5
    assert _ours(target.clone(), target) == 0.0
    assert _ours(torch.zeros_like(target), target) == pytest.approx(1.0)
