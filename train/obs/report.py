"""The run's report in run_dir/report: summary.json (per task metrics), summary.md (the same, for people)
and the PNG plots it embeds (loss curves, one field comparison per task)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from train.atomic import write_json_atomic, write_text_atomic
from train.obs import plots

log = logging.getLogger(__name__)

LOSS_PNG = "loss.png"
GROWTH_PNG = "error_growth.png"
# Every metric evaluation computes (train.engine.metrics.KEYS), as a column heading.
HEADINGS = {
    "nrmse": "nRMSE",
    "rmse": "RMSE",
    "crmse": "cRMSE",
    "brmse": "bRMSE",
    "max_error": "max error",
    "frmse_low": "fRMSE low",
    "frmse_mid": "fRMSE mid",
    "frmse_high": "fRMSE high",
}


def field_png(task: str) -> str:
    return f"field_{task}.png"


def write_report(
    run_dir: Path,
    results: dict[str, dict[str, float]],
    checkpoint: Path,
    data: dict[str, dict[str, dict]],
    examples: dict[str, dict[str, np.ndarray]],
    split: str = "test",
) -> None:
    """``results``: evaluate_split's; ``data``: per task, where each split came from (file, sample range,
    carved or not); ``examples``: per task, evaluate.example_prediction's fields (a task may be absent)."""
    report = run_dir / "report"
    loss = _plot(plots.loss_curves, run_dir / "metrics.jsonl", report / LOSS_PNG)
    growth = _plot(plots.error_growth, results, report / GROWTH_PNG)
    rollouts = plots.rollout_tasks(results) if growth else []
    task_plots = {}
    for name in results:
        made = name in examples and _plot(plots.field_comparison, examples[name], name, report / field_png(name))
        task_plots[name] = (
            ([LOSS_PNG] if loss else [])
            + ([GROWTH_PNG] if name in rollouts else [])
            + ([field_png(name)] if made else [])
        )
    markdown = _markdown(run_dir, results, checkpoint, data, split, loss, growth, task_plots)
    write_text_atomic(report / "summary.md", markdown)
    # summary.json last: report_is_current takes its time as the report's.
    summary = {name: {**_strict(r), "data": data[name], "plots": task_plots[name]} for name, r in results.items()}
    write_json_atomic(report / "summary.json", summary)


def _plot(function, *args) -> bool:
    """Run one plot function (the PNG path last); False when it wrote nothing (it returned False or failed)."""
    png = args[-1]
    try:
        made = function(*args) is not False
    except Exception as e:  # a failed plot must not cost the run its report
        log.warning("report: could not draw %s (%s: %s); the report goes on without it", png.name, type(e).__name__, e)
        made = False
    if not made:
        png.unlink(missing_ok=True)  # an older report's figure must not pass for this one's
    return made


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _strict(scores: dict) -> dict:
    # JSON has no NaN: a metric with nothing to measure (an empty band, an empty split) is null.
    return {k: [_finite(x) for x in v] if isinstance(v, list) else _finite(v) for k, v in scores.items()}


def _fmt(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"


def _markdown(
    run_dir, results, checkpoint, data, split, loss: bool, growth: bool, task_plots: dict[str, list[str]]
) -> str:
    lines = [
        f"# Run `{run_dir.name}`: {split} metrics",
        "",
        f"Checkpoint: `{checkpoint.name}`. PDEBench's metrics, in physical units, on predicted frames only: nRMSE",
        "and RMSE per sample, time step and channel, then averaged; cRMSE the error of the spatial mean; bRMSE",
        "the RMSE on the domain's boundary; max error the largest |error| per time step and channel, averaged;",
        "fRMSE the Fourier error in wavenumber bands low k < 4, mid 4 <= k < 12, high k >= 12 (n/a: the grid",
        "has no such modes). Baselines: repeat the last input frame (time-dependent tasks), the training set's",
        "mean field (steady tasks).",
        "",
        "| task | | " + " | ".join(HEADINGS.values()) + " | samples |",
        "|---|---|" + "---|" * (len(HEADINGS) + 1),
    ]
    for name, r in results.items():
        better = r["nrmse"] < r["baseline_nrmse"]
        model = "model" if better else "model (**not better than the baseline in nRMSE**)"
        model_cells = " | ".join(_fmt(r[k]) for k in HEADINGS)
        base_cells = " | ".join(_fmt(r[f"baseline_{k}"]) for k in HEADINGS)
        lines.append(f"| {name} | {model} | {model_cells} | {r['n_samples']} |")
        lines.append(f"| {name} | baseline | {base_cells} | {r['n_samples']} |")
    lines += ["", "## Data", "", "| task | split | file | samples | |", "|---|---|---|---|---|"]
    for name, splits in data.items():
        for split_name, d in splits.items():
            start, stop = d["samples"]
            how = "carved from the train file (PDEBench convention)" if d["carved"] else ""
            lines.append(f"| {name} | {split_name} | `{d['file']}` | {start}..{stop} | {how} |")
    lines += ["", "## Plots", ""]
    if loss:
        lines += [f"![loss curves]({LOSS_PNG})", ""]
    else:
        lines += ["No loss curves: the run's metrics.jsonl is missing or holds no per-task loss.", ""]
    if growth:
        lines += [
            "### Error growth over the rollout (nRMSE of each predicted step)",
            "",
            f"![error growth]({GROWTH_PNG})",
            "",
        ]
    for name, names in task_plots.items():
        if field_png(name) in names:
            lines += [f"### {name}, {split} sample 0", "", f"![{name}]({field_png(name)})", ""]
    return "\n".join(lines)


def report_is_current(run_dir: Path, checkpoint: Path | None) -> bool:
    """The report was written from the newest checkpoint (it is newer than that checkpoint)."""
    summary = run_dir / "report" / "summary.json"
    return checkpoint is not None and summary.is_file() and summary.stat().st_mtime_ns >= checkpoint.stat().st_mtime_ns


def read_summary(run_dir: Path) -> dict[str, dict]:
    """The per-task metrics of the run's report (report/summary.json)."""
    return json.loads((run_dir / "report" / "summary.json").read_text())
