"""A Well dataset's own ``stats.yaml``: used to normalise when it agrees with the train split's statistics.

The file holds, per field name, ``mean`` and ``std`` (a number for a scalar field, a list for a vector, a nested
list for a rank-2 tensor; also ``rms`` and the ``*_delta`` forms, unused here), computed by The Well over its
train split and written with five significant digits. Normalising with those values makes every sample equal
to what The Well's own reader returns; but a stats file that belongs to another version of the data, or is not
a stats file at all (a server's error page saved under its name), must not normalise anything. So it is used
only when every channel's mean and std agree with what the cache stage just computed from the train split.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import yaml

from train.data.formats.well import STD_FLOOR

log = logging.getLogger(__name__)

RELATIVE = 1e-3
"""Agreement wanted: within 0.1% of the channel's std (plus the file's rounding of the mean)."""


def _load(path: Path) -> dict | None:
    try:
        stats = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        log.warning(
            "data: %s is not a readable stats file (%s); normalising with the train split's statistics", path, e
        )
        return None
    if not isinstance(stats, dict) or not all(isinstance(stats.get(k), dict) for k in ("mean", "std")):
        log.warning("data: %s holds no 'mean' and 'std' per field; normalising with the train split's statistics", path)
        return None
    return stats


def _channels(reader, stats: dict, time_varying: bool) -> tuple[np.ndarray, np.ndarray] | None:
    means, stds = [], []
    for field in reader.fields:
        if field.time_varying != time_varying:
            continue
        if field.name not in stats["mean"] or field.name not in stats["std"]:
            return None
        try:
            means += np.asarray(stats["mean"][field.name], dtype=np.float64).reshape(-1).tolist()
            stds += np.asarray(stats["std"][field.name], dtype=np.float64).reshape(-1).tolist()
        except (TypeError, ValueError):
            return None
    return np.asarray(means), np.asarray(stds)


def published_moments(
    path: Path,
    reader,
    computed: dict[str, tuple[np.ndarray, np.ndarray]],
    described: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict | None:
    """The moments to normalise with from ``path`` (per cache part, as ``computed``), or None to keep ``computed``.
    ``described``: the statistics the file must agree with, when not the train split's (the train files whole,
    when a split was carved from them).

    Constant scalars are not in the file (The Well leaves them raw); they keep the computed statistics."""
    if not Path(path).is_file():
        return None
    stats = _load(Path(path))
    if stats is None:
        return None
    out = {}
    for part, time_varying in (("", True), ("const", False)):
        if part not in computed:
            continue
        mean, std = computed[part]
        want_mean, want_std = (described or computed)[part]
        found = _channels(reader, stats, time_varying)
        n = len(found[0]) if found is not None else -1
        n_fields = (
            len(reader.channels) if time_varying else len(reader.constant_channels) - len(reader.constant_scalars)
        )
        if found is None or n != n_fields:
            log.warning(
                "data: %s does not cover the dataset's fields; normalising with the train split's statistics", path
            )
            return None
        tol = RELATIVE * want_std + 1e-4 * np.abs(want_mean) + 1e-7
        close = np.abs(found[0] - want_mean[:n]) <= tol[:n], np.abs(found[1] - want_std[:n]) <= tol[:n]
        if not (np.all(close[0]) and np.all(close[1])):
            worst = int(np.argmax(np.abs(found[1] - want_std[:n]) + np.abs(found[0] - want_mean[:n])))
            log.warning(
                "data: %s disagrees with the train split (channel %d: mean %.6g std %.6g in the file, %.6g and %.6g "
                "computed); normalising with the train split's statistics",
                path,
                worst,
                found[0][worst],
                found[1][worst],
                want_mean[worst],
                want_std[worst],
            )
            return None
        out[part] = (np.concatenate([found[0], mean[n:]]), np.concatenate([np.maximum(found[1], STD_FLOOR), std[n:]]))
    log.info("data: normalising with %s (it agrees with the train split's statistics)", path)
    return out
