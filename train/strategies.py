"""The ways of spreading the model over the ranks (``dist.parallel``), as the launcher and the ranks both know
them: a row's summary, whether it shards the model state, and the share of that state one rank holds (what the
launcher's capacity check plans with before any rank runs). How a row wraps the model is the ranks' alone:
:data:`train.engine.parallel.PARALLEL` adds it to each row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StrategyFacts:
    """What both processes know of one way of spreading the model over the ranks."""

    summary: str
    sharded: bool
    """Weights, gradients and optimizer state are sharded (FSDP2): state dicts are gathered by every rank."""
    state_share: Callable[[int, int], float]
    """``state_share(world_size, shard_group_size)``: the share of the model state (weights, gradients, optimizer
    state) one rank holds."""


STRATEGIES: dict[str, StrategyFacts] = {
    "ddp": StrategyFacts("a whole copy on every rank, gradients all-reduced", False, lambda world, group: 1.0),
    "fsdp": StrategyFacts("sharded over all ranks (FSDP2)", True, lambda world, group: 1.0 / world),
    "hsdp": StrategyFacts(
        "sharded within groups, replicated across them (FSDP2, 2D mesh)", True, lambda world, group: 1.0 / group
    ),
}
