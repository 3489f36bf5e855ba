"""Multi-task surrogate: per-task patch encoders and decoders around one shared transformer processor.

One forward call takes a batch of every task and returns a prediction for each, so every parameter
takes part in every step: DDP never waits for the gradient of an unused task head.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from train.config import TransformerConfig
from train.model.specs import TaskSpec


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """(b, *grid, c) -> (b, tokens, patch**d * c), tokens in row-major order of the patch grid."""
    b, *grid, c = x.shape
    d = len(grid)
    shape = [b]
    for n in grid:
        shape += [n // patch, patch]
    x = x.reshape(*shape, c)
    # Move patch-grid axes first, in-patch axes after them: (b, n1, n2, .., p1, p2, .., c).
    order = [0, *range(1, 2 * d, 2), *range(2, 2 * d + 1, 2), 2 * d + 1]
    return x.permute(order).reshape(b, math.prod([n // patch for n in grid]), patch**d * c)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, ...], patch: int) -> torch.Tensor:
    """Inverse of :func:`patchify`."""
    b = tokens.shape[0]
    d = len(grid)
    counts = [n // patch for n in grid]
    x = tokens.reshape(b, *counts, *([patch] * d), -1)
    order = [0]
    for i in range(d):
        order += [1 + i, 1 + d + i]
    order.append(2 * d + 1)
    return x.permute(order).reshape(b, *grid, -1)


class TaskCodec(nn.Module):
    """Encoder (patches -> tokens, plus a learned position embedding) and decoder (tokens -> patches)."""

    sharded_methods = ("tokens", "fields")
    """Called by the model instead of forward: under dist.parallel=fsdp they gather this unit's weights."""

    def __init__(self, spec: TaskSpec, d_model: int):
        super().__init__()
        self.spec = spec
        tokens = math.prod(n // spec.patch_size for n in spec.grid)
        patch_cells = spec.patch_size ** len(spec.grid)
        self.encode = nn.Linear(patch_cells * spec.in_features, d_model)
        self.position = nn.Parameter(torch.zeros(1, tokens, d_model))
        nn.init.trunc_normal_(self.position, std=0.02)
        self.decode = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, patch_cells * spec.out_channels))
        # Start as the identity map for autoregressive tasks (zero update): training begins at the
        # "repeat the last frame" solution and improves from there.
        if spec.autoregressive:
            nn.init.zeros_(self.decode[1].weight)
            nn.init.zeros_(self.decode[1].bias)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.autoregressive:  # (b, k, *grid, c) -> (b, *grid, k*c)
            k = x.shape[1]
            x = x.movedim(1, -2).reshape(*x.shape[:1], *x.shape[2:-1], k * x.shape[-1])
        return self.encode(patchify(x, self.spec.patch_size)) + self.position

    def fields(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = unpatchify(self.decode(tokens), self.spec.grid, self.spec.patch_size)
        return x[:, -1, ..., : self.spec.out_channels] + out if self.spec.autoregressive else out


class MultiTaskSurrogate(nn.Module):
    def __init__(self, specs: dict[str, TaskSpec], cfg: TransformerConfig):
        super().__init__()
        self.codecs = nn.ModuleDict({name: TaskCodec(spec, cfg.d_model) for name, spec in specs.items()})
        layer = nn.TransformerEncoderLayer(
            cfg.d_model,
            cfg.n_heads,
            cfg.d_model * cfg.mlp_ratio,
            cfg.dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.processor = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(
        self, inputs: dict[str, torch.Tensor], latents: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Normalised inputs by task -> normalised predictions by task (the next frame, or the solution).

        ``latents`` holds precomputed encoder tokens of some tasks (a latent cache): their encoders are frozen
        and skipped.
        """
        out = {}
        for name, x in inputs.items():
            codec = self.codecs[name]
            tokens = latents[name] if latents is not None and name in latents else codec.tokens(x)
            out[name] = codec.fields(self.norm(self.processor(tokens)), x)
        return out

    def freeze_encoder(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Load task ``name``'s encoder from ``state`` and exclude it from training (and from DDP's buckets)."""
        codec = self.codecs[name]
        missing = codec.load_state_dict(state, strict=False).missing_keys
        assert not set(state) & set(missing), "encoder keys are the codec's own"
        codec.encode.requires_grad_(False)
        codec.position.requires_grad_(False)


def check_specs(specs: dict[str, TaskSpec]) -> list[str]:
    """Problems that make a task unusable with this model, phrased as config fixes."""
    problems = []
    for name, s in specs.items():
        if any(n % s.patch_size for n in s.grid):
            problems.append(
                f"tasks.{name}.patch_size={s.patch_size} must divide the strided grid {s.grid} "
                f"(change patch_size or spatial_stride)"
            )
    return problems
