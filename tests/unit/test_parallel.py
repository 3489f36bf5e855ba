"""The table of parallel strategies (train/engine/parallel.py): which submodules are sharded units, and the
settings a sharded model refuses. Training under each strategy: tests/integration/test_sharded_runs.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from train.config import load_config
from train.distributed.env import DistEnv
from train.engine.parallel import PARALLEL, shard_group_size, shard_units, wrap
from train.engine.setup import resolve_precision
from train.errors import ConfigError
from train.model.builtin import build_builtin
from train.model.specs import TaskSpec

SPECS = {"adv": TaskSpec((64,), 1, 1, 8, 2, True), "darcy": TaskSpec((16, 16), 1, 1, 8, 1, False)}


def cfg(*overrides: str):
    return load_config("configs/tiny.yaml", list(overrides))


def env(world: int = 2, local: int = 2) -> DistEnv:
    return DistEnv(0, 0, world, local, "gloo", torch.device("cpu"))


@pytest.mark.parametrize(
    ("name", "units"),
    [
        ("transformer", ["codecs.adv", "codecs.darcy", "processor.layers.0", "processor.layers.1"]),
        ("fno", ["networks.adv", "networks.darcy"]),
        ("unet", ["networks.adv", "networks.darcy"]),
    ],
)
def test_each_built_in_model_names_its_blocks_one_level_deep(name, units):
    c = cfg(f"model.name={name}", "model.transformer.n_layers=2")
    assert sorted(shard_units(build_builtin(SPECS, c.model), c)) == units


class Mine(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
        self.act = nn.GELU()  # holds nothing: never a unit
        self.head = nn.Linear(8, 2)


def test_a_model_of_your_own_shards_its_children_or_the_units_it_names():
    c = cfg()
    assert shard_units(Mine(), c.model_copy(update={"model": c.model.model_copy(update={"name": "x.py:f"})})) == [
        "encoder",
        "head",
    ]
    named = c.model_copy(update={"model": c.model.model_copy(update={"name": "x.py:f", "shard_units": ["encoder.*"]})})
    assert sorted(shard_units(Mine(), named)) == ["encoder.0", "encoder.1"]  # innermost first, one level each
    wrong = c.model_copy(update={"model": c.model.model_copy(update={"name": "x.py:f", "shard_units": ["blocks.*"]})})
    with pytest.raises(ConfigError, match=r"model.shard_units: 'blocks\.\*' names no submodule"):
        shard_units(Mine(), wrong)


def test_ranks_that_may_skip_parameters_are_refused_under_sharding():
    c = cfg("dist.parallel=fsdp")
    model = build_builtin(SPECS, c.model)
    with pytest.raises(ConfigError, match=r"dist.parallel=fsdp needs every rank to use every sharded unit"):
        wrap(model, model, env(), c, True, resolve_precision("fp32", torch.device("cpu")))


def test_hsdp_groups_must_divide_the_world_and_default_to_a_node():
    assert shard_group_size(cfg("dist.parallel=hsdp"), env(8, 4)) == 4
    assert shard_group_size(cfg("dist.parallel=fsdp"), env(8, 4)) == 8
    with pytest.raises(ConfigError, match=r"dist\.shard_group_size=3 does not divide the world size 8"):
        shard_group_size(cfg("dist.parallel=hsdp", "dist.shard_group_size=3"), env(8, 4))


def test_the_table_says_what_one_rank_holds():
    assert [PARALLEL[s].state_share(4, 2) for s in ("ddp", "fsdp", "hsdp")] == [1.0, 0.25, 0.5]
    assert not PARALLEL["ddp"].sharded and PARALLEL["fsdp"].sharded and PARALLEL["hsdp"].sharded
