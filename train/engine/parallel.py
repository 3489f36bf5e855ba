"""How the model is spread over the ranks (dist.parallel): one row per strategy, as train.model.builtin is for
models.

- ``ddp``: DistributedDataParallel, a whole copy of weights, gradients and optimizer state on every rank (about
  16 bytes per parameter under AdamW in fp32), gradients all-reduced in buckets during the backward;
- ``fsdp``: FSDP2's ``fully_shard`` over all ranks: each unit's weights, gradients and optimizer state are
  sharded (about 16/ranks bytes per parameter), its weights gathered for its forward and backward and freed
  after, its gradients reduce-scattered;
- ``hsdp``: the same sharding within groups of ``dist.shard_group_size`` ranks, replicated across the groups (a
  2D device mesh: the gathers stay inside a group, only the gradient reduction crosses groups).

Checkpoints are one format whatever the strategy: the full model and optimizer state (the optimizer's indexed by
parameter position, as ``Optimizer.state_dict`` writes it), gathered from the shards onto rank 0's CPU when the
model is sharded. A run therefore resumes under any strategy and world size (resharded as it loads), and
every reader of a checkpoint (evaluation, Surrogate, predict, export, init_from, the remote mirror) reads one
from a sharded run as it reads any other.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from train.checkpoint.shards import by_position
from train.config import Config
from train.distributed.env import DistEnv
from train.errors import ConfigError
from train.model.builtin import MODELS
from train.strategies import STRATEGIES, StrategyFacts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Strategy(StrategyFacts):
    """One way of spreading the model over the ranks: a row of train.strategies.STRATEGIES and how it wraps the
    model."""

    wrap: Callable[..., nn.Module] | None = None
    """``wrap(root, model, env, cfg, find_unused, precision)``: ``root`` (the model, or the rollout around it)
    spread over the ranks; ``model`` is the bare model inside it (whose blocks are the sharded units)."""


def wrap_ddp(model: nn.Module, env: DistEnv, find_unused: bool) -> DistributedDataParallel:
    """DDP over ``model``. ``find_unused``: some parameters may get no gradient on some rank in a step (ranks
    drawing different tasks); DDP then searches the autograd graph each step, which costs time, so it is asked
    for only then.

    On GPUs, batch normalisation (the U-Net's) is made synchronous: its statistics are those of the whole
    global batch, as on one device. On CPU (SyncBatchNorm runs on CUDA only) each rank normalises its own
    batch, and DDP gives every rank rank 0's running statistics at each forward.
    """
    if env.device.type == "cuda":
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        assert converted is model, "the trainer's models wrap their normalisation layers"
    return DistributedDataParallel(
        model, device_ids=[env.local_rank] if env.device.type == "cuda" else None, find_unused_parameters=find_unused
    )


def _ddp(root: nn.Module, model: nn.Module, env: DistEnv, cfg: Config, find_unused: bool, precision) -> nn.Module:
    return wrap_ddp(root, env, find_unused)


def _fsdp(root: nn.Module, model: nn.Module, env: DistEnv, cfg: Config, find_unused: bool, precision) -> nn.Module:
    strategy = cfg.dist.parallel
    if find_unused:
        raise ConfigError(
            f"dist.parallel={strategy} needs every rank to use every sharded unit in every step, but ranks may "
            "skip parameters here (train.task_sampling=weighted or train.find_unused_parameters=true): use "
            "dist.parallel=ddp, or task_sampling=all"
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    group = shard_group_size(cfg, env)
    if strategy == "hsdp":
        shape, dims = (env.world_size // group, group), ("replicate", "shard")
    else:
        shape, dims = (env.world_size,), ("shard",)
    mesh = init_device_mesh(env.device.type, shape, mesh_dim_names=dims)
    # bf16: weights gathered in bf16 for the compute, gradients reduced in fp32; the sharded master copy stays fp32.
    bf16 = precision.dtype == torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    units = shard_units(model, cfg)
    for name in units:
        unit = model.get_submodule(name)
        fully_shard(unit, mesh=mesh, **({"mp_policy": policy} if policy else {}))
        # A unit whose parent calls other methods than forward (the transformer's codecs: tokens, fields) names
        # them: they gather its weights as forward does.
        for method in getattr(unit, "sharded_methods", ()):
            register_fsdp_forward_method(unit, method)
    fully_shard(root, mesh=mesh, **({"mp_policy": policy} if policy else {}))
    replicas = f", {env.world_size // group} replica(s)" if strategy == "hsdp" else ""
    shown = ", ".join(units[:6]) + (" ..." if len(units) > 6 else "")
    log.info(
        "dist.parallel=%s: %d unit(s) sharded over %d rank(s)%s: %s", strategy, len(units) + 1, group, replicas, shown
    )
    return root


_WRAPS = {"ddp": _ddp, "fsdp": _fsdp, "hsdp": _fsdp}
PARALLEL: dict[str, Strategy] = {
    name: Strategy(facts.summary, facts.sharded, facts.state_share, _WRAPS[name]) for name, facts in STRATEGIES.items()
}


def shard_group_size(cfg: Config, env: DistEnv) -> int:
    """Ranks one copy of the model is sharded over: all of them (fsdp), dist.shard_group_size or a node's (hsdp)."""
    if cfg.dist.parallel != "hsdp":
        return env.world_size
    size = cfg.dist.shard_group_size or env.local_world_size
    if env.world_size % size:
        raise ConfigError(
            f"dist.shard_group_size={size} does not divide the world size {env.world_size}: hsdp needs groups of "
            "equal size; set it to a divisor (e.g. the ranks of one node)"
        )
    return size


def shard_units(model: nn.Module, cfg: Config) -> list[str]:
    """Names of the submodules sharded as units: model.shard_units, the model table's, or each direct child of
    the model that holds parameters (a model of your own)."""
    built_in = cfg.model.name in MODELS
    patterns = cfg.model.shard_units or (list(MODELS[cfg.model.name].shard_units) if built_in else ["*"])
    names = [name for name, _ in model.named_modules() if name]
    units = []
    for pattern in patterns:
        # '*' stands for one name: 'blocks.*' is each block, not every module inside the blocks.
        one_level = re.compile(".".join("[^.]*".join(map(re.escape, part.split("*"))) for part in pattern.split(".")))
        found = [n for n in names if one_level.fullmatch(n)]
        if not found and cfg.model.shard_units:
            raise ConfigError(
                f"model.shard_units: {pattern!r} names no submodule of model.name={cfg.model.name}; its modules "
                f"include {', '.join(names[:12])}"
            )
        units += [n for n in found if n not in units]
    # A unit inside another unit is sharded first (innermost first), as fully_shard requires.
    holding = [n for n in units if any(True for _ in model.get_submodule(n).parameters())]
    return sorted(holding, key=lambda n: -n.count("."))


def wrap(root: nn.Module, model: nn.Module, env: DistEnv, cfg: Config, find_unused: bool, precision) -> nn.Module:
    """``root`` spread over the ranks by dist.parallel; one process keeps it as it is (nothing to synchronise; a
    CUDA graph then has no hook to skip)."""
    if env.world_size == 1:
        return root
    return PARALLEL[cfg.dist.parallel].wrap(root, model, env, cfg, find_unused, precision)


def writes_shards(cfg: Config, env: DistEnv, node_token: str | None) -> bool:
    """Whether a sharded model's checkpoints are every rank's shards in one folder (dist.checkpoint). 'auto':
    when every rank writes into the one run folder: one node, or nodes whose run folders all hold node 0's
    launch token ``node_token`` (a shared file system; every rank calls, a collective). Across nodes with
    folders of their own, one file: a launch hands rank 0's checkpoint to the other nodes as bytes."""
    if cfg.dist.checkpoint != "auto":
        return cfg.dist.checkpoint == "sharded"
    if env.world_size == env.local_world_size:
        return True
    import torch.distributed as dist

    tokens: list[str | None] = [None] * env.world_size
    dist.all_gather_object(tokens, node_token)
    shared = tokens[0] is not None and all(t == tokens[0] for t in tokens)
    own = "the nodes keep run folders of their own: one file, gathered onto rank 0"
    log.info("dist.checkpoint=auto: %s", "every node shares the run folder: shards" if shared else own)
    return shared


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@contextlib.contextmanager
def no_sync(wrapped: nn.Module) -> Iterator[None]:
    """Gradients accumulate locally (a micro-batch before the last): DDP's no_sync, or FSDP2 told to skip the
    reduce-scatter. FSDP2 still frees the weights between micro-batches (reshard_after_backward stays on): less
    memory, for one more gather per micro-batch."""
    if isinstance(wrapped, DistributedDataParallel):
        with wrapped.no_sync():
            yield
        return
    if not hasattr(wrapped, "set_requires_gradient_sync"):  # one process: nothing to hold back
        yield
        return
    wrapped.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)


