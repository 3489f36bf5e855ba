"""torch.compile that compiles: every built-in model traced whole (forward, loss and gradients, one graph, no
break) in 1D, 2D and 3D, fp32 and bf16; and the trainer's whole step (rollout, loss, gradients, clipping, the
non-finite skip and AdamW) compiled as one graph per rollout length on configs/gpu.yaml's advection task, with
the losses of eager training, no host read, a learning rate that changes without a recompile, and at most 20
kernel-level operations per steady step outside compiled graphs (it was 620-1,085 of 622-1,096)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import REPO, local_trainer, prepare_run
from train.config import FNOConfig, ModelConfig, MultiphysicsConfig, TransformerConfig, UNetConfig
from train.engine.loss import task_loss
from train.model.factory import build_model
from train.model.specs import TaskSpec

SPECS = {
    "1d": TaskSpec(grid=(32,), in_channels=2, out_channels=2, patch_size=4, initial_step=2, autoregressive=True),
    "2d": TaskSpec(grid=(16, 16), in_channels=1, out_channels=1, patch_size=4, initial_step=1, autoregressive=True),
    "3d": TaskSpec(grid=(8, 8, 8), in_channels=1, out_channels=1, patch_size=4, initial_step=2, autoregressive=True),
    "steady": TaskSpec(
        grid=(16, 16), in_channels=1, out_channels=1, patch_size=4, initial_step=1, autoregressive=False
    ),
}
MODELS = {
    "fno": ModelConfig(name="fno", fno=FNOConfig(modes=4, width=8, layers=2)),
    "unet": ModelConfig(name="unet", unet=UNetConfig(init_features=4)),
    "transformer": ModelConfig(name="transformer", transformer=TransformerConfig(d_model=16, n_heads=2, n_layers=1)),
    "multiphysics": ModelConfig(
        name="multiphysics", multiphysics=MultiphysicsConfig(d_model=16, n_heads=2, n_layers=1)
    ),
}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_built_in_model_traces_whole_forward_and_backward(name):
    """fullgraph=True raises at the first graph break: one graph per call, 1D, 2D, 3D and steady, fp32 and bf16
    (the FNO's spectral layers were a break inside its layer loop, which made dynamo skip its whole forward)."""
    import torch._dynamo

    torch._dynamo.config.trace_autograd_ops = True
    for key, spec in SPECS.items():
        torch.manual_seed(0)
        model = build_model({key: spec}, MODELS[name])
        params = [p for p in model.parameters() if p.requires_grad]
        frames = (spec.initial_step,) if spec.autoregressive else ()
        x = torch.randn(2, *frames, *spec.grid, spec.in_channels)
        y = torch.randn(2, *spec.grid, spec.out_channels)
        for dtype in (None, torch.bfloat16):

            def step(x, y, dtype=dtype, key=key, model=model, params=params):
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    loss = task_loss(model({key: x})[key], y)
                return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

            torch._dynamo.reset()
            before = _graphs()
            loss, _ = torch.compile(step, fullgraph=True, backend="aot_eager")(x, y)
            assert _graphs() - before == 1, (name, key, dtype)
            want, _ = step(x, y)
            assert torch.allclose(loss, want, rtol=1e-5 if dtype is None else 1e-2), (name, key, dtype)


# -- the trainer's whole step -------------------------------------------------------------------------------------


def _advection_config(tmp: Path, precision: str) -> Path:
    """configs/gpu.yaml with its advection task alone, at test size: its FNO with one spectral layer (inductor's
    code for its four took 125 CPU s, for one 59), pushforward over 2 steps (not 4: each rollout length is a
    graph of its own, and inductor's code for four took two minutes of CI's cores)."""
    cfg = yaml.safe_load((REPO / "configs" / "gpu.yaml").read_text())
    task = {**cfg["tasks"]["advection1d"], "n_samples": 24, "batch_size": 8}
    cfg["tasks"] = {"advection1d": task}
    cfg["train"].update(precision=precision, warmup_steps=2, log_every=1, epochs=1, steps_per_epoch=8, rollout_steps=2)
    cfg["model"]["fno"]["layers"] = 1
    path = tmp / f"gpu-advection-{precision}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(trainer) -> list[float]:
    """Train as the worker does (train.log_every=1) and return each step's loss from metrics.jsonl."""
    from train.obs.sinks import MetricSinks, read_metrics

    sinks = MetricSinks(trainer.run.root)
    try:
        trainer.fit(sinks)
    finally:
        sinks.close()
    return [r["loss"] for r in read_metrics(trainer.run.root / "metrics.jsonl") if "samples_per_s" in r]


# fp32 through inductor's generated code; bf16 through aot_eager, the same graphs on PyTorch's kernels (the bf16
# code inductor generates for a CPU is not what a GPU runs, and generating it doubled this test's time). Inductor's
# fused reductions round differently: fp32 losses part by up to 2e-5 (relative) after 6 AdamW steps of the
# one-layer FNO, so the tolerance is 1e-4: three orders of magnitude below what each step moves the loss (20-50%).
@pytest.mark.parametrize(("precision", "backend", "rtol"), [("fp32", "inductor", 1e-4), ("bf16", "aot_eager", 1e-3)])
def test_the_whole_pushforward_step_is_one_graph_per_rollout_length_with_the_losses_of_eager(
    tmp_path, precision, backend, rtol
):
    runs = {
        mode: prepare_run(
            tmp_path,
            _advection_config(tmp_path, precision),
            [f"compile.enabled={mode}", f"compile.backend={backend}"],
            name=mode,
        )
        for mode in ("false", "true")
    }
    eager = _fit(local_trainer(runs["false"]))
    compiled = local_trainer(runs["true"])
    assert compiled.whole_step is not None and compiled.watch.facts.mode == "whole step"
    assert compiled.watch.facts.backend == backend
    drawn = []
    original = compiled._micro_step

    def spy(batches, free, grad, last):
        drawn.append(free)
        return original(batches, free, grad, last)

    compiled._micro_step = spy
    losses = _fit(compiled)
    facts = compiled.watch.facts
    assert len(losses) == 8 and losses[:6] == pytest.approx(eager[:6], rel=rtol), (losses, eager)  # rounding grows
    assert facts.graphs == len(set(drawn)) and len(set(drawn)) > 1, (facts, drawn)  # one per rollout length
    assert facts.breaks == [] and facts.frames_skipped == 0 and facts.recompiles_after_warmup == 0, facts
    assert facts.ops_outside_graphs is not None and facts.ops_outside_graphs <= 20, facts
    assert (compiled.run.report / "compile.json").is_file()


def test_a_steady_compiled_step_reads_nothing_back_and_takes_a_new_learning_rate_without_recompiling(tmp_path):
    """The learning rate is a device tensor the schedule writes: a Python float would be frozen into a CUDA graph,
    or recompile at every new value. No operation of a step reads a device value back to the host: the step's own
    function is run uncompiled under a dispatch mode that records such reads (dynamo refuses to compile under
    one), the trainer's bookkeeping around it as it is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from train.engine.streams import EpochStreams

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("_local_scalar_dense", "item")):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    overrides = ["compile.enabled=true", "compile.backend=aot_eager", "train.objective=one_step"]  # dynamo's guards
    run = prepare_run(tmp_path, _advection_config(tmp_path, "fp32"), overrides)
    weights, reads = {}, HostReads()
    for slower in (False, True):
        trainer = local_trainer(run)
        streams = EpochStreams(trainer.loaders, trainer.samplers, 0, 0, trainer.steps, None)
        for i in range(4):
            trainer.train_step(streams)
            trainer.state.step_in_epoch += 1
            weights[slower, i] = [p.detach().clone() for p in trainer.model.parameters()]
            if slower and i == 1:  # the schedule's rates from here on a tenth: step 3's update a tenth
                trainer.scheduler.base_lrs = [lr / 10 for lr in trainer.scheduler.base_lrs]
        facts = trainer.watch.close()
        assert facts.graphs <= 1 and facts.recompiles_after_warmup == 0, facts  # 0: the cache held it already
        trainer.whole_step.whole = trainer.whole_step._whole  # the same function, uncompiled
        with reads:
            trainer.train_step(streams)
        trainer.stop_workers()
    assert reads.seen == [], reads.seen
    for i in (0, 1, 2):
        assert all(torch.equal(a, b) for a, b in zip(weights[False, i], weights[True, i], strict=True)), i
    full = torch.cat([(b - a).flatten() for a, b in zip(weights[False, 2], weights[False, 3], strict=True)])
    tenth = torch.cat([(b - a).flatten() for a, b in zip(weights[True, 2], weights[True, 3], strict=True)])
    # Differences of float32 weights: each carries up to half an ulp of its weight (about 1e-7 here).
    assert torch.allclose(tenth, full / 10, rtol=1e-3, atol=1e-6) and full.abs().max() > 1e-4
