"""Tests of the pieces the trainer is assembled from: precision, torch.compile handling, unused parameters,
task draws, per-epoch batch streams and stop signals (one process)."""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest
import torch
from torch import nn

from train.config import CompileConfig, TransformerConfig
from train.data.dataset import EqualBatchSampler
from train.distributed.env import DistEnv
from train.engine.setup import (
    check_no_dead_parameters,
    compile_errors,
    compile_model,
    resolve_precision,
    unused_parameters,
)
from train.engine.signals import StopRequest
from train.engine.streams import EpochStreams, draw_group, draw_probabilities, step_seed, task_draws
from train.errors import ConfigError
from train.model.multitask import MultiTaskSurrogate
from train.model.specs import TaskSpec
from train.stop_signals import RANK_STOP_SIGNALS as STOP_SIGNALS

CPU = torch.device("cpu")


def env(world_size: int = 1) -> DistEnv:
    return DistEnv(0, 0, world_size, world_size, "gloo", CPU)


@pytest.fixture
def dynamo():
    import torch._dynamo

    saved = torch._dynamo.config.suppress_errors
    torch._dynamo.reset()
    yield
    torch._dynamo.config.suppress_errors = saved
    torch._dynamo.reset()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# ------------------------------------------------------------------------------------------- precision
def test_precision_auto_is_fp32_on_cpu_and_explicit_choices_hold():
    auto = resolve_precision("auto", CPU)
    assert auto.name == "fp32" and auto.scaler() is None
    with auto.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    bf16 = resolve_precision("bf16", CPU)
    assert bf16.scaler() is None  # bf16 has fp32's range: no loss scaling
    with bf16.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    fp16 = resolve_precision("fp16", CPU)
    assert isinstance(fp16.scaler(), torch.amp.GradScaler)


# --------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize(
    ("mode", "world_size", "used"),
    [
        ("reduce-overhead", 2, "default"),
        ("max-autotune", 2, "max-autotune-no-cudagraphs"),
        ("default", 2, "default"),
        ("max-autotune-no-cudagraphs", 2, "max-autotune-no-cudagraphs"),
        # One process runs without DDP: no gradient hook for a graph's replay to skip, the mode is honoured.
        ("reduce-overhead", 1, "reduce-overhead"),
        ("max-autotune", 1, "max-autotune"),
    ],
)
def test_cuda_graph_modes_are_coerced_under_ddp_only(monkeypatch, caplog, dynamo, mode, world_size, used):
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.update(kw) or model)
    with caplog.at_level(logging.WARNING):
        compile_model(Tiny(), CompileConfig(enabled=True, mode=mode), env(world_size))
    assert seen["mode"] == used
    assert ("skips DDP's gradient synchronisation" in caplog.text) == (used != mode)


def test_compile_disabled_returns_the_model_itself(dynamo):
    model = Tiny()
    assert compile_model(model, CompileConfig(enabled=False), env()) is model
    assert compile_model(model, CompileConfig(enabled="auto"), env()) is model  # auto: off on CPU


def _broken_backend(gm, example_inputs):
    raise RuntimeError("this compiler is broken")


def test_compile_failure_falls_back_to_eager_unless_strict(dynamo):
    model, x = Tiny(), torch.randn(3, 4)
    lenient = compile_model(model, CompileConfig(enabled=True), env(), backend=_broken_backend)
    torch.testing.assert_close(lenient(x), model(x), rtol=0, atol=0)

    torch._dynamo.reset()
    strict = compile_model(model, CompileConfig(enabled=True, strict=True), env(), backend=_broken_backend)
    with pytest.raises(compile_errors(), match="this compiler is broken"):
        strict(x)


def test_compile_captures_a_graph_of_the_multitask_model(dynamo):
    from train.engine.setup import compiled_graphs

    spec = TaskSpec(grid=(16,), in_channels=1, out_channels=1, patch_size=4, initial_step=2, autoregressive=True)
    model = MultiTaskSurrogate({"adv": spec}, TransformerConfig(d_model=16, n_heads=2, n_layers=1))
    before = compiled_graphs()
    compiled = compile_model(model, CompileConfig(enabled=True), env(), backend="eager")
    x = {"adv": torch.randn(2, 2, 16, 1)}
    torch.testing.assert_close(compiled(x)["adv"], model(x)["adv"])
    assert compiled_graphs() > before


# ----------------------------------------------------------------------------------- unused parameters
def two_task_model():
    specs = {
        "adv": TaskSpec(grid=(16,), in_channels=1, out_channels=1, patch_size=4, initial_step=2, autoregressive=True),
        "dar": TaskSpec(grid=(8, 8), in_channels=1, out_channels=1, patch_size=4, initial_step=1, autoregressive=False),
    }
    torch.manual_seed(0)
    model = MultiTaskSurrogate(specs, TransformerConfig(d_model=16, n_heads=2, n_layers=1))
    batches = {"adv": torch.randn(2, 2, 16, 1), "dar": torch.randn(2, 8, 8, 1)}
    return model, batches


