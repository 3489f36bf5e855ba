"""``python -m train predict``: a trained model's predictions on a data file, written as a file of the same
format and layout (PDEBench's HDF5 block by block; the FNO paper's .mat, neuraloperator's .pt and PDEArena's
HDF5 whole, by their Format's ``write_back``), and scored with the report's metrics when the input holds the
true frames.

The input is read as training read its data: the task's reader (train.data.formats) at the run's spatial and
temporal strides. A time-dependent task is rolled out from each trajectory's first ``initial_step`` frames,
to the input's last frame or for ``--steps`` frames; the output holds the initial frames followed by the
predicted ones, so it reads back like the input. A steady task (Darcy) gets its solution predicted from its
input field. The output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import torch
from tqdm import tqdm

from train.atomic import atomic_path, write_json_atomic
from train.config import TaskConfig
from train.data.formats import format_of
from train.data.formats.pdebench import GroupReader
from train.engine.metrics import error_sums, finish, nrmse_by_step
from train.errors import ConfigError, DataError
from train.pdes import LAYOUTS
from train.use.outputs import check_output
from train.use.surrogate import Surrogate, TaskCard

log = logging.getLogger(__name__)

COORDINATES = {"x": "x-coordinate", "y": "y-coordinate", "z": "z-coordinate", "t": "t-coordinate"}
"""PDEBench's single-file coordinate datasets (group-per-seed files keep them under <group>/grid/<axis>)."""


def _open(card: TaskCard, path: Path):
    fmt = format_of(card.pde)
    if fmt.predicts is not None:
        raise ConfigError(f"task {card.name} is {card.pde} data: {fmt.predicts}")
    settings = card.settings
    task = TaskConfig(
        pde=card.pde,
        source=str(path),
        initial_step=card.spec.initial_step,
        spatial_stride=settings.get("spatial_stride", 1),
        temporal_stride=settings.get("temporal_stride", 1),
    )
    return fmt.open([Path(path)], task)


def _check(card: TaskCard, reader, path: Path) -> None:
    """The input's grid and frames against the model's, after the run's strides."""
    if reader.grid != card.spec.grid:
        raise DataError(
            f"{path}: grid {reader.grid} (after the run's spatial_stride {card.settings.get('spatial_stride', 1)}) "
            f"but task {card.name} was trained on {card.spec.grid}; give data of the training resolution"
        )
    if card.spec.autoregressive and reader.n_frames < card.spec.initial_step:
        raise DataError(
            f"{path}: {reader.n_frames} frame(s) (after the run's temporal_stride "
            f"{card.settings.get('temporal_stride', 1)}), but task {card.name} starts from {card.spec.initial_step} "
            "initial frames"
        )


def choose_task(model: Surrogate, path: Path, task: str | None) -> tuple[TaskCard, object]:
    """The task ``path`` is data of: ``task``, or the only task whose reader takes the file at its grid."""
    if task is not None or len(model.tasks) == 1:
        card = model.task(task)
        reader = _open(card, path)
        _check(card, reader, path)
        return card, reader
    fits, why = [], []
    for card in model.tasks.values():
        try:
            reader = _open(card, path)
            _check(card, reader, path)
            fits.append((card, reader))
        except (ConfigError, DataError) as e:
            why.append(f"{card.name}: {e}")
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise DataError(f"{path} is data of none of this model's tasks:\n  " + "\n  ".join(why))
    raise ConfigError(f"{path} fits tasks {', '.join(c.name for c, _ in fits)}: name one with --task")


def _blocks(reader, n: int) -> Iterator[tuple[range, dict[str, np.ndarray]]]:
    """The reader's blocks of all ``n`` samples, each with the samples it holds."""
    start = 0
    for parts in reader.parts(range(n)):
        size = len(next(iter(parts.values())))
        yield range(start, start + size), parts
        start += size


class _Collected:
    """The predictions of a format whose files are written whole (train.data.formats: ``Format.write_back``):
    gathered block by block, written in the input's format at the end, atomically."""

    def __init__(self, write_back, reader):
        self.write_back, self.reader, self.inputs, self.outputs = write_back, reader, [], []

    def write(self, samples: range, inputs: np.ndarray, outputs: np.ndarray) -> None:
        self.inputs.append(inputs)
        self.outputs.append(outputs)

    def finish(self, output: Path) -> None:
        self.write_back(output, self.reader, np.concatenate(self.inputs), np.concatenate(self.outputs))


