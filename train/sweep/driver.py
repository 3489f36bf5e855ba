"""``python -m train sweep``: check the base config and the search space, open (or continue) the study in
``runs/<sweep>/``, then run trials on this machine, or render the SLURM job array whose tasks run them."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from pathlib import Path

from optuna.trial import TrialState

from train.atomic import write_json_atomic, write_text_atomic
from train.config import Config, load_config, training_differences, validate
from train.errors import ConfigError
from train.launch.targets import target_named
from train.launch.targets.sbatch import ArrayJob
from train.pipeline import run_stages
from train.sweep.results import SUMMARY, write_results
from train.sweep.runner import Worker, check_outcome
from train.sweep.space import SweepSpec, check_spec, read_spec
from train.sweep.study import SweepStudy
from train.sweep.trials import Slot, divide_machine

log = logging.getLogger(__name__)

RECORD = "sweep.json"
SBATCH = "sweep.sbatch"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAY_CHANGE = ("trials", "parallel")
"""Spec fields a later sweep command may change: more trials continue the study, parallel is how they run."""


def open_sweep(config: str, overrides: list[str], space: str, name: str | None) -> tuple[SweepStudy, Config]:
    """The checked base config and the study of the sweep, created or (same space, same base) continued."""
    base = load_config(config, overrides)
    spec = read_spec(Path(space))
    check_spec(spec, base, space)
    name = name or Path(space).stem
    if not _NAME.fullmatch(name):
        raise ConfigError(f"sweep name {name!r}: use letters, digits, '.', '_' and '-' (--name, NAME=)")
    root = Path(base.run.runs_dir) / name
    _check_record(root, spec, base)
    study = SweepStudy(root, name, spec)
    write_json_atomic(root / RECORD, {"space": spec.model_dump(mode="json"), "base": base.model_dump(mode="json")})
    return study, base


def _check_record(root: Path, spec: SweepSpec, base: Config) -> None:
    """A sweep folder holds one search: refuse to continue it with another space or another base config."""
    try:
        record = json.loads((root / RECORD).read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise ConfigError(f"{root / RECORD} is unreadable ({e}): remove {root} to start the sweep over") from None
    before = {k: v for k, v in record["space"].items() if k not in _MAY_CHANGE}
    now = {k: v for k, v in spec.model_dump(mode="json").items() if k not in _MAY_CHANGE}
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if changed:
        raise ConfigError(
            f"{root} holds a sweep whose search space differs in {', '.join(changed)} (only trials and parallel may "
            "change): give this sweep another name (--name, NAME=), or remove that folder to start over"
        )
    differences = training_differences(validate(record["base"], str(root / RECORD)), base)
    if differences:
        raise ConfigError(
            f"{root} holds a sweep of another base config (it differs in {', '.join(differences[:6])}): give this "
            "sweep another name (--name, NAME=), or remove that folder to start over"
        )


def run_sweep(study: SweepStudy, base: Config, *, array_task: bool = False) -> Path:
    """Run trials from the study until none is left to take; returns the summary's path."""
    spec = study.spec
    slots = [Slot()] if array_task else divide_machine(spec.parallel, base)
    done = sum(t.state.is_finished() for t in study.trials())
    log.info(
        "sweep %s: %d trials (%d finished before), %s sampler, %d at once, metric %s, pruner %s -> %s",
        study.name,
        study.budget,
        done,
        spec.sampler,
        len(slots),
        spec.metric,
        spec.pruner,
        study.root,
    )
    if not study.is_done():
        run_stages(base, "cache")  # once, before the trials: they find their data and caches ready
    worker = Worker(study, base.model_dump(mode="json"), slots)
    try:
        worker.run(on_trial_end=lambda: write_results(study, base.run.runs_dir, plots=False))
    finally:
        summary = write_results(study, base.run.runs_dir)
    check_outcome(study)
    trials = study.trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = min(complete, key=lambda t: t.value)
        log.info(
            "sweep %s: best %s=%.4g (trial %d); leaderboard %s, config %s",
            study.name,
            spec.metric,
            best.value,
            best.number,
            summary,
            study.root / "best.yaml",
        )
    if not study.is_done():
        log.info("sweep %s: trials still run elsewhere or were stopped; re-run the command to continue", study.name)
    return summary


def write_array(
    study: SweepStudy, base: Config, config: str, overrides: list[str], space: str, output: str | None
) -> Path:
    """Render the SLURM job array of the sweep: ``trials`` tasks, ``parallel`` at once, each running trials from
    the study until none is left (``python -m train sweep --array-task``), requeued on preemption."""
    words = ["sweep", "--config", config, "--space", space, "--name", study.name]
    for override in overrides:
        words += ["--set", override]
    path = Path(output) if output else study.root / SBATCH
    rendered_by = "python -m train " + " ".join(shlex.quote(w) for w in [*words, "--slurm", "--output", str(path)])
    array = ArrayJob(study.name, study.budget, study.spec.parallel, [*words, "--array-task"], rendered_by)
    text = target_named("slurm").render_array(base, config, overrides, str(path), array).text
    write_text_atomic(path, text)
    os.chmod(path, 0o755)
    log.info(
        "wrote %s: %d array tasks, %d at once; submit it from the project directory with: sbatch %s; the "
        "leaderboard will be %s",
        path,
        study.budget,
        study.spec.parallel,
        shlex.quote(str(path)),
        study.root / SUMMARY,
    )
    return path