def loss_of(batches):
    return lambda m: sum(v.mean() for v in m(batches).values())


def test_unused_parameters_are_the_other_tasks_codec():
    model, batches = two_task_model()
    assert unused_parameters(model, loss_of(batches)) == []
    only_adv = unused_parameters(model, loss_of({"adv": batches["adv"]}))
    assert only_adv and all(name.startswith("codecs.dar.") for name in only_adv)
    assert {n for n, _ in model.codecs["dar"].named_parameters(prefix="codecs.dar")} == set(only_adv)
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient behind


def test_dead_parameters_are_named_in_a_config_error():
    model, batches = two_task_model()
    check_no_dead_parameters(model, loss_of(batches))  # every parameter used: no error
    model.register_parameter("forgotten_scale", nn.Parameter(torch.ones(3)))
    with pytest.raises(ConfigError, match=r"forgotten_scale.*Expected to have finished reduction"):
        check_no_dead_parameters(model, loss_of(batches))
    model.forgotten_scale.requires_grad_(False)  # frozen: DDP ignores it
    check_no_dead_parameters(model, loss_of(batches))


# ------------------------------------------------------------------------------------------ task draws
P31 = np.array([0.75, 0.25])


def test_task_draws_are_deterministic_weighted_and_differ_between_ranks():
    a = task_draws(0, 0, 3, 4000, P31)
    assert np.array_equal(a, task_draws(0, 0, 3, 4000, P31))
    assert 0.72 < np.mean(a == 0) < 0.78
    assert not np.array_equal(a, task_draws(0, 1, 3, 4000, P31))
    assert not np.array_equal(a, task_draws(0, 0, 4, 4000, P31))
    assert len({step_seed(0, r, e, s) for r in range(2) for e in range(3) for s in range(50)}) == 300


def test_draw_probabilities_follow_weights_times_size_to_the_alpha():
    assert np.allclose(draw_probabilities([1, 1, 1], [100, 400, 900], 0.0), [1 / 3] * 3)
    assert np.allclose(draw_probabilities([1, 1, 1], [100, 400, 900], 1.0), [100 / 1400, 400 / 1400, 900 / 1400])
    # alpha 1/2 (a temperature of 2) flattens the mix toward its small sources; a zero weight keeps a task out
    assert np.allclose(draw_probabilities([1, 1, 0], [100, 400, 900], 0.5), [1 / 3, 2 / 3, 0])


def test_ranks_of_one_shard_group_draw_the_same_tasks():
    groups = [draw_group("hsdp", rank, 2) for rank in range(4)]
    assert groups == [0, 0, 1, 1]
    assert [draw_group("fsdp", rank, 4) for rank in range(4)] == [0] * 4
    assert [draw_group("ddp", rank, 4) for rank in range(4)] == [0, 1, 2, 3]
    p = draw_probabilities([1, 1, 1], [1, 1, 1], 0.0)
    draws = [task_draws(7, g, 2, 50, p) for g in groups]
    assert np.array_equal(draws[0], draws[1]) and np.array_equal(draws[2], draws[3])
    assert not np.array_equal(draws[0], draws[2])


class Items:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitems__(self, idx):
        return {"x": torch.tensor(idx)}


def streams_from(start, draws, micro_steps=12):
    from torch.utils.data import DataLoader

    samplers = {name: EqualBatchSampler(17, 3, micro_steps, 1, 2, 0, i) for i, name in enumerate(("a", "b"))}
    loaders = {n: DataLoader(Items(17), batch_sampler=s, collate_fn=lambda b: b) for n, s in samplers.items()}
    return EpochStreams(loaders, samplers, 5, start, micro_steps, draws)


@pytest.mark.parametrize("weighted", [False, True])
def test_streams_resumed_mid_epoch_yield_what_the_whole_epoch_yields(weighted):
    draws = task_draws(0, 1, 5, 12, draw_probabilities([1.0, 2.0], [1, 1], 0.0)) if weighted else None
    whole = streams_from(0, draws)
    reference = [whole.batches_at(i) for i in range(12)]
    for start in (1, 5, 11):
        resumed = streams_from(start, draws)
        for i in range(start, 12):
            got = resumed.batches_at(i)
            assert got.keys() == reference[i].keys()
            for name in got:
                assert torch.equal(got[name]["x"], reference[i][name]["x"]), (start, i, name)
    if weighted:
        assert all(len(b) == 1 for b in reference) and {k for b in reference for k in b} == {"a", "b"}


# -------------------------------------------------------------------------------------------- signals
@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_stop_signal_sets_the_flag_once_and_handlers_are_restored(sig):
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with StopRequest() as stop:
        assert not stop.agreed()
        os.kill(os.getpid(), sig)
        os.kill(os.getpid(), signal.SIGTERM)  # a second copy (torchrun forwards its own) changes nothing
        assert stop.agreed()
        assert stop.received == sig
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before
