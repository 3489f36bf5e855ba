"""The Well's metrics, VRMSE and NRMSE, as sums that ranks reduce exactly (docs/well.md, 'Metrics').

Per sample, time step and channel, over the spatial axes, in physical units:
VRMSE = sqrt(mean((p - y)^2) / (var(y) + 1e-7)) with the n-1 variance, NRMSE = sqrt(mean((p - y)^2) /
(mean(y^2) + 1e-7)). A field's score is the mean over samples and time steps; The Well's tables report the
one-step test VRMSE, and the rollout VRMSE averaged over the predicted steps 6:12 and 13:30.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.distributed.collectives import all_reduce_sum

EPS = 1e-7
WINDOWS = {"vrmse_6_12": (6, 12), "vrmse_13_30": (13, 30)}
"""Rollout windows of The Well's tables: predicted steps [start, stop), reported when the rollout reaches stop."""


def vrmse_nrmse(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t, *space, c) -> VRMSE and NRMSE per (b, t, c), in float64."""
    pred, target = pred.double(), target.double()
    space = tuple(range(2, pred.dim() - 1))
    mse = (pred - target).square().mean(space)
    variance = target.std(space).square()  # the n-1 variance, as The Well's VRMSE
    return (mse / (variance + EPS)).sqrt(), (mse / (target.square().mean(space) + EPS)).sqrt()


@dataclass
class WellSums:
    """One rank's sums: per channel, VRMSE and NRMSE summed over (sample, step); per step, VRMSE summed over
    samples and averaged over channels; the samples seen."""

    vrmse: torch.Tensor
    nrmse: torch.Tensor
    by_step: torch.Tensor
    samples: float = 0.0

    @classmethod
    def zeros(cls, steps: int, channels: int) -> WellSums:
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
        return cls(z(channels), z(channels), z(steps))

    def add(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        v, n = vrmse_nrmse(pred, target)
        self.vrmse += v.sum((0, 1)).cpu()
        self.nrmse += n.sum((0, 1)).cpu()
        self.by_step += v.mean(2).sum(0).cpu()
        self.samples += len(pred)

    def all_reduce(self) -> WellSums:
        parts = [self.vrmse, self.nrmse, self.by_step, torch.tensor([self.samples], dtype=torch.float64)]
        flat = all_reduce_sum(torch.cat(parts))
        c, t = len(self.vrmse), len(self.by_step)
        return WellSums(flat[:c], flat[c : 2 * c], flat[2 * c : 2 * c + t], float(flat[-1]))

    def scores(self, names: list[str]) -> dict:
        """Per field (channel name) and as their mean: VRMSE and NRMSE; the rollout windows that fit; per step."""
        if not self.samples:
            return {}
        terms = self.samples * len(self.by_step)
        vrmse, nrmse = (self.vrmse / terms).tolist(), (self.nrmse / terms).tolist()
        by_step = (self.by_step / self.samples).tolist()
        out = {
            "vrmse": sum(vrmse) / len(vrmse),
            "nrmse": sum(nrmse) / len(nrmse),
            "vrmse_by_field": dict(zip(names, vrmse, strict=True)),
            "nrmse_by_field": dict(zip(names, nrmse, strict=True)),
        }
        for key, (start, stop) in WINDOWS.items():
            if len(by_step) >= stop:
                out[key] = sum(by_step[start:stop]) / (stop - start)
        if len(by_step) > 1:
            out["vrmse_by_step"] = by_step
        return out
