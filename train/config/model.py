"""The ``model`` section: the architecture by name, and each built-in model's own settings."""

from __future__ import annotations

import difflib
import logging
from typing import Any, ClassVar, Literal

import pydantic
from pydantic import Field

from train.config.section import Section

_log = logging.getLogger(__name__)


class FNOConfig(Section):
    """A Fourier neural operator per task, after PDEBench's FNO1d/FNO2d."""

    modes: int = Field(12, ge=1)
    """Fourier modes kept along each spatial axis (capped at what the grid holds)."""
    width: int = Field(20, ge=1)
    """Channels of the spectral layers (PDEBench's 20)."""
    layers: int = Field(4, ge=1)
    """Spectral layers (each a spectral convolution plus a pointwise one)."""
    padding: int | None = Field(None, ge=0)
    """Zero padding appended to each spatial axis before the spectral layers, for non-periodic domains; None:
    PDEBench's choice, none on 1D grids and 2 points on 2D grids. Axes the data marks periodic (a Well task's
    boundary conditions) are never padded: the spectral layers wrap them."""
    residual: bool = False
    """Predict the change from the last input frame instead of the next frame itself (The Well's delta
    prediction); time-dependent tasks only."""


class UNetConfig(Section):
    """A U-Net per task, after PDEBench's UNet1d/UNet2d."""

    init_features: int = Field(32, ge=1)
    """Channels of the first level; each of the four levels down doubles them."""
    residual: bool = False
    """Predict the change from the last input frame instead of the next frame itself (The Well's delta
    prediction); time-dependent tasks only."""


Activation = Literal["gelu", "relu", "silu", "tanh"]
"""The nonlinearities a convolutional model may take."""


class _Convolutional(Section):
    """Settings of a local convolutional model (model.<section>): the kernel must be odd."""

    section: ClassVar[str]

    @pydantic.field_validator("kernel", check_fields=False)
    @classmethod
    def _odd_kernel(cls, kernel: int) -> int:
        if kernel % 2 == 0:
            raise ValueError(f"must be odd (a kernel centred on its point, as 3, 5 or 7), not {kernel}")
        return kernel


class ConvConfig(_Convolutional):
    """A plain convolutional emulator per task: convolutions of one width, no normalisation."""

    section = "conv"

    width: int = Field(64, ge=1)
    """Channels of every hidden convolution."""
    depth: int = Field(4, ge=1)
    """Hidden convolutions, each followed by the activation; a pointwise convolution then gives the output."""
    kernel: int = Field(5, ge=1)
    """Points of each hidden convolution along every axis; odd, so that the output is centred on its point."""
    activation: Activation = "gelu"
    """The nonlinearity after each hidden convolution: gelu, relu, silu or tanh."""
    residual: bool = False
    """Predict the change from the last input frame instead of the next frame itself (The Well's delta
    prediction); time-dependent tasks only."""


class ResNetConfig(_Convolutional):
    """A ResNet per task: a pointwise lifting, residual blocks of two convolutions, a pointwise projection."""

    section = "resnet"

    width: int = Field(48, ge=1)
    """Channels of the residual blocks."""
    blocks: int = Field(4, ge=1)
    """Residual blocks, each two convolutions with the activation after the first and after the sum."""
    kernel: int = Field(3, ge=1)
    """Points of each block's convolutions along every axis; odd, so that the output is centred on its point."""
    activation: Activation = "gelu"
    """The nonlinearity of the blocks: gelu, relu, silu or tanh."""
    norm: Literal["none", "group"] = "none"
    """Normalisation after each block convolution: 'none', or 'group', a group norm of one group (over the
    channels and the grid of each sample, as PDEArena's ResNets)."""
    residual: bool = False
    """Predict the change from the last input frame instead of the next frame itself (The Well's delta
    prediction); time-dependent tasks only."""


class _Attention(Section):
    """Settings of a model of attention heads over d_model channels (model.<section>)."""

    section: ClassVar[str]

    @pydantic.model_validator(mode="after")
    def _check_heads(self) -> _Attention:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.{self.section}.d_model ({self.d_model}) must be a multiple of model.{self.section}.n_heads "
                f"({self.n_heads})"
            )
        return self


class MultiphysicsConfig(_Attention):
    """The multi-physics model: patch tokens of any dimension, a field vocabulary, per-sample normalisation."""

    section = "multiphysics"

    d_model: int = Field(128, ge=8)
    """Width of the tokens and of the shared processor."""
    n_heads: int = Field(4, ge=1)
    """Attention heads; must divide d_model."""
    n_layers: int = Field(4, ge=1)
    """Processor blocks, each attention over space, attention over time (inputs of several frames) and an MLP."""
    mlp_ratio: int = Field(4, ge=1)
    """Hidden width of each block's MLP, as a multiple of d_model."""
    field_width: int = Field(32, ge=1)
    """Width of a field's row in the vocabulary: each grid point's fields are embedded into this many features
    before patching, and decoded from as many."""
    max_frames: int = Field(16, ge=1)
    """Most input frames a task may give (its initial_step): the rows of the learned frame embedding."""
    std_floor: float = Field(1e-2, gt=0)
    """Floor on a sample's per-channel standard deviation when normalising it (in the cache's units, where a
    dataset's channel has std 1): a near-constant field is not blown up into noise."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout in the attention and MLP outputs."""
    output: Literal["state", "increment"] = "state"
    """What a time-dependent task's decoder predicts: 'state', the next frame in the sample's normalised units
    (mean and std over the input window); 'increment', the change from the latest frame in units of the window's
    own frame-to-frame change, so that a field constant over its input stays constant (tasks of one input frame
    have no change to measure and predict as with 'state')."""
    steady_rows: bool = False
    """Steady tasks' outputs decoded by rows of their own (``field_out_steady``), not the rows that also predict
    the next frame of the field of that name: 'pressure' as a Darcy solution and as a flow's evolving field are
    not one quantity."""


