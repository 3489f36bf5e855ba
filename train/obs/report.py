"""The run's report in run_dir/report: summary.json (per task metrics and where the data came from),
summary.md (the same, for people) and the PNG plots it embeds (loss curves, one field comparison per task)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from train import run_files
from train.atomic import write_json_atomic, write_text_atomic
from train.errors import ConfigError
from train.obs import plots

log = logging.getLogger(__name__)

LOSS_PNG = "loss.png"
COMPILE_KEY = "compile"
"""summary.json's block of what torch.compile did (the other keys are tasks; no task may be named so)."""
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
    "rel_l2": "rel. L2",
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
    provenance: dict[str, dict] | None = None,
) -> None:
    """``results``: evaluate_split's; ``data``: per task, the cache's record of each split (file, sample range,
    carved or not); ``examples``: per task, evaluate.example_prediction's fields (a task may be absent);
    ``provenance``: per task, the run's record of where its data came from (RunDir.load_data: each split's
    origin, which takes precedence over the cache's record, and the data stage's warnings)."""
    provenance = provenance or {}
    data = {name: _with_origins(splits, provenance.get(name, {}).get("data", {})) for name, splits in data.items()}
    warnings = {name: p["data_warnings"] for name, p in provenance.items() if "data_warnings" in p}
    report = run_dir / run_files.REPORT
    loss = _plot(plots.loss_curves, run_dir / run_files.METRICS, report / LOSS_PNG)
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
    weights_from = next((p["weights_from"] for p in provenance.values() if "weights_from" in p), None)
    markdown = _markdown(run_dir, results, checkpoint, data, warnings, split, loss, growth, task_plots, weights_from)
    write_text_atomic(report / run_files.SUMMARY_MD, markdown)
    # summary.json last: report_is_current takes its time as the report's.
    summary = {
        name: {
            **_strict(r),
            "data": data[name],
            **({"data_warnings": warnings[name]} if name in warnings else {}),
            "plots": task_plots[name],
        }
        for name, r in results.items()
    }
    compiled = _compile_block(report)
    write_json_atomic(report / run_files.SUMMARY, {**summary, **({COMPILE_KEY: compiled} if compiled else {})})


def _with_origins(splits: dict[str, dict], origins: dict[str, dict]) -> dict[str, dict]:
    # The run's record wins: a cache is shared by every file with the same bytes, so the file it names may be
    # another (an earlier name of it, another run's download) than the one this run read.
    order = ("train", "val", "test")
    ordered = sorted(splits, key=lambda split: order.index(split) if split in order else len(order))
    # a split the run has none of (val_fraction 0) is not data it read: not listed
    ordered = [split for split in ordered if splits[split]["samples"][0] != splits[split]["samples"][1]]
    return {split: {**splits[split], **origins.get(split, {})} for split in ordered}


def _origin(d: dict) -> str:
    """How a split was obtained, for the Data table."""
    kind = d.get("origin")
    if "files" in d:  # a folder of files (The Well)
        where = f"`{d['url']}`" if d.get("url") else "local folder"
        return f"{where}, {len(d['files'])} file(s) ({sum(f.get('size') or 0 for f in d['files'])} bytes)"
    if kind in ("b2", "s3"):
        verified = ", not verified" if d.get("sha1_verified") is False else ""
        return f"`{d['url']}` (SHA1 {d.get('sha1') or 'unknown'}{verified}, uploaded {d.get('uploaded') or 'unknown'})"
    if kind == "local":
        return f"local file ({d.get('size')} bytes, modified {d.get('modified')})"
    if kind == "generated":
        params = d.get("generator") or {}
        first = [k for k in ("pde", "n_samples", "resolution", "coefficient", "seed") if k in params]
        settings = ", ".join(f"{k}={params[k]}" for k in first + sorted(params.keys() - set(first)))
        return f"generated ({settings or 'settings unknown'})"
    if kind == "carved" or d.get("carved"):
        where = f" `{d['carved_from']}`" if d.get("carved_from") else ""
        return f"carved from the train file{where} ({d.get('convention', 'PDEBench convention')})"
    return ""


def _horizon_table(results: dict) -> list[str]:
    """nRMSE at fixed rollout steps, to each split's own last step (summary.json: ``nrmse_at_step``)."""
    rows = {name: r["nrmse_at_step"] for name, r in results.items() if r.get("nrmse_at_step")}
    if not rows:
        return []
    steps = sorted({s for at in rows.values() for s in at if s != "last"}, key=int)
    lines = ["", "nRMSE after so many rollout steps (to the trajectories' own end):", ""]
    lines += ["| task | " + " | ".join(steps) + " | last step |", "|---|" + "---:|" * (len(steps) + 1)]
    for name, at in rows.items():
        cells = [_fmt(at.get(step)) for step in steps]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt(at['last'])} |")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


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


def _strict(scores):
    # JSON has no NaN: a metric with nothing to measure (an empty band, an empty split) is null.
    if isinstance(scores, dict):
        return {k: _strict(v) for k, v in scores.items()}
    if isinstance(scores, list):
        return [_strict(x) for x in scores]
    return _finite(scores)


