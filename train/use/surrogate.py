"""A trained surrogate in a script: ``Surrogate.load(run | checkpoint | remote)``, then ``predict`` one step or
``rollout`` many, in physical units.

A checkpoint describes itself (train.checkpoint: CONFIG, SPECS, TASK_CARDS): the model's name and settings,
each task's shapes and the statistics that normalise its inputs and targets. Loading needs neither the data,
nor the cache, nor the config file. Inputs are normalised, the model runs under ``torch.no_grad`` in the
precision the run trained in, and its outputs are turned back into physical units: numpy in, numpy out; torch
in, torch out (on the input's device).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from train.checkpoint import (
    CONFIG,
    MODEL,
    MODEL_SOURCE,
    SPECS,
    TASK_CARDS,
    USE_ADVICE,
    load_checkpoint,
    load_model_state,
    why_chosen,
)
from train.config import ModelConfig, TrainConfig, migrate_model_keys
from train.engine.objective import advance
from train.engine.setup import resolve_precision
from train.errors import ConfigError, DataError, PreflightError, TrainError
from train.model.builtin import MODELS
from train.model.factory import build_model, factory_source
from train.model.specs import TaskSpec, spec_from_record
from train.remote.fetch import resolve_checkpoint, resolve_initial_weights  # noqa: F401 (callers' names)
from train.run_dir import RunDir

log = logging.getLogger(__name__)

Array = TypeVar("Array", np.ndarray, torch.Tensor)


@dataclass(frozen=True)
class TaskCard:
    """One task as a trained model knows it: its shapes (``spec``) and how its values are normalised."""

    name: str
    spec: TaskSpec
    pde: str
    channels: tuple[str, ...]
    """Channel names where the data names them (The Well), else ()."""
    n_frames: int
    """Frames of a trajectory in the training data (after the temporal stride)."""
    input_mean: np.ndarray
    input_std: np.ndarray
    """Per input channel, constant channels included (a Well task's constant fields follow the others)."""
    target_mean: np.ndarray
    target_std: np.ndarray
    settings: dict
    """The task's section of the training config (strides, initial_step, ...), as data."""

    @classmethod
    def from_checkpoint(cls, name: str, saved: dict, path: Path) -> TaskCard:
        cards = saved.get(TASK_CARDS)
        if not cards or name not in cards:
            raise DataError(
                f"checkpoint {path} does not carry the normalisation statistics of task '{name}' (it was written "
                "before checkpoints described themselves). Load it from its run folder instead, whose caches "
                "hold them: Surrogate.load('runs/<name>', checkpoint=...)"
            )
        card = cards[name]
        spec = spec_from_record(saved[SPECS][name])
        return cls(
            name=name,
            spec=spec,
            pde=card["pde"],
            channels=tuple(card["channels"]),
            n_frames=int(card["n_frames"]),
            input_mean=np.asarray([*card["input_mean"], *card["const_mean"]], np.float32),
            input_std=np.asarray([*card["input_std"], *card["const_std"]], np.float32),
            target_mean=np.asarray(card["target_mean"], np.float32),
            target_std=np.asarray(card["target_std"], np.float32),
            settings=saved[CONFIG]["tasks"][name],
        )

    def input_shape(self, batch: int | str = "batch") -> tuple:
        """What ``predict`` and ``rollout`` take: (batch, initial_step, *grid, in_channels), or (batch, *grid,
        in_channels) for a steady task."""
        frames = (self.spec.initial_step,) if self.spec.autoregressive else ()
        return (batch, *frames, *self.spec.grid, self.spec.in_channels)


class Surrogate:
    """A trained model and its tasks, ready to predict. Build it with :meth:`load`."""

    def __init__(self, model: nn.Module, tasks: dict[str, TaskCard], config: dict, checkpoint: Path, device, precision):
        self.model = model.eval()
        self.tasks = tasks
        self.config = config
        """The run's resolved config, as data."""
        self.checkpoint = checkpoint
        self.chosen = "as given"
        """Why :meth:`load` took this checkpoint: best.pt's validation score, the last step (no best.pt), or as
        given."""
        self.device = torch.device(device)
        self.precision = precision
        """The autocast dtype of the run's train.precision on this device (None: float32)."""

    # -- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        source: str | Path,
        checkpoint: str | Path = "best",
        device: str | torch.device = "cpu",
        precision: str | None = None,
        factory: str | None = None,
        b2_api=None,
        changed_source: str = "warn",
    ) -> Surrogate:
        """A run folder (its ``checkpoints/best.pt``, else its newest step checkpoint), a checkpoint file, or a
        run's remote copy ``b2://bucket/prefix/<run name>`` (the verified checkpoint it lists, fetched once).

        ``checkpoint``: 'best', 'latest' or a path, for a run folder. ``precision``: fp32, bf16 or fp16; default
        the run's own train.precision (auto: bf16 on GPUs that have it, fp32 on CPU). ``factory``: where a model
        of your own now lives ('module:function' or 'file.py:function'), when it moved since training.
        ``changed_source``: what a model file of your own edited since training gets: 'warn' (the weights load
        into the model as the file defines it now) or 'refuse' (ConfigError, as training and export do)."""
        path = resolve_checkpoint(source, checkpoint, b2_api)
        saved = load_checkpoint(path, advice=USE_ADVICE)
        for key in (CONFIG, SPECS, MODEL):
            if key not in saved:
                raise DataError(f"{path} is not a training checkpoint of this package (it has no '{key}')")
        model_cfg = _model_config(saved, path, factory)
        run_folder = path.parent.parent
        if TASK_CARDS not in saved and path.parent.name == "checkpoints" and (run_folder / "inputs.json").is_file():
            saved[TASK_CARDS] = _cards_of_run(run_folder, path)
        tasks = {name: TaskCard.from_checkpoint(name, saved, path) for name in saved[SPECS]}
        try:
            model = build_model({name: card.spec for name, card in tasks.items()}, model_cfg)
        except ConfigError as e:
            if factory is not None or model_cfg.name in MODELS:
                raise
            where = (saved.get(MODEL_SOURCE) or {}).get("file", model_cfg.name)
            raise ConfigError(
                f"{path} was trained with model.name={model_cfg.name} (defined in {where}), which cannot be built "
                f"here: {e}. If the file moved, say where it is now: --factory path/to/file.py:function (python -m "
                "train predict / export), or Surrogate.load(..., factory='path/to/file.py:function') (a relative "
                "path is read from the current folder)"
            ) from None
        _check_source(model_cfg.name, saved.get(MODEL_SOURCE), path, refuse=changed_source == "refuse")
        load_model_state(model, saved[MODEL], path)
        device = _device(device)
        requested = precision or saved[CONFIG].get("train", {}).get("precision", TrainConfig().precision)
        if requested not in PRECISIONS:
            raise ConfigError(
                f"precision={requested!r}: choose one of {', '.join(PRECISIONS)} (default: the run's own)"
            )
        resolved = resolve_precision(requested, device)
        chosen = why_chosen(path) if checkpoint == "best" and Path(str(source)).is_dir() else "as given"
        log.info("loaded %s (%s; model %s, tasks %s) on %s", path, chosen, model_cfg.name, ", ".join(tasks), device)
        surrogate = cls(model.to(device), tasks, saved[CONFIG], path, device, resolved)
        surrogate.chosen = chosen
        return surrogate

    # -- using -----------------------------------------------------------------------------------------------

    def task(self, name: str | None = None) -> TaskCard:
        """Task ``name``; None: the only one (an error naming them when there are several)."""
        if name is None and len(self.tasks) == 1:
            return next(iter(self.tasks.values()))
        if name not in self.tasks:
            raise ConfigError(f"task {name!r}: this model was trained on {', '.join(self.tasks)}; name one of them")
        return self.tasks[name]

    def predict(self, task: str | None, inputs: Array, batch_size: int = 64) -> Array:
        """One step: the next frame after each input window (batch, initial_step, *grid, in_channels), or a
        steady task's solution of (batch, *grid, in_channels); returns (batch, *grid, out_channels)."""
        card = self.task(task)
        shape = (*card.spec.grid, card.spec.out_channels)
        return self._batched(card, inputs, batch_size, lambda x: self._step(card, x), shape)

    def rollout(self, task: str | None, initial: Array, steps: int, batch_size: int = 64) -> Array:
        """``steps`` frames predicted one after another from each initial window (batch, initial_step, *grid,
        in_channels), each fed back as the newest input frame; returns (batch, steps, *grid, out_channels).
        A Well task's constant channels ride along from the initial window."""
        card = self.task(task)
        if not card.spec.autoregressive:
            raise ConfigError(f"task {card.name} is steady (no time axis): use predict, not rollout")
        if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
            raise ConfigError(f"steps={steps!r}: a rollout predicts a whole number of frames, at least one")
        shape = (int(steps), *card.spec.grid, card.spec.out_channels)
        return self._batched(card, initial, batch_size, lambda x: self._roll(card, x, int(steps)), shape)

    # -- internals -------------------------------------------------------------------------------------------

    def _batched(self, card: TaskCard, inputs: Array, batch_size: int, run: Callable, shape: tuple) -> Array:
        """``run`` over ``inputs`` in batches; ``shape``: one sample's output shape (of an empty batch's output)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r}: samples per forward pass, a whole number of at least 1")
        batch_size = int(batch_size)
        as_numpy = isinstance(inputs, np.ndarray)
        x = torch.from_numpy(np.asarray(inputs, np.float32)) if as_numpy else inputs
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"inputs: a numpy array or a torch tensor, not {type(inputs).__name__}")
        want = card.input_shape()
        if x.dim() != len(want) or tuple(x.shape[1:]) != want[1:]:
            raise ConfigError(
                f"task {card.name}: inputs of shape {tuple(x.shape)}; this model takes {want} (channels last)"
            )
        finite = torch.isfinite(x.detach()).flatten(1).all(dim=1) if len(x) else torch.ones(0, dtype=torch.bool)
        if not bool(finite.all()):
            bad = int((~finite).nonzero()[0, 0])
            raise DataError(
                f"task {card.name}: sample {bad} of the inputs holds NaN or inf ({int((~finite).sum())} of "
                f"{len(x)} samples do); a model's predictions from them would be NaN. Clean or drop those samples"
            )
        where = x.device
        outs = [run(x[i : i + batch_size].to(self.device, torch.float32)) for i in range(0, len(x), batch_size)]
        out = torch.cat(outs).to(where) if outs else x.new_zeros((0, *shape))
        return out.numpy() if as_numpy else out

    def _normalised(self, card: TaskCard, x: torch.Tensor) -> torch.Tensor:
        mean = torch.from_numpy(card.input_mean).to(x.device)
        std = torch.from_numpy(card.input_std).to(x.device)
        return (x - mean) / std

    def _physical(self, card: TaskCard, y: torch.Tensor) -> torch.Tensor:
        mean = torch.from_numpy(card.target_mean).to(y.device)
        std = torch.from_numpy(card.target_std).to(y.device)
        return y.float() * std + mean

    @torch.no_grad()
    def _forward(self, card: TaskCard, x: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            return self.model({card.name: x})[card.name]

    def _step(self, card: TaskCard, x: torch.Tensor) -> torch.Tensor:
        return self._physical(card, self._forward(card, self._normalised(card, x)))

    def _roll(self, card: TaskCard, x: torch.Tensor, steps: int) -> torch.Tensor:
        window, frames = self._normalised(card, x), []
        for _ in range(steps):
            nxt = self._forward(card, window)
            frames.append(nxt)
            window = advance(window, nxt)
        return self._physical(card, torch.stack(frames, dim=1))


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def _device(device: str | torch.device) -> torch.device:
    """``device`` as torch names it, refused (PreflightError, exit 4) when this machine has no such device."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r}: not a device name ({e}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise PreflightError(f"device={device}: {why}; use device='cpu'")
        if device.index is not None and device.index >= count:
            raise PreflightError(f"device={device}: this machine shows {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    elif device.type != "cpu":
        raise ConfigError(f"device={device}: only cpu and cuda devices are supported")
    return device


def _cards_of_run(folder: Path, path: Path) -> dict:
    """An older checkpoint's task cards, from the caches its run folder names (when they are still there)."""
    run = RunDir(folder)
    try:
        tasks = run.load_tasks(run.load_config())
    except (OSError, ValueError, TrainError) as e:
        raise DataError(
            f"{path} was written before checkpoints carried their normalisation statistics, and its run folder "
            f"{folder} cannot give them ({e}); rebuild the run's caches (python -m train cache with its config)"
        ) from None
    log.info("%s: normalisation statistics from the run's caches (an older checkpoint)", path)
    return {task.name: task.card() for task in tasks}


def _model_config(saved: dict, path: Path, factory: str | None) -> ModelConfig:
    data = migrate_model_keys(saved[CONFIG].get("model", {}))
    if factory is not None:
        data = {**data, "name": factory}
    try:
        return ModelConfig.model_validate(data)
    except Exception as e:  # a checkpoint of a newer version with keys this one does not know
        raise DataError(f"{path}: its model settings cannot be read by this version ({e})") from None


def _check_source(name: str, recorded: dict | None, path: Path, refuse: bool = False) -> None:
    """A model of your own whose file changed since training: said (the weights still load only into matching
    shapes, and using an edited model may be what is wanted), or with ``refuse`` a ConfigError (an export would
    ship the edited model under the trained weights' name)."""
    if not recorded:
        return
    now = factory_source(name)
    if now is not None and now["sha256"] != recorded.get("sha256") and refuse:
        raise ConfigError(
            f"{path} was trained with {recorded.get('file')} as it was then (SHA-256 "
            f"{str(recorded.get('sha256'))[:12]}); that file has changed since ({now['sha256'][:12]} now). Put the "
            "source back, or pass --accept-changed-model-source if the edited model is what you want to export"
        )
    if now is not None and now["sha256"] != recorded.get("sha256"):
        log.warning(
            "%s was trained with %s as it was then (SHA-256 %s); that file has changed since (%s): the weights are "
            "loaded into the model as the file defines it now",
            path,
            recorded.get("file"),
            str(recorded.get("sha256"))[:12],
            now["sha256"][:12],
        )
