"""The field vocabulary: the physical name of every channel a task's model reads.

The multi-physics model keeps one row of weights per field name (its embedding of the field's values, its
decoder), shared by every task that names the field: a new dataset whose fields the model already knows starts
from what the other datasets taught it. Each task gives its names in ``tasks.<name>.fields``; without them they
come from the format: physical names where a format's key says what the field is (PDEBench's ``density``,
``Vx``; The Well's ``velocity_x``), else the family's own ``<pde>/<key>`` (PDEBench's generic ``tensor``), which
no other family shares unless a config says so. docs/models.md ('Field vocabulary') lists the rules.
"""

from __future__ import annotations

from train.config import TaskConfig
from train.data.cache.info import CacheInfo
from train.errors import ConfigError
from train.pdes import LAYOUTS

ALIASES = {"Vx": "velocity_x", "Vy": "velocity_y", "Vz": "velocity_z", "vx": "velocity_x", "vy": "velocity_y"}
"""Format keys that name a physical field under another spelling."""
PHYSICAL = frozenset(
    {"density", "pressure", "energy", "temperature", "buoyancy", "vorticity"}
    | {f"{kind}_{axis}" for kind in ("velocity", "momentum", "magnetic_field") for axis in "xyz"}
)
"""Names that mean one quantity in every dataset: shared by default."""


def expected_count(info: CacheInfo) -> int:
    """Names a task gives: one per input channel, and for a steady task one more per output channel."""
    return info.in_channels + (0 if info.autoregressive else info.out_channels)


def _physical_or_own(key: str, family: str) -> str:
    name = ALIASES.get(key, key)
    return name if name in PHYSICAL else f"{family}/{key}"


def _expand(keys: tuple[str, ...], channels: int) -> list[str]:
    """One name per channel: a key holding several channels (PDEBench's grouped ``data``) as key_0, key_1 ..."""
    if len(keys) == channels:
        return list(keys)
    if len(keys) == 1:
        return [f"{keys[0]}_{i}" for i in range(channels)]
    return [f"channel_{i}" for i in range(channels)]


def default_fields(task: TaskConfig, info: CacheInfo) -> tuple[str, ...]:
    """The names of the task's channels from its format: The Well's own channel names, else its layout's keys."""
    family = task.well.dataset if task.well is not None and task.well.dataset else task.pde
    layout = LAYOUTS[task.pde]
    if info.channels and len(info.channels) == expected_count(info):
        keys = list(info.channels)
    elif info.autoregressive:
        keys = _expand(layout.targets, info.out_channels) + _expand(("constant",), info.const_channels)
    else:
        outputs = _expand(layout.targets, info.out_channels)
        keys = _expand(layout.inputs, info.in_channels) + [f"out_{k}" if k in layout.inputs else k for k in outputs]
    return tuple(_physical_or_own(key, family) for key in keys[: expected_count(info)])


def task_fields(name: str, task: TaskConfig, info: CacheInfo) -> tuple[str, ...]:
    """The task's field names: ``tasks.<name>.fields`` checked against its channels, or the format's."""
    if task.fields is None:
        return default_fields(task, info)
    want = expected_count(info)
    if len(task.fields) != want:
        detail = (
            "its channels, then constant fields"
            if info.autoregressive
            else (f"{info.in_channels} input(s), then {info.out_channels} output(s)")
        )
        raise ConfigError(
            f"tasks.{name}.fields names {len(task.fields)} field(s); the data has {want} channel(s) ({detail}; the "
            f"format's names: {', '.join(default_fields(task, info))}): give one name per channel, in order"
        )
    groups = (
        [task.fields] if info.autoregressive else [task.fields[: info.in_channels], task.fields[info.in_channels :]]
    )
    repeated = sorted({f for group in groups for f in group if group.count(f) > 1})
    if repeated:
        where = "" if info.autoregressive else " among its inputs or among its outputs"
        raise ConfigError(
            f"tasks.{name}.fields names {', '.join(repeated)} more than once{where}: each channel is a field of its "
            "own; give each its own name (velocity_x, velocity_y)"
        )
    return tuple(task.fields)
