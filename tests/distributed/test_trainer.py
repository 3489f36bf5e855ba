"""The trainer on 2 gloo ranks: accumulation parity, ranks training different tasks, agreed stops, compile."""

from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers import prepare_run, rank_trainer, run_ranks
from train.engine.streams import task_draws

pytestmark = pytest.mark.distributed

SMALL = ["train.grad_clip=0", "train.steps_per_epoch=2", "train.epochs=1"]


def _gradients_of_one_step(rank: int, run_dir, out) -> None:
    import torch.distributed as dist

    from train.engine.streams import EpochStreams

    trainer = rank_trainer(run_dir)
    captured = {}
    step = trainer.optimizer.step
    parameters = dict(trainer.model.named_parameters())  # the closure must not hold the trainer (see _fit)

    def capture(*args, **kwargs):
        captured.update({n: p.grad.clone() for n, p in parameters.items() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    micro_steps = trainer.steps * trainer.micro
    trainer.train_step(EpochStreams(trainer.loaders, trainer.samplers, 0, 0, micro_steps, None))
    torch.save(captured, out / f"grads{rank}.pt")
    del trainer  # before the group (see _fit)
    gc.collect()
    dist.destroy_process_group()


def test_accumulated_micro_batches_give_the_gradient_of_one_large_batch(tmp_path):
    """4 micro-batches of 2 (no_sync on the first 3) == 1 batch of 8 per rank: both steps cover the same 16
    items per task over the 2 ranks (the sampler's global order is the same), so the all-reduced mean gradients
    agree up to float32 summation order. Tolerance: rtol 1e-4, atol 1e-6."""
    grads = {}
    for name, batch, accumulate in (("micro", 2, 4), ("large", 8, 1)):
        run_dir = prepare_run(
            tmp_path,
            overrides=[
                *SMALL,
                f"tasks.advection1d.batch_size={batch}",
                f"tasks.darcy2d.batch_size={batch}",
                f"train.accumulate_steps={accumulate}",
            ],
            name=name,
        )
        out = tmp_path / name
        out.mkdir()
        run_ranks(_gradients_of_one_step, 2, run_dir, out)
        grads[name] = [torch.load(out / f"grads{r}.pt") for r in range(2)]
    for r in range(2):  # DDP leaves the same averaged gradient on every rank
        for n, g in grads["micro"][r].items():
            assert torch.equal(g, grads["micro"][0][n])
    micro, large = grads["micro"][0], grads["large"][0]
    assert micro.keys() == large.keys() and len(micro) > 10
    for n in micro:
        torch.testing.assert_close(micro[n], large[n], rtol=1e-4, atol=1e-6, msg=f"gradient of {n}")
    # The comparison can fail: a different item set gives clearly different gradients.
    assert any(not torch.allclose(micro[n], grads["large"][0][n] * 1.01, rtol=1e-4, atol=1e-6) for n in micro)


def _whole_step_gradients(rank: int, run_dir, out) -> None:
    """The compiled step's gradients of the first batch after their all-reduce (its own code, compiled)."""
    import torch.distributed as dist

    from train.engine.step import _all_reduce_mean
    from train.engine.streams import EpochStreams, step_seed
    from train.engine.trainer import seed_step

    trainer = rank_trainer(run_dir)
    step = trainer.whole_step
    assert step is not None, "compile.enabled=true on 2 CPU ranks compiles the whole step"
    streams = EpochStreams(trainer.loaders, trainer.samplers, 0, 0, trainer.steps * trainer.micro, None)
    seed_step(step_seed(trainer.cfg.run.seed, trainer.env.rank, 0, 0), trainer.env.device)
    batches = streams.batches_at(0)
    inputs = {n: b["x"] for n, b in batches.items()}
    targets = {n: b["y"] for n, b in batches.items()}

    def reduced(inputs, targets):
        return _all_reduce_mean(step._gradients(inputs, targets, {}, 0, 1)[1], 2)

    grads = torch.compile(reduced, fullgraph=True, backend=trainer.backend)(inputs, targets)
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    torch.save(dict(zip(names, grads, strict=True)), out / f"grads{rank}.pt")
    trainer.stop_workers()
    del trainer, reduced
    gc.collect()
    dist.destroy_process_group()


def test_the_compiled_steps_all_reduced_gradients_equal_ddps(tmp_path):
    """The whole step all-reduces its gradients in the graph (one flat buffer, divided by the world size and
    summed): they are DDP's, on every rank. The graphs run on PyTorch's kernels (aot_eager): the all-reduce is the
    graph's, whichever backend generates its code (inductor's own is checked in tests/integration/test_models.py)."""
    grads = {}
    for name, compiled in (("ddp", "false"), ("whole", "true")):
        overrides = [*SMALL, f"compile.enabled={compiled}", "compile.backend=aot_eager"]
        run_dir = prepare_run(tmp_path, overrides=overrides, name=name)
        out = tmp_path / name
        out.mkdir()
        run_ranks(_whole_step_gradients if compiled == "true" else _gradients_of_one_step, 2, run_dir, out)
        grads[name] = [torch.load(out / f"grads{r}.pt") for r in range(2)]
    ddp, whole = grads["ddp"][0], grads["whole"]
    assert ddp.keys() == whole[0].keys() == whole[1].keys() and len(ddp) > 10
    for n in ddp:
        assert torch.equal(whole[0][n], whole[1][n]), n  # the same on both ranks
        torch.testing.assert_close(whole[0][n], ddp[n], rtol=1e-5, atol=1e-7, msg=f"gradient of {n}")


def _fit(rank: int, run_dir, force_find_unused: bool | None, out) -> None:
    import torch.distributed as dist

    import train.engine.parallel as parallel_module
    from train.errors import TrainError
    from train.obs.sinks import MetricSinks

    if force_find_unused is not None:
        wrap = parallel_module.wrap_ddp
        parallel_module.wrap_ddp = lambda model, env, find_unused: wrap(model, env, force_find_unused)
    trainer = None
    try:
        trainer = rank_trainer(run_dir)
        trainer.fit(MetricSinks(None))
        result = {"ok": True, "state": {k: v.clone() for k, v in trainer.model.state_dict().items()}}
    except TrainError as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    torch.save(result, out / f"rank{rank}.pt")
    # DDP goes before the group: freed after it, the last reference to a gloo group joins gloo's threads
    # while holding the GIL they wait for (a rank then never exits).
    del trainer
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _results(out):
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_ranks_training_different_tasks_in_one_step_need_no_user_action(tmp_path):
    steps = 6
    draws = [task_draws(0, r, 0, steps, np.array([0.5, 0.5])) for r in range(2)]
    assert (draws[0] != draws[1]).any(), "the random seed must make the ranks draw different tasks in some step"
    run_dir = prepare_run(tmp_path, overrides=["train.task_sampling=weighted", f"train.steps_per_epoch={steps}",
                                               "train.epochs=1"])  # fmt: skip
    run_ranks(_fit, 2, run_dir, None, tmp_path)
    results = _results(tmp_path)
    assert all(r["ok"] for r in results), results
    for name, value in results[0]["state"].items():  # DDP kept the replicas identical
        assert torch.equal(value, results[1]["state"][name]), name


def test_without_the_unused_parameter_search_the_error_names_the_parameters(tmp_path):
    """The negative control: DDP told that every parameter is used fails, and the user gets our message, which
    names the skipped task's parameters, not the raw "Expected to have finished reduction"."""
    run_dir = prepare_run(tmp_path, overrides=["train.task_sampling=weighted", "train.steps_per_epoch=6",
                                               "train.epochs=1"])  # fmt: skip
    run_ranks(_fit, 2, run_dir, False, tmp_path)
    for result in _results(tmp_path):
        assert not result["ok"]
        assert result["error"].startswith("ConfigError: DDP found parameters without a gradient")
        assert "codecs." in result["error"] and "train.find_unused_parameters=true" in result["error"]


MULTIPHYSICS = ["model.name=multiphysics", "model.multiphysics.d_model=16", "model.multiphysics.n_heads=2",
                "model.multiphysics.n_layers=1", "model.multiphysics.field_width=4", "train.task_sampling=weighted",
                "train.steps_per_epoch=6", "train.epochs=1"]  # fmt: skip


def _fit_drawing(rank: int, run_dir, out) -> None:
    from train.obs.sinks import MetricSinks

    trainer = rank_trainer(run_dir)
    trainer.fit(MetricSinks(None))
    draws = task_draws(0, trainer.draw_group, 0, 6, trainer.draw_p)
    torch.save({"draws": draws.tolist(), "find_unused": trainer.ddp.find_unused_parameters
                if hasattr(trainer.ddp, "find_unused_parameters") else None}, out / f"rank{rank}.pt")  # fmt: skip
    del trainer
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_multiphysics_model_trains_ranks_drawing_different_sources_with_no_unused_parameter_search(
    tmp_path, strategy
):
    """Under ddp each rank draws its own dataset and DDP needs no search for unused parameters (the model uses all
    of them whatever the dataset); under fsdp, refused for the transformer, the ranks of the shard group draw the
    same dataset and train."""
    run_dir = prepare_run(tmp_path, overrides=[*MULTIPHYSICS, f"dist.parallel={strategy}"])
    run_ranks(_fit_drawing, 2, run_dir, tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    if strategy == "ddp":
        assert results[0]["find_unused"] is False and results[0]["draws"] != results[1]["draws"]
    else:
        assert results[0]["draws"] == results[1]["draws"]


def _stop_at_boundary(rank: int, out) -> None:
    import torch.distributed as dist

    from train.distributed.env import DistEnv, init_distributed
    from train.engine.signals import StopRequest

    init_distributed(DistEnv.from_environ("gloo"), 60)
    stopped_at = None
    with StopRequest() as stop:
        for boundary in range(20):
            if stop.agreed():
                stopped_at = boundary
                break
            if rank == 1 and boundary == 4:
                os.kill(os.getpid(), signal.SIGUSR1)
    (out / f"rank{rank}").write_text(str(stopped_at))
    dist.destroy_process_group()


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_boundary(tmp_path):
    run_ranks(_stop_at_boundary, 2, tmp_path)
    # Posted at boundary 5 (after the signal during step 4), read back at boundary 6.
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["6", "6"]


def _compile_fails(rank: int, run_dir, out) -> None:
    import train.engine.trainer as trainer_module

    def broken(gm, example_inputs):
        raise RuntimeError("this compiler is broken")

    trainer_module.Trainer.compile_backend = staticmethod(broken)
    _fit(rank, run_dir, None, out)


@pytest.mark.parametrize("strict", [False, True])
def test_a_compile_failure_runs_eagerly_unless_strict(tmp_path, strict):
    run_dir = prepare_run(tmp_path, overrides=[*SMALL, "compile.enabled=true", f"compile.strict={str(strict).lower()}"])
    run_ranks(_compile_fails, 2, run_dir, tmp_path)
    results = _results(tmp_path)
    if strict:
        assert all(not r["ok"] and "ConfigError: torch.compile failed" in r["error"] for r in results), results
    else:
        assert all(r["ok"] for r in results), results
        log = (run_dir / "logs" / "rank0.log").read_text()
        assert "torch.compile failed (BackendCompilerFailed" in log and "the step runs eagerly" in log


def _workers_after_fit(rank: int, run_dir, out) -> None:
    import multiprocessing

    import torch.distributed as dist

    from train.obs.sinks import MetricSinks

    trainer = rank_trainer(run_dir)
    trainer.fit(MetricSinks(None))
    # The trainer is still referenced: its workers must be gone anyway. They ignore SIGTERM, so workers left
    # for interpreter exit would hang it (multiprocessing terminates them, then waits forever).
    torch.save(len(multiprocessing.active_children()), out / f"rank{rank}.pt")
    del trainer  # before the group (see _fit)
    gc.collect()
    dist.destroy_process_group()


def test_fit_stops_its_dataloader_workers_before_it_returns(tmp_path):
    run_dir = prepare_run(tmp_path, overrides=[*SMALL, "train.num_workers=2"])
    run_ranks(_workers_after_fit, 2, run_dir, tmp_path)
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)] == [0, 0]


def _fit_weights(rank: int, run_dir, out) -> None:
    import torch.distributed as dist

    from train.obs.sinks import MetricSinks

    trainer = rank_trainer(run_dir)
    trainer.fit(MetricSinks(None))
    torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, out / f"rank{rank}.pt")
    del trainer  # before the group (see _fit)
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.parametrize("objective", ["pushforward", "unrolled"])
def test_rollout_objectives_resume_mid_epoch_bitwise(tmp_path, objective):
    """A run of 2 epochs x 3 steps, and a second run started from the first one's checkpoint at step 2 (mid
    epoch), end with bitwise equal weights: the steps rolled out are drawn from the step's seed."""
    common = [f"train.objective={objective}", "train.rollout_steps=3", "train.steps_per_epoch=3", "train.epochs=2",
              "model.dropout=0.1"]  # fmt: skip
    first = prepare_run(tmp_path, overrides=[*common, "train.checkpoint_every=2", "train.keep_checkpoints=5"])
    run_ranks(_fit_weights, 2, first, tmp_path)
    straight = torch.load(tmp_path / "rank0.pt")
    checkpoint = first / "checkpoints" / "step_00000002.pt"
    assert checkpoint.is_file(), sorted(p.name for p in (first / "checkpoints").iterdir())
    resumed_dir = prepare_run(tmp_path, overrides=[*common, f"train.resume={checkpoint}"], name="resumed")
    run_ranks(_fit_weights, 2, resumed_dir, tmp_path)
    resumed = torch.load(tmp_path / "rank0.pt")
    assert "resumed from" in (resumed_dir / "logs" / "rank0.log").read_text()
    assert straight.keys() == resumed.keys()
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []
    # The objective changes what is trained: one-step training from the same start ends elsewhere.
    one_step = prepare_run(tmp_path, overrides=[*common[2:], "train.checkpoint_every=2"], name="one_step")
    run_ranks(_fit_weights, 2, one_step, tmp_path)
    other = torch.load(tmp_path / "rank0.pt")
    assert any(not torch.equal(straight[k], other[k]) for k in straight)


