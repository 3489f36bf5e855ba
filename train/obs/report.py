"""The run's report: report/summary.json (per task metrics) and report/summary.md (the same, for people)."""

from __future__ import annotations

from pathlib import Path

from train.atomic import write_json_atomic, write_text_atomic


def write_report(
    run_dir: Path,
    results: dict[str, dict[str, float]],
    checkpoint: Path,
    data: dict[str, dict[str, dict]],
    split: str = "test",
) -> None:
    """``data``: per task, where each split came from (file, sample range, carved or not)."""
    report = run_dir / "report"
    write_json_atomic(report / "summary.json", {name: {**r, "data": data[name]} for name, r in results.items()})
    lines = [
        f"# Run `{run_dir.name}`: {split} metrics",
        "",
        f"Checkpoint: `{checkpoint.name}`. nRMSE and RMSE as in PDEBench (per sample, time step and channel,",
        "then averaged), on predicted frames only. Baselines: repeat the last input frame (time-dependent",
        "tasks), the training set's mean field (steady tasks).",
        "",
        "| task | nRMSE | RMSE | baseline nRMSE | baseline RMSE | better than baseline | samples |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        better = "yes" if r["nrmse"] < r["baseline_nrmse"] else "**no**"
        lines.append(
            f"| {name} | {r['nrmse']:.4g} | {r['rmse']:.4g} | {r['baseline_nrmse']:.4g} | "
            f"{r['baseline_rmse']:.4g} | {better} | {r['n_samples']} |"
        )
    lines += ["", "## Data", "", "| task | split | file | samples | |", "|---|---|---|---|---|"]
    for name, splits in data.items():
        for split_name, d in splits.items():
            start, stop = d["samples"]
            how = "carved from the train file (PDEBench convention)" if d["carved"] else ""
            lines.append(f"| {name} | {split_name} | `{d['file']}` | {start}..{stop} | {how} |")
    write_text_atomic(report / "summary.md", "\n".join(lines) + "\n")


def report_is_current(run_dir: Path, checkpoint: Path | None) -> bool:
    """The report was written from the newest checkpoint (it is newer than that checkpoint)."""
    summary = run_dir / "report" / "summary.json"
    return checkpoint is not None and summary.is_file() and summary.stat().st_mtime_ns >= checkpoint.stat().st_mtime_ns
