"""The report's figures: loss curves from metrics.jsonl, the error's growth over a rollout, and true/predicted/
error fields of one test sample.

matplotlib is imported inside the functions (importing it costs about a second) and drives a Figure on
its own Agg canvas, never pyplot: no global backend is switched and no GUI is ever needed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from train.atomic import atomic_path
from train.obs.sinks import read_metrics


def new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, png: Path) -> None:
    # The temporary name ends in .tmp, so the format must be named.
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _plottable(value) -> bool:
    # A log axis cannot show zero or negative losses.
    return _number(value) and value > 0


def _series(records: list[dict], prefix: str, skip: tuple[str, ...] = ()) -> dict[str, tuple[list, list]]:
    """Per task, the (steps, values) of the keys ``<prefix><task>``, in file order (a resumed run repeats steps)."""
    series: dict[str, tuple[list, list]] = {}
    for record in records:
        step = record.get("step")
        if not _number(step):
            continue
        for key, value in record.items():
            if key.startswith(prefix) and key not in skip and _plottable(value):
                steps, values = series.setdefault(key[len(prefix) :], ([], []))
                steps.append(step)
                values.append(value)
    return series


def loss_curves(metrics_path: Path, png: Path) -> bool:
    """Per-task training loss (lines) and validation loss (points) against step, log scale.

    Returns False, writing nothing, when ``metrics_path`` is missing or holds no per-task loss.
    """
    records = read_metrics(metrics_path)
    train = _series(records, "loss/")
    val = _series(records, "val/", skip=("val/loss",))
    if not train and not val:
        return False
    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    colours = {task: f"C{i % 10}" for i, task in enumerate(dict.fromkeys([*train, *val]))}
    for task, (steps, values) in train.items():
        ax.plot(steps, values, color=colours[task], linewidth=1.2, label=f"{task} train")
    for task, (steps, values) in val.items():
        ax.plot(steps, values, "o", color=colours[task], markersize=5, markeredgecolor="black", label=f"{task} val")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (normalised MSE)")
    ax.set_title("Training and validation loss per task")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    save_png(fig, png)
    return True


def rollout_tasks(results: dict[str, dict]) -> list[str]:
    """The tasks whose results hold an error curve over more than one predicted step."""
    return [name for name, r in results.items() if len(r.get("nrmse_by_step") or []) > 1]


def error_growth(results: dict[str, dict], png: Path) -> bool:
    """nRMSE of each predicted step of the rollout, model and baseline, one panel per time-dependent task, log
    scale. Returns False, writing nothing, when no task rolls out over more than one step."""
    names = rollout_tasks(results)
    if not names:
        return False
    fig = new_figure(4.2 * len(names), 3.2)
    for ax, name in zip(fig.subplots(1, len(names), squeeze=False)[0], names, strict=True):
        for key, label, style in (("nrmse_by_step", "model", "-"), ("baseline_nrmse_by_step", "baseline", "--")):
            curve = [(i + 1, v) for i, v in enumerate(results[name].get(key) or []) if _plottable(v)]
            if curve:
                ax.plot(*zip(*curve, strict=True), style, label=label)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("predicted step")
        ax.set_ylabel("nRMSE")
        ax.legend()
    save_png(fig, png)
    return True


def _plane(field: np.ndarray) -> np.ndarray:
    """A 2D (x, y) or 3D field of one channel -> an (x, y) plane; 3D takes the middle of the further axes."""
    while field.ndim > 2:
        field = field[..., field.shape[-1] // 2]
    return field


def _image(fig, ax, data: np.ndarray, title: str, xlabel: str, ylabel: str, **kwargs) -> None:
    # data is (vertical, horizontal); origin lower puts index 0 at the bottom, as on a plot's axes.
    im = ax.imshow(data, origin="lower", aspect="auto", interpolation="nearest", **kwargs)
    fig.colorbar(im, ax=ax)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def _view(field: np.ndarray, steady: bool) -> np.ndarray:
    """The image of one channel: (t, x) as it is, time running up; else the (last frame's) plane, transposed
    so that x runs across."""
    if not steady and field.ndim == 2:
        return field
    return _plane(field if steady else field[-1]).T


def field_comparison(example: dict[str, np.ndarray], task_name: str, png: Path) -> None:
    """True, predicted and |error| fields (plus the input for steady tasks), channel 0, as images.

    ``example`` is what evaluate.example_prediction returns. 1D time-dependent: space-time images (x across,
    t up); 2D time-dependent: the last predicted frame; 2D steady: input, true, predicted and |error|.
    """
    true, pred = example["true"][..., 0], example["pred"][..., 0]
    steady = "input" in example
    if steady and true.ndim == 1:
        _profiles(example["input"][..., 0], true, pred, task_name, png)
        return
    space_time = not steady and true.ndim == 2
    labels = ("x index", "predicted step") if space_time else ("x index", "y index")
    suffix = "" if steady or space_time else ", last step"
    true, pred = _view(true, steady), _view(pred, steady)
    error = np.abs(pred - true)
    # The true field's range for both: a prediction that blows up saturates instead of washing out the truth.
    scale = {"vmin": float(np.min(true)), "vmax": float(np.max(true)), "cmap": "viridis"}
    err_kw = {"vmin": 0.0, "vmax": max(float(np.max(error)), 1e-30), "cmap": "magma"}
    panels = [("true", true, scale), ("predicted", pred, scale), ("|error|", error, err_kw)]
    if steady:
        panels.insert(0, ("input", _view(example["input"][..., 0], steady), {"cmap": "cividis"}))
    fig = new_figure(4.2 * len(panels), 3.6)
    for ax, (name, data, kw) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        _image(fig, ax, data, name + suffix, *labels, **kw)
    fig.suptitle(f"{task_name}: sample 0, channel 0")
    save_png(fig, png)


def _profiles(inp: np.ndarray, true: np.ndarray, pred: np.ndarray, task_name: str, png: Path) -> None:
    """A 1D steady task: the fields as curves beside the error, since an image of one row says little."""
    fig = new_figure(10, 3.6)
    ax, err_ax = fig.subplots(1, 2)
    x = np.arange(true.shape[0])
    ax.plot(x, inp, color="grey", label="input")
    ax.plot(x, true, color="black", label="true")
    ax.plot(x, pred, color="C1", linestyle="--", label="predicted")
    ax.legend(fontsize="small")
    ax.set_title("fields")
    err_ax.plot(x, np.abs(pred - true), color="C3")
    err_ax.set_title("|error|")
    for a in (ax, err_ax):
        a.set_xlabel("x index")
    fig.suptitle(f"{task_name}: sample 0, channel 0")
    save_png(fig, png)
