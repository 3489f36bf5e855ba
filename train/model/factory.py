"""The model seam: the one place a model is made from the tasks' specs and ``model.*`` of the config.

``model.name`` is a built-in architecture (transformer, fno, unet) or a factory of the user's, named
'package.module:function' or 'path/to/file.py:function' and called as ``factory(specs, **model.args)``.
Whatever it returns must map a dict of per-task inputs (normalised, channels last: autoregressive
``(batch, initial_step, *grid, channels)``, steady ``(batch, *grid, channels)``) to a dict of per-task
predictions ``(batch, *grid, out_channels)``; :func:`check_outputs` holds a model to that before training.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from train.config import ModelConfig
from train.errors import ConfigError
from train.hashing import file_digest
from train.model.builtin import MODELS, build_builtin
from train.model.specs import TaskSpec

Factory = Callable[..., nn.Module]


def _import_file(path: Path, key: str) -> object:
    if not path.is_file():
        raise ConfigError(f"{key}: no such file '{path}'; give the path of a .py file, e.g. examples/my_model.py:build")
    # A name of its own per file, so two files of the same name never replace each other in sys.modules.
    name = f"train_user_model_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"{key}: importing '{path}' failed ({type(e).__name__}: {e})") from None
    return module


def resolve_factory(name: str, key: str = "model.name") -> Factory:
    """The callable ``name`` points to ('package.module:function' or 'path/to/file.py:function')."""
    where, _, function = name.rpartition(":")
    if not where or not function:
        raise ConfigError(f"{key}={name!r}: write 'package.module:function' or 'path/to/file.py:function'")
    if where.endswith(".py"):
        module = _import_file(Path(where), key)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(
                f"{key}={name!r}: module '{where}' cannot be imported ({e}); check the name, or give a file path "
                "(path/to/file.py:function)"
            ) from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ConfigError(f"{key}={name!r}: '{where}' has no function '{function}'")
    return factory


def factory_source(name: str) -> dict[str, str] | None:
    """The file that defines a user factory and its SHA-256 (None for a built-in model, or a module without a
    file): recorded in each checkpoint, so that resuming with an edited model is a choice, not an accident."""
    where = name.rpartition(":")[0]
    if name in MODELS or not where:
        return None
    if where.endswith(".py"):
        path = Path(where)
    else:
        spec = importlib.util.find_spec(where)
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            return None
        path = Path(spec.origin)
    return {"file": str(path), "sha256": file_digest(path, "sha256")["sha256"]}


def forward_failed(model_name: str, error: Exception, shapes: Mapping[str, tuple[int, ...]]) -> ConfigError:
    """A user model whose forward raises on a probe batch: its own problem, named before any step."""
    where = ", ".join(f"{name} {tuple(shape)}" for name, shape in shapes.items())
    return ConfigError(
        f"model.name={model_name}: the model's forward raised {type(error).__name__}: {str(error)[:800]} on a probe "
        f"batch of real inputs ({where}; channels last); fix the model's forward"
    )


def build_model(specs: Mapping[str, TaskSpec], cfg: ModelConfig) -> nn.Module:
    """A freshly initialised model for these tasks (initialised from torch's default generator)."""
    if cfg.name in MODELS:
        return build_builtin(specs, cfg)
    factory = resolve_factory(cfg.name)
    try:
        model = factory(dict(specs), **cfg.args)
    except Exception as e:
        raise ConfigError(
            f"model.name={cfg.name}: the factory raised {type(e).__name__}: {e} (called with the tasks' specs and "
            f"model.args={cfg.args})"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name={cfg.name}: the factory returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def expected_shape(spec: TaskSpec, batch: int) -> tuple[int, ...]:
    return (batch, *spec.grid, spec.out_channels)


def check_outputs(
    outputs: object, inputs: Mapping[str, torch.Tensor], specs: Mapping[str, TaskSpec], model_name: str
) -> None:
    """The model's outputs for ``inputs`` hold every task's prediction in the contract's shape."""
    if not isinstance(outputs, Mapping):
        raise ConfigError(
            f"model.name={model_name}: forward returned a {type(outputs).__name__}; it must return a dict of "
            "predictions by task name"
        )
    for name, x in inputs.items():
        want = expected_shape(specs[name], x.shape[0])
        if name not in outputs:
            raise ConfigError(
                f"model.name={model_name}: forward returned no prediction for task '{name}' (it returned "
                f"{', '.join(map(str, outputs)) or 'none'}); expected a tensor of shape {want}"
            )
        got = tuple(outputs[name].shape)
        if got != want:
            raise ConfigError(
                f"model.name={model_name}: task '{name}' prediction has shape {got}, expected {want} "
                "(batch, *grid, out_channels)"
            )
        if not bool(torch.isfinite(outputs[name]).all()):
            raise ConfigError(
                f"model.name={model_name}: the model's output for task '{name}' is not finite (NaN or inf) on a "
                "probe batch of real inputs, before any training step: no learning rate can fix that. Check its "
                "initialisation and forward (a division by zero, a log of a negative, an uninitialised buffer)"
            )
