"""The search space file of a sweep: what is searched, how, and by which validation metric; checked against the
base config before any trial starts, so that a bad key, range or metric is exit 2 and not a failed trial later.

    sampler: grid          # grid | random | tpe
    trials: 8              # grid: at most the grid's size (its size by default)
    parallel: 2            # trials at once: on this machine, or SLURM array tasks at once
    metric: val_nrmse      # any validation value the runs report (metrics.jsonl), lower is better
    space:
      train.lr: {low: 1.0e-4, high: 1.0e-2, log: true}
      model.fno.width: [16, 20, 32]
"""

from __future__ import annotations

import copy
import difflib
import math
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from train.config import Config, flatten, parse_yaml, validate
from train.errors import ConfigError

Choice = bool | int | float | str | None
SWEPT_BY_THE_SWEEP = ("run.name", "run.runs_dir")


class Range(BaseModel):
    """A numeric interval: the samplers draw from it; a grid takes every ``step`` from low to high."""

    model_config = ConfigDict(extra="forbid", strict=True)
    low: int | float
    """Smallest value."""
    high: int | float
    """Largest value (included)."""
    log: bool = False
    """Draw uniformly in log space (learning rates, weight decays); needs low > 0."""
    step: int | float | None = None
    """Only values low + k * step; required under the grid sampler, which needs a finite list."""

    @pydantic.field_validator("low", "high", "step")
    @classmethod
    def _finite(cls, value: int | float | None) -> int | float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
        return value


class SweepSpec(BaseModel):
    """A sweep's search space file."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    space: dict[str, list[Choice] | Range] = Field(min_length=1)
    """Config keys (as in --set, e.g. model.fno.width) to a list of choices or a range {low, high, log, step}."""
    sampler: Literal["grid", "random", "tpe"] = "tpe"
    """grid: every combination of the choices; random: independent draws; tpe: Optuna's tree-structured Parzen
    estimator, which draws near the best trials so far once it has seen some."""
    trials: int | None = Field(None, ge=1)
    """Trials in all, counting finished, pruned and failed ones; default (grid only): the grid's size."""
    parallel: int = Field(1, ge=1)
    """Trials at once: on this machine the cores (and GPUs) are divided between them; on SLURM, the array tasks
    that run at once (--array=...%parallel)."""
    metric: str = "val_nrmse"
    """The validation value a trial is scored by (its best over the run; lower is better): val_nrmse (the
    validation rollout nRMSE, the default), val_nrmse/<task>, val/loss or val/<task> (one-step losses)."""
    pruner: Literal["median", "halving", "none"] = "median"
    """Stop a trial early when its validation is worse than the others at the same step: median (worse than
    the median of the earlier trials), halving (successive halving), or none."""
    prune_after_trials: int = Field(2, ge=0)
    """The median pruner prunes nothing until this many trials have finished."""
    prune_warmup_steps: int = Field(0, ge=0)
    """No trial is pruned before this training step (the halving pruner's minimum resource, when set)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of the sampler (0 to 2^31 - 1): the same seed and results give the same trials."""

    def grid(self) -> dict[str, list[Choice]]:
        """Each key's grid values (the grid sampler): choices as listed, a range every ``step``."""
        out = {}
        for key, dim in self.space.items():
            if isinstance(dim, list):
                out[key] = dim
            else:
                n = math.floor((dim.high - dim.low) / dim.step + 1e-9)
                values = [dim.low + i * dim.step for i in range(n + 1)]
                out[key] = [round(v, 12) if isinstance(v, float) else v for v in values]
        return out

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.grid().values())


def read_spec(path: Path) -> SweepSpec:
    if not path.is_file():
        raise ConfigError(f"search space file '{path}' not found; pass an existing YAML file (--space, SWEEP=)")
    tree = parse_yaml(path.read_text(), str(path))
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping with a 'space' section (see docs/sweeps.md)")
    try:
        return SweepSpec.model_validate(tree)
    except pydantic.ValidationError as e:
        problems = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("list[", "Range", "function")))
            problems.append(f"{loc}: {err['msg']}")
        raise ConfigError(f"{path}: invalid search space:\n  - " + "\n  - ".join(dict.fromkeys(problems))) from None


def with_params(tree: dict, params: dict[str, Any]) -> dict:
    """A copy of the config tree with each ``a.b.c`` key set to its value."""
    tree = copy.deepcopy(tree)
    for key, value in params.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def reported_metrics(cfg: Config) -> list[str]:
    """The validation values a run of ``cfg`` writes to metrics.jsonl."""
    names = ["val/loss", *(f"val/{task}" for task in cfg.tasks)]
    if cfg.train.val_metric == "rollout_nrmse":
        names += ["val_nrmse", *(f"val_nrmse/{task}" for task in cfg.tasks)]
    return names


