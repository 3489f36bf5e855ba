"""One surrogate for many physics: 1D, 2D and 3D datasets of any fields through one shared processor.

The four mechanisms of multi-physics pretraining (as in MPP, DPOT, Poseidon, Walrus), in one model:

- **per-sample normalisation**, reversed on the output: each sample's channels are normalised by their own mean
  and standard deviation over the input window (the std floored, ``std_floor``), so datasets of any scale meet
  the processor at one scale; a time-dependent task's prediction is a step in those units, turned back into the
  cache's units with the statistics of the channel it predicts. The statistics themselves enter the embedding.
- **a field vocabulary**: one row of weights per physical field name (``TaskSpec.fields``), in two tables:
  ``field_in`` embeds a grid point's value of the field (with the sample's mean and log-std of it), ``field_out``
  decodes the field from the grid point's features. The embeddings of a point's fields are summed, so a dataset of
  any fields becomes ``field_width`` features per point. Rows are looked up by name: a new dataset reuses the
  rows of the fields it shares with the pretraining mix, and gets new rows for the others (fine-tuning maps the
  rows by name: :func:`adapt_state`).
- **patch tokens of any dimension**: a grid's points are grouped into patches (``TaskSpec.patch_size`` per axis)
  and each patch's features projected to ``d_model`` by a projection of that patch geometry (``1d_p8``,
  ``3d_p4``...), with fixed sinusoidal positions of the patch centres (resolution-free) and a learned
  embedding per input frame (counted back from the latest) and per dimension.
- **one processor**: blocks of attention over space (the tokens of one frame), over time (one patch's frames,
  where the input has several) and an MLP, shared by every dataset; the latest frame's tokens are decoded.

Every parameter takes part in every forward, whatever the task: the field tables are indexed, which gives every
row a gradient, and a zero term ties in the projections and the time attention a task does not use. Ranks that
draw different datasets in one step need no unused-parameter search under DDP, and FSDP/HSDP reduce the same
gradients on every rank.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from train.config import MultiphysicsConfig
from train.model import multitask
from train.model.multitask import patchify, unpatchify
from train.model.specs import TaskSpec

POSITION_FREQUENCIES = 8
"""Most sinusoid frequencies per spatial axis in the position features (2 x 8 x dims of d_model's channels)."""


def field_names(name: str, spec: TaskSpec) -> tuple[str, ...]:
    """A task's field names: its spec's, or the task's own per channel where the spec names none."""
    count = spec.in_channels + (0 if spec.autoregressive else spec.out_channels)
    return spec.fields if len(spec.fields) == count else tuple(f"{name}/channel_{i}" for i in range(count))


def vocabulary(specs: dict[str, TaskSpec]) -> list[str]:
    """Every field name of these tasks, sorted: the rows of the field tables, in order."""
    return sorted({f for name, spec in specs.items() for f in field_names(name, spec)})


def geometry(spec: TaskSpec) -> str:
    """The key of a patch geometry's projections: dimension and patch size."""
    return f"{len(spec.grid)}d_p{spec.patch_size}"


def _positions(grid: tuple[int, ...], patch: int, width: int) -> torch.Tensor:
    """Fixed sinusoids of the patch centres (in [0, 1) per axis, row-major as patchify orders the tokens),
    zero-padded to ``width``: (tokens, width). As many frequencies per axis as fit (POSITION_FREQUENCIES at most).
    On the CPU whatever the default device: see train.model.builtin.parameter_count."""
    axes = [(torch.arange(n // patch, dtype=torch.float32, device="cpu") + 0.5) * patch / n for n in grid]
    centres = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(grid))
    count = max(1, min(POSITION_FREQUENCIES, width // (2 * len(grid))))
    k = torch.arange(1, count + 1, dtype=torch.float32, device="cpu") * (2 * math.pi)
    angles = (centres[..., None] * k).reshape(centres.shape[0], -1)
    features = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return F.pad(features, (0, width - features.shape[-1]))


def tie(module: nn.Module) -> torch.Tensor:
    """Zero, computed from one element of each of ``module``'s parameters: added to an output, it gives them a
    (zero) gradient in a step that does not use them, so every rank reduces the same gradients whichever task it
    drew (under FSDP, while the module's weights are gathered: inside its own unit's forward)."""
    return sum(p.reshape(-1)[0] for p in module.parameters()) * 0.0


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, width) -> the same, attention over the tokens added (pre-norm residual)."""
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return x + F.dropout(self.out(y.transpose(1, 2).reshape(b, n, w)), self.dropout, self.training)


class Block(nn.Module):
    """Attention over space, over time (when the input has several frames), then an MLP."""

    def __init__(self, cfg: MultiphysicsConfig):
        super().__init__()
        width, hidden = cfg.d_model, cfg.d_model * cfg.mlp_ratio
        self.space = Attention(width, cfg.n_heads, cfg.dropout)
        self.time = Attention(width, cfg.n_heads, cfg.dropout)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, frames, tokens, width) -> the same."""
        b, t, n, w = x.shape
        x = self.space(x.reshape(b * t, n, w)).reshape(b, t, n, w)
        if t > 1:
            x = self.time(x.transpose(1, 2).reshape(b * n, t, w)).reshape(b, n, t, w).transpose(1, 2)
        else:
            x = x + tie(self.time)
        return x + self.mlp(x)


class MultiPhysicsSurrogate(nn.Module):
    parameter_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "trunk": ("blocks.", "frame", "dimension"),
        "field_rows": ("field_in",),
        "patches": ("patch_in.",),
        "decoders": ("patch_out.", "field_out"),
    }
    """Named groups of parameters for fine-tuning's settings (train.lr_groups, freeze, init_reset): the shared
    processor and its frame and dimension embeddings, the field vocabulary's input rows, the patch projections in,
    and the decoders (the patch projections out and the output rows)."""
    zeroable: ClassVar[tuple[str, ...]] = ("field_out",)
    """What train.init_reset may set to zero: the output rows, which a fresh model starts at zero too. Zeroed with
    the projections before them, neither gets a gradient (each is the other's factor) and the model never moves
    from "repeat the last frame"."""

    def __init__(self, specs: dict[str, TaskSpec], cfg: MultiphysicsConfig):
        super().__init__()
        self.cfg = cfg
        self.specs = dict(specs)
        self.vocabulary = vocabulary(self.specs)
        """The field names, in the order of the rows of ``field_in`` and ``field_out``."""
        rows = {name: i for i, name in enumerate(self.vocabulary)}
        # Per task: which rows its input channels and (predicted) output channels use.
        for name, spec in self.specs.items():
            names = field_names(name, spec)
            outputs = names[: spec.out_channels] if spec.autoregressive else names[spec.in_channels :]
            self.register_buffer(f"rows_in_{name}", torch.tensor([rows[f] for f in names[: spec.in_channels]]), False)
            self.register_buffer(f"rows_out_{name}", torch.tensor([rows[f] for f in outputs]), False)
            # fixed, so computed once here rather than in every forward
            self.register_buffer(f"positions_{name}", _positions(spec.grid, spec.patch_size, cfg.d_model), False)
        width, e = cfg.d_model, cfg.field_width
        # A field's row: weights of its normalised value, a bias, weights of the sample's mean and log-std of it.
        # (the values of randn * 0.02, drawn without arithmetic: see train.model.builtin.parameter_count)
        self.field_in = nn.Parameter(torch.normal(0.0, 0.02, size=(len(self.vocabulary), 4, e)))
        self.field_out = nn.Parameter(torch.zeros(len(self.vocabulary), e + 1))
        if cfg.steady_rows:  # a steady task's outputs decoded by rows of their own
            self.field_out_steady = nn.Parameter(torch.zeros(len(self.vocabulary), e + 1))
        shapes = {geometry(s): (len(s.grid), s.patch_size) for s in self.specs.values()}
        self.patch_in = nn.ModuleDict({k: nn.Linear(p**d * e, width) for k, (d, p) in sorted(shapes.items())})
        self.patch_out = nn.ModuleDict(
            {k: nn.Sequential(nn.LayerNorm(width), nn.Linear(width, p**d * e)) for k, (d, p) in sorted(shapes.items())}
        )
        self.frame = nn.Parameter(torch.normal(0.0, 0.02, size=(cfg.max_frames, width)))
        self.dimension = nn.Parameter(torch.normal(0.0, 0.02, size=(3, width)))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))

    def _normalise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sample's channels over its frames and grid: (normalised, mean, std), the statistics shaped
        (batch, channels)."""
        dims = tuple(range(1, x.dim() - 1))
        mean = x.mean(dim=dims)
        std = (x.var(dim=dims, unbiased=False) + self.cfg.std_floor**2).sqrt()
        shape = (x.shape[0], *[1] * len(dims), x.shape[-1])
        return (x - mean.view(shape)) / std.view(shape), mean, std

    def _tokens(self, name: str, spec: TaskSpec, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Inputs (batch, frames, *grid, channels) -> tokens (batch, frames, patches, d_model), with the
        normalised inputs and their statistics."""
        xn, mean, std = self._normalise(x)
        rows = self.field_in[getattr(self, f"rows_in_{name}")]  # (channels, 4, e)
        per_point = xn[..., None] * rows[:, 0] + rows[:, 1]  # (b, t, *grid, c, e)
        stats = mean[:, :, None] * rows[:, 2] + std.log()[:, :, None] * rows[:, 3]  # (b, c, e)
        b, t = x.shape[:2]
        stats = stats.reshape(b, 1, *[1] * len(spec.grid), *stats.shape[1:])
        features = (per_point + stats).sum(dim=-2)  # (b, t, *grid, e)
        patches = patchify(features.reshape(b * t, *spec.grid, -1), spec.patch_size)
        tokens = self.patch_in[geometry(spec)](patches).reshape(b, t, patches.shape[1], -1)
        positions = getattr(self, f"positions_{name}").to(tokens.dtype)
        frames = self.frame[:t].flip(0)  # row 0 is the latest frame
        tokens = tokens + positions + frames[None, :, None] + self.dimension[len(spec.grid) - 1]
        return tokens, xn, mean, std

    def _fields(self, name: str, spec: TaskSpec, tokens: torch.Tensor, x: torch.Tensor, xn: torch.Tensor, mean, std):
        """The latest frame's tokens (batch, patches, d_model) -> the prediction (batch, *grid, out_channels); ``x``
        the input frames as given (a prediction of no change is the latest of them, exactly)."""
        features = unpatchify(self.patch_out[geometry(spec)](tokens), spec.grid, spec.patch_size)
        table = self.field_out_steady if self.cfg.steady_rows and not spec.autoregressive else self.field_out
        rows = table[getattr(self, f"rows_out_{name}")]  # (out, e + 1)
        out = features @ rows[:, :-1].T + rows[:, -1]
        if not spec.autoregressive:  # another quantity than the inputs: in the cache's units
            return out
        c = spec.out_channels
        shape = (xn.shape[0], *[1] * len(spec.grid), c)
        latest = x[:, -1, ..., :c]
        if self.cfg.output == "increment" and xn.shape[1] > 1:  # steps in units of the window's own steps
            return latest + out * step_scale(xn, std)[:, :c].view(shape)
        return latest + out * std[:, :c].view(shape)

    def adapt_initial_state(
        self, state: dict[str, torch.Tensor], source_specs: dict[str, TaskSpec]
    ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
        """Fine-tuning: a source checkpoint's weights (``state``, trained on ``source_specs``) made to fit this model.

        The field tables' rows are matched by name: a field the source knows keeps its trained row, a new one keeps
        the model's fresh row. The projections of a patch geometry the source never saw stay fresh; the source's
        projections of geometries this model has not are left out. Returns the state, the new field names and the
        parameter-name prefixes that start fresh."""
        theirs = vocabulary(source_specs)
        where = {name: i for i, name in enumerate(theirs)}
        ours = self.state_dict()
        state = dict(state)
        for key in ("field_in", "field_out"):
            if key in state and key in ours:
                rows = ours[key].detach().clone()
                for i, name in enumerate(self.vocabulary):
                    if name in where:
                        rows[i] = state[key][where[name]].to(rows.dtype)
                state[key] = rows
        shapes_here = {geometry(s) for s in self.specs.values()}
        shapes_there = {geometry(s) for s in source_specs.values()}
        for key in list(state):
            parts = key.split(".")
            if parts[0] in ("patch_in", "patch_out") and parts[1] not in shapes_here:
                del state[key]
        fresh = [
            f"{part}.{shape}." for shape in sorted(shapes_here - shapes_there) for part in ("patch_in", "patch_out")
        ]
        return state, [name for name in self.vocabulary if name not in where], fresh

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inputs by task (the cache's units, channels last) -> predictions by task (the next frame, or the
        solution)."""
        out, used = {}, {geometry(self.specs[name]) for name in inputs}
        for name, x in inputs.items():
            spec = self.specs[name]
            frames = x if spec.autoregressive else x[:, None]
            tokens, xn, mean, std = self._tokens(name, spec, frames)
            for block in self.blocks:
                tokens = block(tokens)
            out[name] = self._fields(name, spec, tokens[:, -1], frames, xn, mean, std)
        unused = [m for k, m in [*self.patch_in.items(), *self.patch_out.items()] if k not in used]
        zero = sum(tie(module) for module in unused)
        return {name: y + zero for name, y in out.items()}


def step_scale(xn: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(batch, channels): the root-mean-square change between consecutive input frames, in the cache's units: the
    scale of a predicted increment. Zero (to rounding) for a field constant over its window, which then stays so."""
    dims = tuple(range(1, xn.dim() - 1))
    steps = (xn[:, 1:] - xn[:, :-1]).square().mean(dim=dims)
    return steps.sqrt() * std + 1e-12


def check_specs(specs: dict[str, TaskSpec], cfg: MultiphysicsConfig) -> list[str]:
    """Problems that make a task unusable with this model, phrased as config fixes: the transformer's (patches
    that tile the grid), and dimensions and input frames it takes."""
    problems = multitask.check_specs(specs)
    for name, s in specs.items():
        if not 1 <= len(s.grid) <= 3:
            problems.append(f"tasks.{name}: a {len(s.grid)}D grid; model.name=multiphysics takes 1D, 2D and 3D")
        if s.autoregressive and s.initial_step > cfg.max_frames:
            problems.append(
                f"tasks.{name}.initial_step={s.initial_step} is more than model.multiphysics.max_frames="
                f"{cfg.max_frames}: raise max_frames or lower initial_step"
            )
    return problems
