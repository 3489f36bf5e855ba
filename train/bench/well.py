"""Well demo benchmark: `make train CONFIG=configs/well.yaml` from nothing, timed, and its test scores.

The whole command runs as a user runs it (``python -m train run``, 2 ranks, data generated, cache built, trained,
evaluated) in empty data, cache and run folders under the work folder; the wall time includes everything. Its
report gives The Well's one-step VRMSE per field against the repeat-last-frame baseline, and the rollout's.
Targets: the model's one-step test VRMSE at least 3 times better than the baseline's, the whole run under 5
minutes on 2 CPU cores.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from train.bench import machine_figures, run_config, save_result

TARGETS = {"vrmse_ratio": 3.0, "wall_s": 300.0}


def run(out: Path, workdir: Path, quick: bool = False) -> dict:
    load_before = os.getloadavg()[0]
    folders = {key: workdir / f"well-{key}" for key in ("data", "cache", "runs")}
    for folder in folders.values():
        shutil.rmtree(folder, ignore_errors=True)  # from nothing: the data is generated, the cache built
    wall, summary = run_config("well", folders, quick)
    (task, summary), *_ = summary.items()
    well = summary["well"]
    one, base, roll = well["one_step"], well["baseline_one_step"], well["rollout"]
    ratio = base["vrmse"] / one["vrmse"]
    result = {
        "task": task,
        "wall_s": wall,
        "one_step_vrmse": one["vrmse"],
        "baseline_one_step_vrmse": base["vrmse"],
        "vrmse_ratio": ratio,
        "by_field": {f: [one["vrmse_by_field"][f], base["vrmse_by_field"][f]] for f in one["vrmse_by_field"]},
        "rollout": {k: roll[k] for k in ("vrmse", "vrmse_6_12", "vrmse_13_30") if k in roll},
        "statistics": well["statistics"],
        "machine": machine_figures(load_before),
        "targets": {
            f"one-step VRMSE {TARGETS['vrmse_ratio']}x better than repeating the last frame": ratio
            >= TARGETS["vrmse_ratio"],
            f"the whole run under {TARGETS['wall_s']:.0f} s": wall <= TARGETS["wall_s"],
        },
    }
    rows = [f"| {f} | {m:.4f} | {b:.4f} | {b / m:.1f}x |" for f, (m, b) in result["by_field"].items()]
    windows = ", ".join(f"{k} {v:.4f}" for k, v in result["rollout"].items())
    load = result["machine"]["load_average_1min"]
    markdown = "\n".join(
        [
            f"# configs/well.yaml from nothing: {wall:.0f} s (2 ranks, {result['machine']['cpus']} CPUs, load "
            f"{load['before']:.1f} before, {load['after']:.1f} after)",
            "",
            "| field | one-step VRMSE | repeat last frame | better by |",
            "|---|---:|---:|---:|",
            *rows,
            f"| **mean** | {one['vrmse']:.4f} | {base['vrmse']:.4f} | {ratio:.1f}x |",
            "",
            f"Rollout VRMSE: {windows}. Statistics: {well['statistics']}.",
            "",
        ]
    )
    save_result(out, "well", result, markdown)
    return result