def check_spec(spec: SweepSpec, base: Config, origin: str) -> None:
    """Every key a config key that takes every value, every range numeric, the grid finite, the metric reported:
    otherwise a ConfigError (exit 2) naming the key."""
    tree = base.model_dump(mode="json")
    keys = flatten(tree)
    problems = []
    for key, dim in spec.space.items():
        where = f"{origin}: space.{key}"
        if key in SWEPT_BY_THE_SWEEP:
            problems.append(f"{where}: the sweep names each trial's folder itself; leave {key} out")
            continue
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else " (the keys are those of --set)"
            problems.append(f"{where} is not a key of the config{hint}")
            continue
        if isinstance(dim, list):
            problems += _check_choices(where, key, dim, tree)
        else:
            problems += _check_range(where, key, dim, tree, spec.sampler, keys[key])
    if problems:
        raise ConfigError("the search space cannot be searched:\n  - " + "\n  - ".join(problems))
    if spec.sampler == "grid":
        size = spec.grid_size()
        if spec.trials is not None and spec.trials > size:
            raise ConfigError(f"{origin}: trials={spec.trials} is more than the grid's {size} points: lower it")
    elif spec.trials is None:
        raise ConfigError(f"{origin}: trials is required with sampler={spec.sampler} (how many trials to run)")
    if spec.metric not in reported_metrics(base):
        raise ConfigError(
            f"{origin}: metric={spec.metric!r} is not reported by these runs; they report "
            f"{', '.join(reported_metrics(base))}"
            + (" (val_nrmse needs train.val_metric=rollout_nrmse)" if spec.metric.startswith("val_nrmse") else "")
        )


def _value_at(key: str, value: Any, tree: dict) -> Any:
    """The value the config holds for ``key`` once set to ``value`` (ConfigError if it is refused)."""
    cfg = validate(with_params(tree, {key: value}), f"{key}={value!r}")
    return flatten(cfg.model_dump(mode="json"))[key]


def _check_choices(where: str, key: str, choices: list, tree: dict) -> list[str]:
    if not choices:
        return [f"{where}: the list of choices is empty; give at least one value"]
    if len({repr(c) for c in choices}) < len(choices):
        return [f"{where}: {choices} lists a value twice"]
    problems = []
    for choice in choices:
        try:
            _value_at(key, choice, tree)
        except ConfigError as e:
            problems.append(f"{where}: the choice {choice!r} is refused by the config: {_last_line(e)}")
    return problems


def _check_range(where: str, key: str, dim: Range, tree: dict, sampler: str, now: Any) -> list[str]:
    """``now``: the key's value in the base config (None for an optional setting that is not set)."""
    if now is not None and (isinstance(now, bool) or not isinstance(now, int | float)):
        kind = "text" if isinstance(now, str) else type(now).__name__
        return [f"{where}: a range needs a numeric key, and this one holds {kind}; give a list of choices instead"]
    try:
        held = _value_at(key, dim.low, tree)
    except ConfigError as e:
        return [f"{where}: low={dim.low!r} is refused by the config: {_last_line(e)}"]
    if isinstance(held, bool) or not isinstance(held, int | float):
        return [f"{where}: a range needs a numeric key; give a list of choices instead"]
    held = held if now is None else now
    problems = []
    if dim.low >= dim.high:
        problems.append(f"{where}: low={dim.low} must be below high={dim.high}")
    if dim.log and dim.low <= 0:
        problems.append(f"{where}: a log range needs low > 0 (got {dim.low})")
    if isinstance(held, int) and not (isinstance(dim.low, int) and isinstance(dim.high, int)):
        problems.append(f"{where}: the key holds whole numbers; give low and high as integers")
    if dim.step is not None and dim.step <= 0:
        problems.append(f"{where}: step={dim.step} must be positive")
    if dim.log and dim.step is not None and sampler != "grid":
        problems.append(f"{where}: a log range takes no step (drop step, or log)")
    if sampler == "grid" and dim.step is None:
        problems.append(f"{where}: the grid sampler needs a finite list: give a step, or a list of choices")
    if sampler == "grid" and dim.log:
        problems.append(f"{where}: a grid cannot step in log space: list the values instead")
    try:
        _value_at(key, dim.high, tree)
    except ConfigError as e:
        problems.append(f"{where}: high={dim.high!r} is refused by the config: {_last_line(e)}")
    return problems


def _last_line(error: Exception) -> str:
    return str(error).strip().splitlines()[-1].strip(" -")


def is_int_range(dim: Range) -> bool:
    return isinstance(dim.low, int) and isinstance(dim.high, int) and not isinstance(dim.step, float)
