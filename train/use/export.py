"""``python -m train export``: a trained model as files that run without this package, one per task.

Each file maps one step in physical units, the normalisation built in: ``inputs`` of shape (batch,
initial_step, *grid, in_channels) (a steady task: (batch, *grid, in_channels)) to ``prediction`` (batch,
*grid, out_channels); the batch size is free, the grid and channels are the training data's. A rollout feeds
each prediction back as the newest input frame (a Well task's constant channels carried over). Per task,
because the tasks of a run share weights (the transformer) but not shapes.

- ``onnx``: ``torch.onnx.export`` (the dynamo exporter), opset 18. The FNO's spectral layers compute in real
  arithmetic (truncated DFTs, train.model.fno): ONNX has no complex tensors, and none is needed.
- ``torchscript``: ``torch.jit.trace``, the same graph, for ``torch.jit.load`` without this package.

Every file is checked before it gets its name: the graph that was captured is run on a batch of another size
than the one it was traced with and must match the PyTorch model to 1e-4 (relative to the prediction's
scale). A model that does not export, or exports wrong, is refused with the reason, and no file is left.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from train.atomic import atomic_path, write_json_atomic
from train.checkpoint import USE_ADVICE, load_checkpoint, sealed, state_bytes
from train.errors import ConfigError, TrainError
from train.use.outputs import check_output
from train.use.surrogate import Surrogate, TaskCard

log = logging.getLogger(__name__)

FORMATS = {"onnx": ".onnx", "torchscript": ".pt"}
TOLERANCE = 1e-4
"""Largest difference allowed between the exported graph and the PyTorch model, relative to the prediction's
largest magnitude."""


class ExportError(TrainError):
    """The model cannot be exported faithfully in this format; nothing was written."""

    exit_code = 2


class OneStep(nn.Module):
    """One task's step in physical units: normalise, predict, denormalise."""

    def __init__(self, model: nn.Module, card: TaskCard):
        super().__init__()
        self.model, self.name = model, card.name
        self.register_buffer("in_mean", torch.from_numpy(card.input_mean))
        self.register_buffer("in_std", torch.from_numpy(card.input_std))
        self.register_buffer("out_mean", torch.from_numpy(card.target_mean))
        self.register_buffer("out_std", torch.from_numpy(card.target_std))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = (inputs - self.in_mean) / self.in_std
        return self.model({self.name: x})[self.name] * self.out_std + self.out_mean


def exportable(surrogate: Surrogate, card: TaskCard) -> tuple[OneStep, OneStep]:
    """The task's step as a float32 CPU module to export, and the model's own step it must equal."""
    reference = OneStep(copy.deepcopy(surrogate.model).float().cpu().eval(), card).eval()
    return OneStep(copy.deepcopy(reference.model), card).eval(), reference


