"""What a sweep leaves for its user, rewritten from the study after every trial: ``summary.md`` (the leaderboard),
``best.yaml`` (the best trial's config, ready for ``make train CONFIG=``) and plots of the metric against each
parameter and over the trials."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from optuna.trial import FrozenTrial, TrialState

from train.atomic import write_text_atomic
from train.config import parse_yaml, to_yaml, validate
from train.obs.plots import new_figure, save_png
from train.sweep.space import Range, SweepSpec
from train.sweep.study import SweepStudy, trial_name
from train.sweep.trials import CONFIGS

log = logging.getLogger(__name__)

SUMMARY = "summary.md"
BEST = "best.yaml"
PLOTS = "plots"
_ORDER = {TrialState.COMPLETE: 0, TrialState.PRUNED: 1, TrialState.RUNNING: 2, TrialState.FAIL: 3}


def _state(t: FrozenTrial, study: SweepStudy) -> str:
    if t.state == TrialState.PRUNED:
        return f"pruned at step {t.user_attrs.get('pruned_at_step', '?')}"
    if t.state == TrialState.FAIL:
        again = ", run again" if t.number in study.retried(study.trials()) else ""
        return f"failed (exit {t.user_attrs.get('exit_code', '?')}{again})"
    if t.state == TrialState.WAITING:
        return "queued to run again"
    if t.state == TrialState.RUNNING:
        if study.is_claimed(t.number):
            return "running"
        code = t.user_attrs.get("exit_code")
        why = f" after exit {code} (this machine's failure)" if code else ""
        return f"stopped{why} (resumes on the next sweep command)"
    return "finished"


def _score(t: FrozenTrial) -> float | None:
    if t.state == TrialState.COMPLETE:
        return t.value
    if t.state == TrialState.PRUNED:
        return t.user_attrs.get("pruned_score")
    return None


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def leaderboard(study: SweepStudy) -> list[dict]:
    """One row per trial, best first: finished by score, then pruned, running and failed ones."""
    rows = []
    for t in study.trials():
        score = _score(t)
        rows.append(
            {
                "trial": trial_name(t.number),
                "number": t.number,
                "params": dict(t.params),
                "metric": score,
                "steps": t.user_attrs.get("steps"),
                "state": _state(t, study),
                "seconds": t.user_attrs.get("seconds"),
                "error": t.user_attrs.get("error"),
                "order": (_ORDER.get(t.state, 4), score if score is not None and math.isfinite(score) else math.inf),
            }
        )
    return sorted(rows, key=lambda r: (r["order"], r["number"]))


def write_results(study: SweepStudy, base_runs_dir: str, plots: bool = True) -> Path:
    """Rewrite summary.md, best.yaml and (``plots``) the figures; returns the summary's path."""
    rows = leaderboard(study)
    spec = study.spec
    keys = list(spec.space)
    best = next((r for r in rows if r["order"][0] == 0), None)
    counts, trials = {}, study.trials()
    for t in trials:
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    retried = len(study.retried(trials))
    counts |= {"failed and run again": retried} if retried else {}
    lines = [
        f"# Sweep {study.name}",
        "",
        f"{spec.sampler} sampler, {len(study.counted(trials))} of {study.budget} trials "
        f"({', '.join(f'{n} {s}' for s, n in sorted(counts.items())) or 'none yet'}); metric: {spec.metric} "
        f"(lower is better, each trial's best validation); pruner: {spec.pruner}.",
        "",
    ]
    if best is not None:
        lines += [
            f"Best: {best['trial']}, {spec.metric} {_fmt(best['metric'])} with "
            + ", ".join(f"`{k}={_fmt(v)}`" for k, v in best["params"].items())
            + f". Its config: `{BEST}` (`make train CONFIG={study.root / BEST}`).",
            "",
        ]
    header = ["rank", "trial", *keys, spec.metric, "steps", "state", "time (s)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, r in enumerate(rows, 1):
        cells = [str(i), r["trial"], *(_fmt(r["params"].get(k, "")) for k in keys)]
        cells += [_fmt(r["metric"]) if r["metric"] is not None else "", _fmt(r["steps"] or ""), r["state"]]
        cells.append(f"{r['seconds']:.0f}" if r["seconds"] is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r["error"]]
    if failed:
        lines += ["", "Failures:", *(f"- {r['trial']}: {r['error']}" for r in failed)]
    if plots:
        lines += [
            "",
            f"![{spec.metric} by parameter]({PLOTS}/by_parameter.png)",
            f"![{spec.metric} over trials]({PLOTS}/over_trials.png)",
        ]
    summary = study.root / SUMMARY
    write_text_atomic(summary, "\n".join(lines) + "\n")
    if best is not None:
        _write_best(study, best, base_runs_dir)
    if plots and any(r["metric"] is not None for r in rows):
        _plot(study.root / PLOTS, rows, spec)
    return summary


def _write_best(study: SweepStudy, best: dict, base_runs_dir: str) -> None:
    """The best trial's config as a run of its own: named after the sweep, in the base config's runs folder."""
    source = study.root / CONFIGS / f"{best['trial']}.yaml"
    tree = parse_yaml(source.read_text(), str(source))
    run = tree["run"]
    run["runs_dir"], run["name"] = base_runs_dir, f"{study.name}-best"
    if run.get("remote"):
        run["remote"] = run["remote"].rstrip("/").rsplit("/", 1)[0]
    tree["obs"]["wandb"]["group"] = None
    params = ", ".join(f"{k}={_fmt(v)}" for k, v in best["params"].items())
    header = (
        f"# The best trial of sweep {study.name}: {best['trial']}, {study.spec.metric} {_fmt(best['metric'])}\n"
        f"# ({params}). Train it: make train CONFIG={study.root / BEST}\n"
    )
    write_text_atomic(study.root / BEST, header + to_yaml(validate(tree, str(source))))


def _plot(folder: Path, rows: list[dict], spec: SweepSpec) -> None:
    scored = [r for r in rows if r["metric"] is not None and math.isfinite(r["metric"])]
    keys = list(spec.space)
    fig = new_figure(3.2 * len(keys), 3.0)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=True):
        dim = spec.space[key]
        for pruned in (False, True):
            part = [r for r in scored if r["state"].startswith("pruned") == pruned]
            if not part:
                continue
            xs = [r["params"][key] for r in part]
            if isinstance(dim, list):  # choices: one column each, in the listed order
                xs = [dim.index(x) for x in xs]
            ax.scatter(
                xs,
                [r["metric"] for r in part],
                marker="x" if pruned else "o",
                label="pruned (score when pruned)" if pruned else "finished",
            )
        if isinstance(dim, list):
            ax.set_xticks(range(len(dim)), [_fmt(c) for c in dim])
        elif isinstance(dim, Range) and dim.log:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_yscale("log")
        ax.set_ylabel(spec.metric)
    if len(scored) > 1:
        axes[0].legend(fontsize=7)
    save_png(fig, folder / "by_parameter.png")

    fig = new_figure(5.0, 3.2)
    ax = fig.subplots()
    ordered = sorted(scored, key=lambda r: r["number"])
    ax.scatter([r["number"] for r in ordered], [r["metric"] for r in ordered], label="trial")
    best, running = [], math.inf
    for r in ordered:
        if not r["state"].startswith("pruned"):
            running = min(running, r["metric"])
        best.append(running)
    ax.step([r["number"] for r in ordered], best, where="post", color="C1", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(spec.metric)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    save_png(fig, folder / "over_trials.png")