class TransformerConfig(_Attention):
    """The multi-task transformer: per-task patch encoders and decoders around one shared processor."""

    section = "transformer"

    d_model: int = Field(96, ge=8)
    """Width of the shared transformer processor."""
    n_heads: int = Field(4, ge=1)
    """Attention heads; must divide d_model."""
    n_layers: int = Field(4, ge=1)
    """Transformer blocks in the shared processor."""
    mlp_ratio: int = Field(4, ge=1)
    """Hidden width of each block's MLP, as a multiple of d_model."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout inside the transformer blocks."""


BUILT_IN_MODELS = ("transformer", "fno", "unet", "multiphysics", "conv", "resnet")
"""The built-in architectures; each reads its settings from model.<its name> (train.model.builtin's table)."""
LEGACY_TRANSFORMER_KEYS = tuple(TransformerConfig.model_fields)
"""Keys the transformer read directly under ``model`` before it had a section of its own: still accepted there
(moved into model.transformer with a note), so older configs, overrides and checkpoints keep working."""


def model_keys_in_use(name: str) -> tuple[str, ...]:
    """The keys under ``model`` that model.name=``name`` is built from."""
    return ("name", name if name in BUILT_IN_MODELS else "args")


def migrate_model_keys(model: Any, origin: str = "model") -> Any:
    """``model`` (a config's model section as data) with the transformer's old top-level keys moved into
    ``model.transformer``; the same value given both ways is one setting, two different ones an error."""
    if not isinstance(model, dict) or not set(model) & set(LEGACY_TRANSFORMER_KEYS):
        return model
    model = dict(model)
    section = dict(model.get("transformer") or {})
    for key in LEGACY_TRANSFORMER_KEYS:
        if key not in model:
            continue
        value = model.pop(key)
        if key in section and section[key] != value:
            raise ValueError(
                f"{origin}.{key}={value!r} and {origin}.transformer.{key}={section[key]!r} disagree; "
                f"{origin}.{key} is the older name of {origin}.transformer.{key}: keep one"
            )
        section[key] = value
    model["transformer"] = section
    return model


class ModelConfig(Section):
    name: str = "transformer"
    """The architecture: a built-in one (transformer, fno, unet, multiphysics, conv, resnet:
    train/model/builtin.py's MODELS), or your own factory as 'package.module:function' or
    'path/to/file.py:function', called as factory(specs, **model.args) (see docs/models.md)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of your own factory (built-in models take their settings from their own section)."""
    transformer: TransformerConfig = TransformerConfig()
    """Settings of model.name=transformer. The keys used to sit directly under model (model.d_model, ...): they
    are still accepted there and moved here, with a note."""
    fno: FNOConfig = FNOConfig()
    """Settings of model.name=fno."""
    unet: UNetConfig = UNetConfig()
    """Settings of model.name=unet."""
    multiphysics: MultiphysicsConfig = MultiphysicsConfig()
    """Settings of model.name=multiphysics."""
    conv: ConvConfig = ConvConfig()
    """Settings of model.name=conv."""
    resnet: ResNetConfig = ResNetConfig()
    """Settings of model.name=resnet."""
    shard_units: list[str] = []
    """With dist.parallel=fsdp or hsdp: the submodules sharded as one unit each (gathered for their forward,
    freed after), as module-name patterns ('blocks.*', 'encoder'). Default: a built-in model's own blocks (the
    model table), and for a model of your own each direct child that holds parameters. The rest of the model
    is sharded as the root unit."""

    @pydantic.field_validator("name")
    @classmethod
    def _known_name(cls, name: str) -> str:
        if name not in BUILT_IN_MODELS and ":" not in name:
            close = difflib.get_close_matches(name.lower(), BUILT_IN_MODELS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"{name!r} is neither a built-in model ({', '.join(BUILT_IN_MODELS)}) nor a factory "
                f"'package.module:function' or 'path/to/file.py:function'{hint}"
            )
        return name

    @pydantic.model_validator(mode="before")
    @classmethod
    def _move_legacy_keys(cls, data: Any) -> Any:
        moved = migrate_model_keys(data)
        if moved is not data:
            old = sorted(set(data) & set(LEGACY_TRANSFORMER_KEYS))
            _log.info(
                "config: %s now live under model.transformer (%s); read from there",
                ", ".join(f"model.{k}" for k in old),
                ", ".join(f"model.transformer.{k}" for k in old),
            )
        return moved