@contextlib.contextmanager
def _plain_attention() -> Iterator[None]:
    """Without nn.MultiheadAttention's fused inference kernel, which exporters do not take."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@contextlib.contextmanager
def _quiet_exporters() -> Iterator[None]:
    """The ONNX exporter's progress lines (one per graph rewrite) at warning level only."""
    loggers = [logging.getLogger(name) for name in ("onnxscript", "onnx_ir", "torch.onnx", "torch.export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _example(card: TaskCard, batch: int, seed: int) -> torch.Tensor:
    """A batch of inputs around the data's scale (mean plus a standard deviation's noise per channel)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(card.input_shape(batch), generator=g)
    return x * torch.from_numpy(card.input_std) + torch.from_numpy(card.input_mean)


def _check(card: TaskCard, reference: nn.Module, run, fmt: str) -> float:
    """The exported graph against the PyTorch model on a batch of a size it was not traced with."""
    x = _example(card, 3, seed=1)
    with torch.no_grad():
        want = reference(x)
    got = torch.as_tensor(run(x))
    if got.shape != want.shape:
        raise ExportError(
            f"task {card.name}: the {fmt} graph returns shape {tuple(got.shape)}, the model "
            f"{tuple(want.shape)}: its batch axis is not free"
        )
    error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    if not error <= TOLERANCE:
        raise ExportError(
            f"task {card.name}: the {fmt} graph differs from the PyTorch model by {error:.3g} of the prediction's "
            f"scale (allowed {TOLERANCE:g}); nothing was written"
        )
    return error


def _onnxruntime(path: Path):
    """The file under onnxruntime, where it is installed (a check beside the captured graph's)."""
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: session.run(["prediction"], {"inputs": x.numpy()})[0]


def _onnx(step: OneStep, reference: OneStep, card: TaskCard, path: Path) -> float:
    try:
        import onnx  # noqa: F401 - the exporter needs it (and onnxscript)
    except ImportError:
        raise ExportError("--format onnx needs the onnx and onnxscript packages: pip install 'train[export]'") from None
    batch = torch.export.Dim("batch", min=1)
    with _plain_attention(), contextlib.redirect_stdout(None):
        try:
            program = torch.onnx.export(
                step,
                (_example(card, 2, seed=0),),
                dynamo=True,
                input_names=["inputs"],
                output_names=["prediction"],
                dynamic_shapes=({0: batch},),
                opset_version=18,
                verbose=False,
            )
        except Exception as e:
            raise ExportError(f"task {card.name}: ONNX export failed ({type(e).__name__}: {str(e)[:600]})") from None
    error = _check(card, reference, program.exported_program.module(), "onnx")
    program.save(str(path))
    runtime = _onnxruntime(path)
    return max(error, _check(card, reference, runtime, "onnx")) if runtime is not None else error


def _torchscript(step: OneStep, reference: OneStep, card: TaskCard, path: Path) -> float:
    with _plain_attention(), torch.no_grad():
        try:
            traced = torch.jit.trace(step, (_example(card, 2, seed=0),), check_trace=False)
        except Exception as e:
            raise ExportError(f"task {card.name}: tracing failed ({type(e).__name__}: {str(e)[:600]})") from None
    error = _check(card, reference, traced, "torchscript")
    torch.jit.save(traced, str(path))
    return error


WRITERS = {"onnx": _onnx, "torchscript": _torchscript}


def export_task(surrogate: Surrogate, card: TaskCard, fmt: str, path: Path) -> Path:
    """One task's step as ``path`` (written whole under a temporary name, then renamed), with a JSON sidecar
    ``<path>.json`` that says what goes in and comes out."""
    if fmt not in WRITERS:
        raise ConfigError(f"--format {fmt}: choose one of {', '.join(WRITERS)}")
    step, reference = exportable(surrogate, card)
    with atomic_path(path) as tmp, _quiet_exporters():
        error = WRITERS[fmt](step, reference, card, tmp)
    write_json_atomic(
        path.with_name(path.name + ".json"),
        {
            "task": card.name,
            "pde": card.pde,
            "format": fmt,
            "inputs": {"name": "inputs", "shape": list(card.input_shape("batch")), "units": "physical"},
            "prediction": {"name": "prediction", "shape": ["batch", *card.spec.grid, card.spec.out_channels]},
            "channels": list(card.channels),
            "initial_step": card.spec.initial_step if card.spec.autoregressive else None,
            "checkpoint": str(surrogate.checkpoint),
            "max_relative_difference": error,
        },
    )
    log.info("exported task %s as %s (%.2g of the prediction's scale from PyTorch)", card.name, path, error)
    return path


def export_run(
    source: str | Path,
    fmt: str,
    output: str | Path | None = None,
    checkpoint: str = "best",
    task: str | None = None,
    factory: str | None = None,
    accept_changed_source: bool = False,
) -> list[Path]:
    """Every task of the run (or ``task``) as ``<output or runs/<name>/export>/<task><ext>``; ``output`` ending
    in the format's extension (and not a folder already) names the file of a single task. ``factory``: where a
    model of your own lives now, when it moved since training; one whose file changed since is refused unless
    ``accept_changed_source``."""
    ext = FORMATS.get(fmt)
    if ext is None:
        raise ConfigError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    # An output ending in the format's suffix names one task's file, unless it is a folder already (x.onnx/).
    one_file = output is not None and str(output).endswith(ext) and not Path(output).is_dir()
    if output is not None:  # checked before the model is loaded and traced
        check_output(Path(output), "--output", folder=not one_file)
    changed = "warn" if accept_changed_source else "refuse"
    surrogate = Surrogate.load(source, checkpoint=checkpoint, factory=factory, changed_source=changed)
    cards = [surrogate.task(task)] if task is not None else list(surrogate.tasks.values())
    if one_file:
        if len(cards) > 1:
            names = ", ".join(c.name for c in cards)
            raise ConfigError(
                f"--output {output} names one file, but the run has tasks {names}: give --task, or a folder"
            )
        return [export_task(surrogate, cards[0], fmt, Path(output))]
    folder = Path(output) if output is not None else _run_folder(surrogate.checkpoint) / "export"
    return [export_task(surrogate, card, fmt, folder / f"{card.name}{ext}") for card in cards]


def _run_folder(checkpoint: Path) -> Path:
    """runs/<name> of a checkpoint in runs/<name>/checkpoints/, else the checkpoint's own folder."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def consolidate(path: Path, output: Path | None = None) -> Path:
    """Write the sharded checkpoint ``path`` as one .pt file (default: ``<its folder>/consolidated/<name>.pt``,
    outside the checkpoint patterns), atomically and sealed with its checksum as every file checkpoint is."""
    state = load_checkpoint(path, advice=USE_ADVICE)  # checked against its manifest first
    output = output or path.parent / "consolidated" / f"{path.stem}.pt"
    with atomic_path(output, needed=state_bytes(state)) as tmp:
        torch.save(sealed(state), tmp)
    return output