class _Writer:
    """The output file in the input's layout (PDEBench's HDF5 styles), filled block by block."""

    def __init__(self, f: h5py.File, card: TaskCard, reader, n: int, frames: int):
        self.f, self.card, self.reader = f, card, reader
        layout, grid = LAYOUTS[card.pde], card.spec.grid
        self.groups = isinstance(reader, GroupReader)
        coords = reader.coordinates()
        if "t" in coords and len(coords["t"]) >= 2 and len(coords["t"]) < frames:  # extrapolated at the same dt
            t, dt = coords["t"], coords["t"][1] - coords["t"][0]
            coords["t"] = [*t, *(t[-1] + dt * (i + 1) for i in range(frames - len(t)))]
        if "t" in coords:
            coords["t"] = coords["t"][:frames]
        self.coords = coords
        if self.groups:
            return
        for axis, values in coords.items():
            f.create_dataset(COORDINATES[axis], data=np.asarray(values, np.float32))
        fields = set(layout.inputs + layout.targets)
        for key, item in reader.file.items():  # anything else the input holds (a steady file's t-coordinate)
            if key not in fields and key not in f and isinstance(item, h5py.Dataset):
                reader.file.copy(item, f, name=key)
        if layout.autoregressive:
            for key in layout.targets:
                f.create_dataset(key, (n, frames, *grid), np.float32)
        else:
            f.create_dataset(layout.inputs[0], (n, *grid), np.float32)
            f.create_dataset(layout.targets[0], (n, 1, *grid), np.float32)

    def write(self, samples: range, inputs: np.ndarray, outputs: np.ndarray) -> None:
        layout, where = LAYOUTS[self.card.pde], slice(samples.start, samples.stop)
        if self.groups:
            names = self.reader.group_names[samples.start : samples.stop]
            for name, traj in zip(names, outputs, strict=True):
                group = self.f.create_group(name)
                group.create_dataset("data", data=traj)
                for axis, values in self.coords.items():
                    group.create_dataset(f"grid/{axis}", data=np.asarray(values, np.float32))
        elif layout.autoregressive:
            for i, key in enumerate(layout.targets):
                self.f[key][where] = outputs[..., i]
        else:
            self.f[layout.inputs[0]][where] = inputs[..., 0]
            self.f[layout.targets[0]][where] = outputs[:, None, ..., 0]


def predict_file(
    source: str | Path,
    input_path: Path,
    output: Path,
    steps: int | None = None,
    checkpoint: str = "best",
    task: str | None = None,
    device: str = "cpu",
    batch_size: int = 64,
    factory: str | None = None,
) -> dict | None:
    """Predict ``input_path`` with the model of ``source`` into ``output``; returns the scores (or None when the
    input holds no true frames for the predicted ones) and writes them beside the output as JSON."""
    input_path, output = Path(input_path), Path(output)
    _check_arguments(input_path, output, steps, batch_size)
    model = Surrogate.load(source, checkpoint=checkpoint, device=device, factory=factory)
    card, reader = choose_task(model, input_path, task)
    k, n = card.spec.initial_step, reader.n_samples
    steps, truth, frames = _horizon(card, reader, steps, input_path)
    made = {"checkpoint": str(model.checkpoint), "task": card.name, "steps": steps or 0, "input": str(input_path)}
    write_back = format_of(card.pde).write_back
    with contextlib.ExitStack() as stack:
        if write_back is None:  # PDEBench's HDF5 layouts, written block by block
            f = stack.enter_context(h5py.File(stack.enter_context(atomic_path(output)), "w"))
            writer = _Writer(f, card, reader, n, frames)
            f.attrs["predicted_by"] = json.dumps(made)
        else:
            writer = _Collected(write_back, reader)
        sums = None
        with tqdm(total=n, desc=f"predict {card.name}", unit="sample", disable=None) as bar:
            for samples, parts in _blocks(reader, n):
                if card.spec.autoregressive:
                    traj = parts[""]
                    pred = model.rollout(card.name, traj[:, :k], steps, batch_size)
                    out = np.concatenate([traj[:, :k, ..., : card.spec.out_channels], pred], axis=1)
                    true, guess, inputs = traj[:, k : k + truth], pred[:, :truth], traj
                else:
                    inputs, pred = parts["x"], model.predict(card.name, parts["x"], batch_size)
                    out, true, guess = pred, parts["y"][:, None], pred[:, None]
                writer.write(samples, inputs, out)
                if truth:
                    batch = error_sums(torch.from_numpy(guess), torch.from_numpy(true[..., : guess.shape[-1]]))
                    sums = batch if sums is None else sums + batch
                bar.update(len(samples))
        if write_back is not None:
            writer.finish(output)
    reader.close()
    scores = None
    if sums is not None:
        scores = {**finish(sums), "nrmse_by_step": nrmse_by_step(sums), "n_samples": n, "frames_scored": truth}
        write_json_atomic(scores_path(output), {card.name: scores})
    return scores


def _check_arguments(input_path: Path, output: Path, steps: int | None, batch_size: int) -> None:
    """The command's own arguments, and the output's place, checked before the model is loaded."""
    if input_path.resolve() == output.resolve():
        raise ConfigError(f"--output {output} is the input file; write the predictions to another file")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"--steps {steps}: give the number of frames to predict, 1 or more")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: give the trajectories per forward pass, 1 or more")
    check_output(output, "--output", folder=False)  # before the model runs, not after every prediction


def _horizon(card, reader, steps: int | None, input_path: Path) -> tuple[int | None, int, int]:
    """(frames to predict, of them those the input holds the truth of, frames written): a rollout to the
    input's end by default, or ``steps`` frames; a steady task predicts one field."""
    k = card.spec.initial_step
    if not card.spec.autoregressive:
        if steps is not None:
            raise ConfigError(f"--steps: task {card.name} is steady (no time axis); leave --steps out")
        return None, 1, 1
    steps = reader.n_frames - k if steps is None else steps
    if steps < 1:
        raise ConfigError(
            f"{input_path} holds only the {k} initial frame(s) of each trajectory: give --steps N, the frames "
            "to predict"
        )
    return steps, min(steps, reader.n_frames - k), k + steps


def scores_path(output: Path) -> Path:
    """Where predict writes the scores of ``output``: beside it, ``<name>.scores.json``."""
    return output.with_name(output.name + ".scores.json")
