"""Two gloo ranks against one process: gradients, validation and test metrics must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import run_ranks
from train.config import Config, FNOConfig, ModelConfig, TaskConfig, TransformerConfig, UNetConfig
from train.data.acquire import generate
from train.data.cache.build import build_cache
from train.distributed.env import DistEnv, destroy_distributed, init_distributed
from train.engine.evaluate import evaluate_split, validation_loss
from train.model.factory import build_model
from train.model.multitask import MultiTaskSurrogate
from train.model.specs import TaskData, TaskSpec

pytestmark = pytest.mark.distributed

MODEL = TransformerConfig(d_model=16, n_heads=2, n_layers=1)
SPECS = {
    "adv": TaskSpec(grid=(32,), in_channels=1, out_channels=1, patch_size=4, initial_step=3, autoregressive=True),
    "darcy": TaskSpec(grid=(8, 8), in_channels=1, out_channels=1, patch_size=4, initial_step=1, autoregressive=False),
}


def _batch(seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    x = {"adv": torch.randn(8, 3, 32, 1, generator=g), "darcy": torch.randn(6, 8, 8, 1, generator=g)}
    y = {"adv": torch.randn(8, 32, 1, generator=g), "darcy": torch.randn(6, 8, 8, 1, generator=g)}
    return x, y


def _loss(model, x, y) -> torch.Tensor:
    pred = model(x)
    return sum(torch.nn.functional.mse_loss(pred[k], y[k]) for k in x)


def _make_model() -> MultiTaskSurrogate:
    torch.manual_seed(0)
    model = MultiTaskSurrogate(SPECS, MODEL)
    # Non-zero decoders, so every parameter has a gradient that depends on the data.
    for codec in model.codecs.values():
        torch.nn.init.normal_(codec.decode[1].weight, std=0.1)
    return model


def _ddp_rank(rank: int, out: Path) -> None:
    env = DistEnv.from_environ("gloo")
    init_distributed(env, 60)
    try:
        model = DistributedDataParallel(_make_model())
        x, y = _batch(1)
        # Each rank takes its half of the global batch: the averaged gradient is the full batch's.
        half = {k: v.chunk(2)[rank] for k, v in x.items()}
        half_y = {k: v.chunk(2)[rank] for k, v in y.items()}
        _loss(model, half, half_y).backward()
        grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        torch.save(grads, out / f"grads{rank}.pt")
        # DDP's reducer goes before the group: freed after it, the last reference to the gloo group would join
        # gloo's threads while holding the GIL they wait for (a teardown deadlock seen in CI).
        del model
    finally:
        destroy_distributed()


def test_ddp_gradients_equal_single_process_gradients(tmp_path):
    run_ranks(_ddp_rank, 2, tmp_path)
    model = _make_model()
    x, y = _batch(1)
    _loss(model, x, y).backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    for rank in range(2):
        grads = torch.load(tmp_path / f"grads{rank}.pt")
        assert grads.keys() == reference.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7, msg=name)


BUILT_IN = {
    "fno": ModelConfig(name="fno", fno=FNOConfig(modes=4, width=8, layers=2)),
    "unet": ModelConfig(name="unet", unet=UNetConfig(init_features=4)),
}
FIELD_SPECS = {
    "adv": TaskSpec(grid=(32,), in_channels=1, out_channels=1, patch_size=4, initial_step=3, autoregressive=True),
    "darcy": TaskSpec(grid=(16, 16), in_channels=1, out_channels=1, patch_size=4, initial_step=1, autoregressive=False),
}


def _field_batch() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(2)
    x = {"adv": torch.randn(8, 3, 32, 1, generator=g), "darcy": torch.randn(6, 16, 16, 1, generator=g)}
    y = {"adv": torch.randn(8, 32, 1, generator=g), "darcy": torch.randn(6, 16, 16, 1, generator=g)}
    return x, y


def _built_in(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(FIELD_SPECS, BUILT_IN[name])
    # U-Net: batch statistics are per rank under DDP (SyncBatchNorm runs only on GPUs), so compare with the
    # running statistics, the same on both sides; every parameter still takes part.
    return model.eval() if name == "unet" else model


def _built_in_rank(rank: int, out: Path, name: str) -> None:
    init_distributed(DistEnv.from_environ("gloo"), 60)
    try:
        model = DistributedDataParallel(_built_in(name))
        x, y = _field_batch()
        half = {k: v.chunk(2)[rank] for k, v in x.items()}
        half_y = {k: v.chunk(2)[rank] for k, v in y.items()}
        _loss(model, half, half_y).backward()
        torch.save({n: p.grad.clone() for n, p in model.module.named_parameters()}, out / f"grads{rank}.pt")
        del model  # before the group: see _ddp_rank
    finally:
        destroy_distributed()


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_built_in_models_ddp_gradients_equal_single_process_gradients(tmp_path, name):
    run_ranks(_built_in_rank, 2, tmp_path, name)
    model = _built_in(name)
    x, y = _field_batch()
    _loss(model, x, y).backward()
    reference = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in reference.values())
    for rank in range(2):
        grads = torch.load(tmp_path / f"grads{rank}.pt")
        assert grads.keys() == reference.keys()
        for param, grad in grads.items():
            torch.testing.assert_close(grad, reference[param], rtol=1e-4, atol=1e-6, msg=param)


def _tasks(root: Path) -> list[TaskData]:
    cfg = Config(
        tasks={
            "adv": TaskConfig(pde="advection1d", n_samples=30, resolution=32, temporal_stride=20, initial_step=3),
            "darcy": TaskConfig(pde="darcy2d", n_samples=30, resolution=8, coefficient=1.0, patch_size=4),
        }
    )
    tasks = []
    for name, task in cfg.tasks.items():
        path = root / "data" / f"{name}.h5"
        if not path.exists():
            generate.generate(
                task.pde, path, n_samples=30, resolution=task.resolution, coefficient=task.coefficient, seed=1
            )
        info = build_cache(name, task, path, root / "cache")
        tasks.append(TaskData(name, info, SPECS[name]))
    return tasks


def _eval_rank(rank: int, root: Path) -> None:
    env = DistEnv.from_environ("gloo")
    init_distributed(env, 60)
    try:
        model = _make_model().eval()
        tasks = _tasks(root)
        # Batch size 2 over 3 test samples: the ranks' shards differ in size and batch count.
        results = evaluate_split(model, tasks, env, "test", batch_size=2)
        val = validation_loss(model, tasks, env, batch_size=5)
        torch.save({"test": results, "val": val}, root / f"eval{rank}.pt")
    finally:
        destroy_distributed()


def test_distributed_metrics_equal_single_process_metrics(tmp_path):
    single_env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    tasks = _tasks(tmp_path)  # builds the caches once, before the ranks start
    assert tasks[0].info.sizes["test"] == 3
    model = _make_model().eval()
    expected = evaluate_split(model, tasks, single_env, "test", batch_size=64)
    expected_val = validation_loss(model, tasks, single_env, batch_size=64)
    run_ranks(_eval_rank, 2, tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"eval{rank}.pt")
        for name in expected:
            for key in ("nrmse", "rmse", "baseline_nrmse", "baseline_rmse"):
                assert got["test"][name][key] == pytest.approx(expected[name][key], rel=1e-9), (rank, name, key)
            assert got["val"][name] == pytest.approx(expected_val[name], rel=1e-9)