def _fmt(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"


def _fine_tuned(weights_from: dict | None) -> list[str]:
    if not weights_from:
        return []
    source, path, sha = weights_from["source"], weights_from["checkpoint"], weights_from["sha256"][:16]
    return [f"Fine-tuned: the initial weights came from `{source}` (`{path}`, SHA-256 {sha}).", ""]


def diverged(results: dict[str, dict]) -> list[str]:
    """The tasks whose test nRMSE is not finite though they have test samples (NaN as evaluation computes it,
    null as summary.json holds it): a model that diverged, never a result."""
    return [name for name, r in results.items() if r.get("n_samples") and _finite(r.get("nrmse")) is None]


def diverged_error(tasks: list[str], checkpoint: str, report: Path) -> ConfigError:
    return ConfigError(
        f"training diverged: the test metrics of {checkpoint} are not finite for {', '.join(tasks)}; the model's "
        f"outputs overflow (the report, {report}, shows n/a). Lower train.lr, set train.grad_clip, use "
        "train.precision=bf16 or fp32, or train.on_nonfinite=stop to stop at the first non-finite step instead of "
        "skipping it, and train it again (train.resume=never)"
    )


def figure(value, digits: int = 4) -> str:
    """A metric for a log line: ``n/a`` where there is none (null in summary.json: it was not finite)."""
    return f"{value:.{digits}g}" if _finite(value) is not None else "n/a"


def headline(r: dict, baseline: bool = False) -> float | None:
    """A task's headline error: nRMSE over the fields that change (a field constant over a trajectory is its
    condition, which nRMSE would divide by its own size: docs/data-formats.md, 'Metrics'); the plain nRMSE where
    every field is constant or the report predates the distinction."""
    prefix = "baseline_" if baseline else ""
    value = _finite(r.get(f"{prefix}nrmse_dynamic"))
    return value if value is not None else _finite(r.get(f"{prefix}nrmse"))


def summary_score(results: dict[str, dict]) -> dict[str, float]:
    """One score for a run of many tasks, on each task's headline error (:func:`headline`): the mean, and the
    geometric mean over tasks of the model's relative to its baseline's (below 1: better than the baseline; each
    task counts the same whatever its scale, since both are relative to the task's own)."""
    scored = [r for r in results.values() if headline(r) is not None]
    ratios = [headline(r) / headline(r, True) for r in scored if (headline(r, True) or 0) > 0]
    return {
        "tasks": len(results),
        "mean_nrmse": float(np.mean([headline(r) for r in scored])) if scored else float("nan"),
        "nrmse_to_baseline": float(np.exp(np.mean(np.log(ratios)))) if ratios else float("nan"),
    }


def _markdown(
    run_dir,
    results,
    checkpoint,
    data,
    warnings,
    split,
    loss: bool,
    growth: bool,
    task_plots: dict[str, list[str]],
    weights_from: dict | None = None,
) -> str:
    lines = [
        f"# Run `{run_dir.name}`: {split} metrics",
        "",
        f"Checkpoint: `{checkpoint.name}`. PDEBench's metrics, in physical units, on predicted frames only: nRMSE",
        "and RMSE per sample, time step and channel, then averaged; cRMSE the error of the spatial mean; bRMSE",
        "the RMSE on the domain's boundary; max error the largest |error| per time step and channel, averaged;",
        "fRMSE the Fourier error in wavenumber bands low k < 4, mid 4 <= k < 12, high k >= 12 (n/a: the grid",
        "has no such modes). Baselines: repeat the last input frame (time-dependent tasks), the training set's",
        "mean field (steady tasks). rel. L2 is the neural-operator literature's relative L2 error",
        "||prediction - truth|| / ||truth|| per sample over the whole predicted field, averaged.",
        "",
        *_fine_tuned(weights_from),
        "| task | | " + " | ".join(HEADINGS.values()) + " | samples |",
        "|---|---|" + "---|" * (len(HEADINGS) + 1),
    ]
    for name, r in results.items():
        better = (headline(r) or math.inf) < (headline(r, True) or math.inf)
        model = "model" if better else "model (**not better than the baseline**)"
        model_cells = " | ".join(_fmt(r[k]) for k in HEADINGS)
        base_cells = " | ".join(_fmt(r[f"baseline_{k}"]) for k in HEADINGS)
        lines.append(f"| {name} | {model} | {model_cells} | {r['n_samples']} |")
        lines.append(f"| {name} | baseline | {base_cells} | {r['n_samples']} |")
    lines += _field_table(results)
    lines += _horizon_table(results)
    if len(results) > 1:
        score = summary_score(results)
        lines += [
            "",
            f"Over the {score['tasks']} tasks: mean nRMSE of the changing fields {_fmt(score['mean_nrmse'])}; "
            f"geometric mean of it over the baseline's {_fmt(score['nrmse_to_baseline'])} (below 1: better than the "
            "baselines).",
        ]
    lines += _well_tables(results)
    lines += _data_section(data, warnings)
    lines += _plots_section(split, loss, growth, task_plots)
    return "\n".join(lines)


def _data_section(data: dict, warnings: dict) -> list[str]:
    """Where every split came from, and what the data stage warned about."""
    lines = ["", "## Data", "", "| task | split | origin | file read | samples |", "|---|---|---|---|---|"]
    for name, splits in data.items():
        for split_name, d in splits.items():
            start, stop = d["samples"]
            lines.append(f"| {name} | {split_name} | {_cell(_origin(d))} | `{_cell(d['file'])}` | {start}..{stop} |")
    if warnings:
        # the data stage's own warnings name their task ("data <task>: ..."), a download's its URL
        found = [
            f"- {text}" if text.startswith(f"data {name}:") else f"- {name}: {text}"
            for name, texts in warnings.items()
            for text in texts
        ]
        lines += ["", "Warnings of the data stage:" if found else "The data stage gave no warnings.", "", *found]
    return lines


def _plots_section(split: str, loss: bool, growth: bool, task_plots: dict[str, list[str]]) -> list[str]:
    """The links to the plots that were drawn, and why the loss curves are missing where they are."""
    lines = ["", "## Plots", ""]
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
    return lines


def _field_table(results: dict) -> list[str]:
    """Per task and field: the nRMSE (model and baseline) and the share of samples in which the field is constant;
    the headline, nRMSE over the fields that change, beside them."""
    rows = []
    for name, r in results.items():
        fields = r.get("nrmse_by_field") or {}
        for field, value in fields.items():
            constant = (r.get("constant_fields") or {}).get(field)
            share = "n/a" if constant is None else f"{100 * constant:.0f}%"
            base = (r.get("baseline_nrmse_by_field") or {}).get(field)
            rows.append(f"| {name} | {field} | {_fmt(value)} | {_fmt(base)} | {share} |")
        if fields:
            rows.append(f"| {name} | **changing fields** | {_fmt(headline(r))} | {_fmt(headline(r, True))} | |")
    if not rows:
        return []
    return [
        "",
        "Per field: nRMSE over every sample, and over the fields that change (the headline: a field constant over a",
        "trajectory, such as an advected flow's uniform velocity, is a condition of it and is left out).",
        "",
        "| task | field | nRMSE | baseline nRMSE | constant in |",
        "|---|---|---|---|---|",
        *rows,
    ]


def _well_tables(results: dict) -> list[str]:
    """The Well's metrics of its tasks: per field, one-step VRMSE (model and repeat-last-frame baseline), rollout
    VRMSE and NRMSE; the rollout windows 6:12 and 13:30 where the trajectories reach them."""
    lines = []
    for name, r in results.items():
        well = r.get("well")
        if not well or not well.get("one_step"):
            continue
        one, base, roll = well["one_step"], well["baseline_one_step"], well.get("rollout") or {}
        windows = ", ".join(
            f"{k.removeprefix('vrmse_').replace('_', ':')} {_fmt(roll[k])}"
            for k in ("vrmse_6_12", "vrmse_13_30")
            if k in roll
        )
        lines += [
            "",
            f"## {name}: The Well's metrics",
            "",
            f"Normalised with statistics from the {well.get('statistics', 'train split')}. VRMSE = sqrt(MSE / var(y)),"
            " NRMSE = sqrt(MSE / mean(y^2)), per sample, step and field over space, physical units. One-step: every",
            "window of the split; rollout: from the first frames to the end"
            + (f" (windows {windows})." if windows else "."),
            "",
            "| field | one-step VRMSE | baseline one-step VRMSE | one-step NRMSE | rollout VRMSE | rollout NRMSE |",
            "|---|---|---|---|---|---|",
        ]
        for field in one["vrmse_by_field"]:
            cells = [
                one["vrmse_by_field"][field],
                base["vrmse_by_field"][field],
                one["nrmse_by_field"][field],
                roll.get("vrmse_by_field", {}).get(field),
                roll.get("nrmse_by_field", {}).get(field),
            ]
            lines.append(f"| {field} | " + " | ".join(_fmt(c) for c in cells) + " |")
        cells = [one["vrmse"], base["vrmse"], one["nrmse"], roll.get("vrmse"), roll.get("nrmse")]
        lines.append("| **mean** | " + " | ".join(_fmt(c) for c in cells) + " |")
    return lines


def report_is_current(run_dir: Path, checkpoint: Path | None) -> bool:
    """The report was written from ``checkpoint``, the one evaluation scores (best, else the newest): it is newer
    than that checkpoint."""
    summary = run_dir / run_files.REPORT / run_files.SUMMARY
    return checkpoint is not None and summary.is_file() and summary.stat().st_mtime_ns >= checkpoint.stat().st_mtime_ns


def read_summary(run_dir: Path) -> dict[str, dict]:
    """The per-task metrics of the run's report (report/summary.json), without its compile block."""
    summary = json.loads((run_dir / run_files.REPORT / run_files.SUMMARY).read_text())
    return {name: r for name, r in summary.items() if name != COMPILE_KEY}


def _compile_block(report: Path) -> dict | None:
    try:
        return json.loads((report / run_files.COMPILE).read_text())
    except (OSError, ValueError):
        return None