@contextlib.contextmanager
def gathered(root: nn.Module) -> Iterator[None]:
    """Every sharded unit's weights gathered (on every rank, in the same order) and kept for the block: ranks may
    then run different numbers of forward passes (validation shards differ by one sample) with no collective."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            # The root keeps its weights after the forward (FSDP2 sets it so at its first forward): the backward
            # gathers them at once anyway.
            unit.set_reshard_after_forward(unit is not root, recurse=False)
            unit.reshard()


def grad_norm(norm: torch.Tensor) -> torch.Tensor:
    """A clipped gradient norm as a plain tensor (FSDP2 returns the norm of sharded gradients as a DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # no import on the step's path


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of weights, gradients and optimizer state this rank holds at its peak in a step (its shards of a
    sharded model); gradients counted at their size, as they are freed between steps."""

    def local(t: torch.Tensor) -> int:
        return t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes

    total = sum(local(p) * (2 if p.requires_grad else 1) for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _names(model: nn.Module) -> list[str]:
    """The trainable parameters' names in the order the optimizer holds them (train.engine.optim)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict; of a sharded model gathered onto rank 0's CPU (empty on the other ranks), which every
    rank must call."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()``; of a sharded model gathered onto rank 0 (every rank calls) and indexed by
    parameter position as the plain optimizer indexes it, so that any strategy can load it."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return {}
    return by_position(full, _names(model))


def load_model(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (every rank holds it) into the model, sharding it where the model is sharded."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an optimizer state written by :func:`optimizer_state` (any strategy, any world size)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _names(model)
    by_name = {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
