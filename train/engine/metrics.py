"""PDEBench error metrics (PDEBENCH.md section 4) as sums and counts, so ranks can reduce them exactly.

Fields are channels-last with time before space: (batch, time, *space, channel). Averaging per-sample
values as (sum over ranks) / (count over ranks) is the exact weighted mean PDEBench intends; its own
aggregation divides by (batches - 1).
"""

from __future__ import annotations

import torch

# Order of the entries in the vector error_sums returns.
SUMS = ("nrmse", "rmse", "count")


def error_sums(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sums over (sample, time, channel) of RMSE and nRMSE, plus how many terms were summed.

    Per (sample, time, channel): RMSE = sqrt(mean_x (p - y)^2), nRMSE = RMSE / sqrt(mean_x y^2).
    """
    assert pred.shape == target.shape and pred.dim() >= 4, (pred.shape, target.shape)
    space = tuple(range(2, pred.dim() - 1))
    pred, target = pred.double(), target.double()
    rmse = (pred - target).square().mean(space).sqrt()
    scale = target.square().mean(space).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    nrmse = rmse / scale
    return torch.stack([nrmse.sum(), rmse.sum(), torch.tensor(float(rmse.numel()), dtype=torch.float64)]).cpu()


def finish(sums: torch.Tensor) -> dict[str, float]:
    """Turn reduced sums into means."""
    count = float(sums[SUMS.index("count")])
    if count == 0:
        return {"nrmse": float("nan"), "rmse": float("nan")}
    return {name: float(sums[i]) / count for i, name in enumerate(SUMS[:-1])}
