"""The built-in models, one table, as ``train.pdes`` is for PDE families: each architecture's settings section
(``model.<name>``), its builder and what it is.

The factory builds from it, and every count of parameters (the doctor's disk estimate, the models table in
docs/models.md) comes from :func:`parameter_count`, which builds the model on the ``meta`` device: exact, and
without allocating a byte. Adding a built-in model touches this table, its own module and its settings class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from train.config import (
    BUILT_IN_MODELS,
    ConvConfig,
    FNOConfig,
    ModelConfig,
    MultiphysicsConfig,
    ResNetConfig,
    Section,
    TransformerConfig,
    UNetConfig,
)
from train.model import conv, multiphysics, multitask
from train.model.fno import FNO
from train.model.specs import TaskSpec
from train.model.unet import UNet


class PerTask(nn.Module):
    """One network per task (the built-in FNO, U-Net, conv and ResNet share nothing between tasks)."""

    def __init__(self, networks: dict[str, nn.Module]):
        super().__init__()
        self.networks = nn.ModuleDict(networks)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.networks[name](x) for name, x in inputs.items()}


def _per_task(network: Callable[[TaskSpec, Section], nn.Module]) -> Callable[[dict[str, TaskSpec], Section], nn.Module]:
    return lambda specs, settings: PerTask({name: network(spec, settings) for name, spec in specs.items()})


@dataclass(frozen=True)
class BuiltIn:
    """One built-in architecture."""

    settings: type[Section]
    """Its settings class, read from ``model.<name>``."""
    build: Callable[[dict[str, TaskSpec], Section], nn.Module]
    """``build(specs, settings)``: the model of these tasks, freshly initialised from torch's default generator."""
    summary: str
    """What it is, in a line."""
    shard_units: tuple[str, ...] = ()
    """Module-name patterns of its blocks, each sharded as one unit under dist.parallel=fsdp/hsdp."""
    check: Callable[[dict[str, TaskSpec], Section], list[str]] = lambda specs, settings: []
    """``check(specs, settings)``: what makes a task unusable with it (a patch that does not tile the grid), each
    phrased as a config fix; checked once the data's shapes are known."""


MODELS: dict[str, BuiltIn] = {
    "transformer": BuiltIn(
        TransformerConfig,
        lambda specs, settings: multitask.MultiTaskSurrogate(specs, settings),
        "per-task patch encoders and decoders around one shared transformer processor",
        ("codecs.*", "processor.layers.*"),
        lambda specs, settings: multitask.check_specs(specs),
    ),
    "fno": BuiltIn(
        FNOConfig, _per_task(FNO), "a Fourier neural operator per task, after PDEBench's FNO1d/2d/3d", ("networks.*",)
    ),
    "unet": BuiltIn(UNetConfig, _per_task(UNet), "a U-Net per task, after PDEBench's UNet1d/2d/3d", ("networks.*",)),
    "multiphysics": BuiltIn(
        MultiphysicsConfig,
        multiphysics.MultiPhysicsSurrogate,
        "one model for 1D/2D/3D datasets: patch tokens of any dimension, a field vocabulary shared by name, "
        "per-sample normalisation, attention over space and time",
        ("blocks.*",),
        multiphysics.check_specs,
    ),
    "conv": BuiltIn(
        ConvConfig,
        _per_task(conv.ConvNet),
        "a plain convolutional emulator per task: convolutions of one width and kernel, no normalisation",
        ("networks.*",),
        conv.check_specs("conv"),
    ),
    "resnet": BuiltIn(
        ResNetConfig,
        _per_task(conv.ResNet),
        "a ResNet per task: pointwise lifting, residual blocks of two convolutions, pointwise projection",
        ("networks.*",),
        conv.check_specs("resnet"),
    ),
}
assert tuple(MODELS) == BUILT_IN_MODELS, "the config validates model.name against these names"


def settings_of(cfg: ModelConfig) -> Section:
    """The settings section of a built-in ``cfg.name``."""
    return getattr(cfg, cfg.name)


def check_builtin(specs: Mapping[str, TaskSpec], cfg: ModelConfig) -> list[str]:
    """What makes these tasks unusable with the built-in model ``cfg`` (nothing for a model of the user's)."""
    return MODELS[cfg.name].check(dict(specs), settings_of(cfg)) if cfg.name in MODELS else []


def build_builtin(specs: Mapping[str, TaskSpec], cfg: ModelConfig) -> nn.Module:
    return MODELS[cfg.name].build(dict(specs), settings_of(cfg))


def parameter_count(specs: Mapping[str, TaskSpec], cfg: ModelConfig) -> int:
    """The parameters of the built-in model ``cfg`` for ``specs``, counted on the meta device (nothing allocated,
    no initialiser runs on real memory). The launcher's doctor counts them before every launch: arithmetic on a
    meta tensor (``0.02 * randn``) runs PyTorch's Python meta kernels, which import dynamo, inductor and sympy,
    3 CPU seconds of a launch. The built-in models draw their initial weights without it, and compute fixed
    buffers on the CPU (tests/unit/test_preflight.py holds them to that)."""
    with torch.device("meta"):
        model = build_builtin(specs, cfg)
    return sum(p.numel() for p in model.parameters())