def _trainer_after_the_worker(rank: int, run_dir, out) -> None:
    import types
    import weakref

    import torch.distributed as dist

    from train import worker
    from train.distributed.env import DistEnv, init_distributed
    from train.run_dir import RunDir

    made = []
    real = worker.Trainer

    def recorded(*args, **kwargs):
        trainer = real(*args, **kwargs)
        made.append(weakref.ref(trainer))
        return trainer

    worker.Trainer = recorded
    run = RunDir(run_dir)
    cfg = run.load_config()
    env = init_distributed(DistEnv.from_environ("gloo"), 60)
    rank_ = types.SimpleNamespace(cfg=cfg, env=env, run=run, launch=None, args=types.SimpleNamespace(stages="fit"))
    worker._train_and_evaluate(rank_)
    # Still inside the process group, as the worker is when it returns: the trainer (and DDP's reducer in it)
    # must be gone already. Freed only by a later collection, after the group, torch can abort the process at
    # exit ("terminate called without an active exception").
    torch.save(made[0]() is None, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_the_worker_frees_the_trainer_while_the_process_group_lives(tmp_path):
    run_dir = prepare_run(tmp_path, overrides=SMALL)
    run_ranks(_trainer_after_the_worker, 2, run_dir, tmp_path)
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)] == [True, True]
