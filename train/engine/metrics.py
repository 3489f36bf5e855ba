"""PDEBench's error metrics as sums, counts and maxima, so ranks can reduce them exactly (the definitions, and
where they differ from PDEBench's own code: docs/data-formats.md, 'Metrics').

Fields are channels-last with time before space: (batch, time, *space, channel). Every metric follows PDEBench's
definition: a value per (time, channel), then the plain mean over time and channels. Where PDEBench takes a mean
over samples it is the exact mean over all samples of all ranks here. PDEBench's ``metrics`` instead averages
per-batch results over the number of batches (and its per-time-step curve sums batches 2.. but divides by all of
them), which weighs a short last batch like a full one and, for cRMSE, fRMSE and the max error, averages
per-batch roots and maxima instead of taking them over the whole split.

The max error is PDEBench's too: per (time, channel) the largest |p - y| over samples and space, then
averaged over time and channels (not the single worst point). Differences from PDEBench on purpose: the
first ``initial_step`` frames (copied from the data, error zero) are left out instead of averaged in, and
the domain-length factor of fRMSE (``Lx * Ly``) is 1, the default of ``metric_func``: our caches do not
record the domain size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from train.distributed.collectives import all_reduce_max, all_reduce_sum

KEYS = ("rmse", "nrmse", "crmse", "brmse", "max_error", "frmse_low", "frmse_mid", "frmse_high", "rel_l2")
# fRMSE bands over the wavenumber bins (PDEBench's iLow=4, iHigh=12).
BANDS = {"frmse_low": (0, 4), "frmse_mid": (4, 12), "frmse_high": (12, None)}
# Order of ErrorSums.scalars: sums over (sample, time, channel) terms, the number of terms, of samples.
SCALARS = ("rmse", "nrmse", "brmse", "rel_l2", "terms", "samples")
# Order of ErrorSums.by_field's columns.
FIELD_SUMS = ("rmse", "nrmse", "terms", "nrmse_changing", "terms_changing")
CONSTANT_TOLERANCE = 1e-6
"""A (sample, channel) whose true field over the predicted frames varies by no more than this share of its
largest magnitude is constant: a condition of the trajectory (a uniform flow's velocity), not its dynamics."""


@dataclass(frozen=True)
class ErrorSums:
    """One rank's partial results (float64, CPU); ``+`` merges two, ``all_reduce`` merges all ranks'."""

    scalars: torch.Tensor
    """(len(SCALARS),): sums of per-term RMSE, nRMSE, bRMSE; of per-sample relative L2; the number of terms; the
    number of samples."""
    conservation: torch.Tensor
    """(time, channel): sum over samples of (mean_x (p - y))^2, cRMSE's square before the root."""
    spectrum: torch.Tensor
    """(time, channel, bins): sum over samples of the binned |FFT(p - y)|^2 / N^2, fRMSE before the root."""
    max_abs: torch.Tensor
    """(time, channel): max over samples and space of |p - y|."""
    nrmse_by_time: torch.Tensor
    """(time,): sum over samples and channels of the per-term nRMSE, the error's growth over a rollout."""
    by_field: torch.Tensor
    """(channel, 5): per channel, the sums over its terms of RMSE and of nRMSE, their count, and the sum of nRMSE and
    the count over the terms of the (sample, channel) pairs whose true field changes over the predicted frames."""

    @classmethod
    def zeros(cls, time: int, space: tuple[int, ...], channels: int) -> ErrorSums:
        """Nothing scored yet; a rank whose shard is empty still takes part in the reductions with these."""
        z = functools.partial(torch.zeros, dtype=torch.float64)
        return cls(
            z(len(SCALARS)),
            z(time, channels),
            z(time, channels, spectrum_bins(space)),
            z(time, channels),
            z(time),
            z(channels, len(FIELD_SUMS)),
        )

    def __add__(self, other: ErrorSums) -> ErrorSums:
        return ErrorSums(
            self.scalars + other.scalars,
            self.conservation + other.conservation,
            self.spectrum + other.spectrum,
            torch.maximum(self.max_abs, other.max_abs),
            self.nrmse_by_time + other.nrmse_by_time,
            self.by_field + other.by_field,
        )

    def all_reduce(self) -> ErrorSums:
        """Sums summed and maxima maximised over ranks (one collective each); identical on every rank."""
        parts = (self.scalars, self.conservation, self.spectrum, self.nrmse_by_time, self.by_field)
        flat = all_reduce_sum(torch.cat([p.flatten() for p in parts]))
        sizes = [p.numel() for p in parts]
        scalars, conservation, spectrum, by_time, by_field = (
            f.view(p.shape) for f, p in zip(flat.split(sizes), parts, strict=True)
        )
        return ErrorSums(scalars, conservation, spectrum, all_reduce_max(self.max_abs), by_time, by_field)


def spectrum_bins(space: tuple[int, ...]) -> int:
    """Wavenumber bins of fRMSE: every rfft mode 0..n/2 in 1D, radii below min(n)/2 in 2D and 3D (PDEBench)."""
    return space[0] // 2 + 1 if len(space) == 1 else min(n // 2 for n in space)


@functools.lru_cache(maxsize=16)
def _radial_bins(space: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices into the orthant 0 <= k_d < n_d/2 of the modes kept, and their bins floor(|k|).

    PDEBench loops over this orthant only and drops radii past the last bin. That leaves out the modes
    with mixed signs (k_x > 0 > k_y), which are no conjugates of kept ones, so an error varying along
    x - y is not seen in 2D; we keep its selection anyway so that our numbers compare with its tables.
    """
    grid = np.meshgrid(*[np.arange(n // 2) for n in space], indexing="ij")
    radius = np.floor(np.sqrt(sum(k.astype(np.float64) ** 2 for k in grid))).astype(np.int64).ravel()
    keep = np.flatnonzero(radius < spectrum_bins(space))
    return keep, radius[keep]


def _spectrum(err: torch.Tensor) -> torch.Tensor:
    """(batch, time, *space, channel) errors -> (time, channel, bins) sums over samples of binned power."""
    space = tuple(err.shape[2:-1])
    dims = tuple(range(2, err.dim() - 1))
    # norm="forward" divides by N: PDEBench's sqrt(mean_b |F|^2) / N is then sqrt(mean_b |F_forward|^2).
    if len(space) == 1:
        power = torch.fft.rfft(err, dim=2, norm="forward").abs().square().sum(0)  # (time, bins, channel)
        return power.transpose(1, 2).contiguous()
    coeffs = torch.fft.fftn(err, dim=dims, norm="forward")
    coeffs = coeffs[(slice(None), slice(None), *[slice(0, n // 2) for n in space])]
    power = coeffs.abs().square().sum(0)  # (time, *orthant, channel)
    power = power.movedim(-1, 1).flatten(2)  # (time, channel, orthant modes)
    keep, bins = (torch.from_numpy(a).to(err.device) for a in _radial_bins(space))
    out = torch.zeros(*power.shape[:2], spectrum_bins(space), dtype=power.dtype, device=err.device)
    return out.index_add_(2, bins, power.index_select(2, keep))


def _boundary_square_mean(err: torch.Tensor) -> torch.Tensor:
    """Mean of err^2 over the two faces of every spatial axis, per (sample, time, channel).

    As PDEBench: two end points in 1D, the four edges in 2D (2 nx + 2 ny points, corners counted on both
    edges they lie on), the six faces in 3D.
    """
    space = tuple(range(2, err.dim() - 1))
    points = math.prod(err.shape[d] for d in space)
    total, count = 0, 0
    for d in space:
        for index in (0, err.shape[d] - 1):
            total = total + err.narrow(d, index, 1).square().sum(space)
            count += points // err.shape[d]
    return total / count


def error_sums(pred: torch.Tensor, target: torch.Tensor) -> ErrorSums:
    """This batch's contribution to every metric, in float64 on the CPU.

    Per (sample, time, channel): RMSE = sqrt(mean_x e^2), nRMSE = RMSE / sqrt(mean_x y^2), bRMSE = RMSE on
    the boundary faces; per (time, channel) over samples: the conservation error mean_x e (cRMSE), the
    binned Fourier power of e (fRMSE) and max |e| (max error); e = p - y. Per sample: the relative L2 error
    ||e||_2 / ||y||_2 over the whole predicted field, every step and channel (the neural-operator literature's
    metric: neuraloperator's LpLoss with p=2, the FNO paper's tables).
    """
    assert pred.shape == target.shape and pred.dim() >= 4, (pred.shape, target.shape)
    if not len(pred):  # no FFT of an empty batch (MKL rejects it)
        return ErrorSums.zeros(pred.shape[1], tuple(pred.shape[2:-1]), pred.shape[-1])
    space = tuple(range(2, pred.dim() - 1))
    pred, target = pred.double(), target.double()
    err = pred - target
    rmse = err.square().mean(space).sqrt()
    scale = target.square().mean(space).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    nrmse = rmse / scale  # (sample, time, channel)
    brmse = _boundary_square_mean(err).sqrt()
    tiny = torch.finfo(torch.float64).tiny
    rel_l2 = err.flatten(1).norm(dim=1) / target.flatten(1).norm(dim=1).clamp_min(tiny)
    scalars = torch.stack(
        [
            rmse.sum(),
            nrmse.sum(),
            brmse.sum(),
            rel_l2.sum(),
            torch.tensor(float(rmse.numel()), dtype=torch.float64, device=err.device),
            torch.tensor(float(len(err)), dtype=torch.float64, device=err.device),
        ]
    )
    conservation = err.mean(space).square().sum(0)
    max_abs = err.abs().amax((0, *space))
    by_time = nrmse.sum((0, 2))
    changing = changing_fields(target).to(nrmse.dtype)  # (sample, channel)
    frames = torch.full_like(changing, float(nrmse.shape[1]))
    columns = {
        "rmse": rmse.sum((0, 1)),
        "nrmse": nrmse.sum((0, 1)),
        "terms": frames.sum(0),
        "nrmse_changing": (nrmse * changing[:, None]).sum((0, 1)),
        "terms_changing": (frames * changing).sum(0),
    }
    by_field = torch.stack([columns[k] for k in FIELD_SUMS], dim=1)
    return ErrorSums(
        scalars.cpu(), conservation.cpu(), _spectrum(err).cpu(), max_abs.cpu(), by_time.cpu(), by_field.cpu()
    )


def changing_fields(target: torch.Tensor) -> torch.Tensor:
    """(sample, channel) bools: whether each sample's true field changes over the predicted frames (time axis 1)
    by more than CONSTANT_TOLERANCE of its magnitude. A single predicted frame (a steady task's solution, or one
    step) has nothing to compare with: every field counts."""
    space = tuple(range(2, target.dim() - 1))
    if target.shape[1] == 1:
        return torch.ones(target.shape[0], target.shape[-1], dtype=torch.bool, device=target.device)
    spread = (target - target[:, :1]).abs().amax((1, *space))
    size = target.abs().amax((1, *space))
    return spread > CONSTANT_TOLERANCE * size


def finish(sums: ErrorSums) -> dict[str, float]:
    """Reduced sums -> every metric (KEYS); NaN where nothing was scored, or for a band with no bins."""
    terms, samples = (float(sums.scalars[SCALARS.index(k)]) for k in ("terms", "samples"))
    if terms == 0 or samples == 0:
        return dict.fromkeys(KEYS, float("nan"))
    out = {k: float(sums.scalars[SCALARS.index(k)]) / terms for k in ("rmse", "nrmse", "brmse")}
    out["rel_l2"] = float(sums.scalars[SCALARS.index("rel_l2")]) / samples
    out["crmse"] = float((sums.conservation / samples).sqrt().mean())
    out["max_error"] = float(sums.max_abs.mean())
    per_bin = (sums.spectrum / samples).sqrt()  # (time, channel, bins)
    for key, (lo, hi) in BANDS.items():
        band = per_bin[..., lo:hi]
        out[key] = float(band.mean()) if band.shape[-1] else float("nan")
    return {k: out[k] for k in KEYS}


def field_scores(sums: ErrorSums, names: list[str]) -> dict:
    """Reduced sums -> the per-field figures and the headline over the fields that change.

    ``nrmse_dynamic``: the nRMSE over the terms of the (sample, channel) pairs whose true field changes over the
    predicted frames; a field constant over a trajectory (the uniform velocity of an advected flow) is a condition
    of it, which nRMSE would divide by its own (possibly tiny) size, and which would then dominate the mean.
    ``nrmse_by_field`` and ``rmse_by_field``: each channel's nRMSE and RMSE over all its terms; ``constant_fields``:
    the share of samples in which each channel is constant."""
    f = sums.by_field
    col = {k: f[:, i] for i, k in enumerate(FIELD_SUMS)}
    ratio = lambda a, b: float(a / b) if float(b) else float("nan")  # noqa: E731
    return {
        "nrmse_dynamic": ratio(col["nrmse_changing"].sum(), col["terms_changing"].sum()),
        "nrmse_by_field": {n: ratio(col["nrmse"][c], col["terms"][c]) for c, n in enumerate(names)},
        "rmse_by_field": {n: ratio(col["rmse"][c], col["terms"][c]) for c, n in enumerate(names)},
        "constant_fields": {
            n: ratio(col["terms"][c] - col["terms_changing"][c], col["terms"][c]) for c, n in enumerate(names)
        },
    }


HORIZONS = (1, 10, 50, 100, 200, 500)
"""Rollout steps at which summary.json reports the nRMSE (those a split's trajectories reach), beside its mean."""


def at_horizons(by_step: list[float]) -> dict[str, float]:
    """The nRMSE at each of HORIZONS a rollout reaches, and at its last step: {"1": ..., "10": ..., "last": ...}."""
    if len(by_step) < 2:  # a steady task or a one-step rollout: the mean says it all
        return {}
    return {**{str(h): by_step[h - 1] for h in HORIZONS if h <= len(by_step)}, "last": by_step[-1]}


def nrmse_by_step(sums: ErrorSums) -> list[float]:
    """Reduced sums -> nRMSE of each predicted step (averaged over samples and channels): how the error grows
    over a rollout. Its mean over the steps is the nRMSE."""
    samples = float(sums.scalars[SCALARS.index("samples")])
    if samples == 0:
        return [float("nan")] * len(sums.nrmse_by_time)
    return (sums.nrmse_by_time / (samples * sums.conservation.shape[1])).tolist()
