"""Rollout-aware objectives: what Unroll predicts, where gradients flow, and the steps drawn."""

from __future__ import annotations

import pytest
import torch

from train.config import FNOConfig, TrainConfig
from train.engine.evaluate import rollout
from train.engine.objective import Unroll, draw_steps, target_frames, unrolled_targets
from train.model.builtin import PerTask
from train.model.fno import FNO
from train.model.specs import TaskData, TaskSpec

ADVECTION = TaskSpec(grid=(32,), in_channels=1, out_channels=1, patch_size=8, initial_step=3, autoregressive=True)
DARCY = TaskSpec(grid=(8, 8), in_channels=1, out_channels=1, patch_size=4, initial_step=1, autoregressive=False)


@pytest.fixture
def model() -> PerTask:
    torch.manual_seed(0)
    cfg = FNOConfig(width=8, modes=4, layers=2)
    return PerTask({"adv": FNO(ADVECTION, cfg), "darcy": FNO(DARCY, cfg)})


def inputs(batch: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"adv": torch.randn(batch, 3, 32, 1), "darcy": torch.randn(batch, 8, 8, 1)}


def test_unrolled_frames_are_the_evaluation_rollout_and_steady_tasks_predict_once(model):
    x = inputs()
    out = Unroll(model, {"adv"})(x, 0, 4)
    assert out["adv"].shape == (2, 4, 32, 1)
    assert out["darcy"].shape == (2, 8, 8, 1)
    # The same frames as evaluation's rollout of a trajectory whose first 3 frames are the inputs.
    task = TaskData("adv", None, ADVECTION)  # rollout reads the name and the spec only
    trajectory = torch.cat([x["adv"], torch.zeros(2, 4, 32, 1)], dim=1)
    torch.testing.assert_close(out["adv"], rollout(model, task, trajectory), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["darcy"], model({"darcy": x["darcy"]})["darcy"])


def test_pushforward_steps_carry_no_gradient_and_unrolled_steps_do(model):
    x = {n: v.requires_grad_() for n, v in inputs().items()}
    unroll = Unroll(model, {"adv"})
    pushed = unroll(x, 2, 1)["adv"]
    assert pushed.shape == (2, 1, 32, 1)
    pushed.sum().backward()
    assert x["adv"].grad is None  # the two steps before the trained one are constants
    assert all(p.grad is not None for p in model.networks["adv"].parameters())
    # The trained step equals the third frame of an unrolled prediction.
    with torch.no_grad():
        torch.testing.assert_close(pushed[:, 0], unroll(x, 0, 3)["adv"][:, 2], rtol=1e-5, atol=1e-6)
    unroll(x, 0, 3)["adv"][:, 2].sum().backward()
    assert x["adv"].grad is not None and x["adv"].grad.abs().sum() > 0  # backpropagated through 3 steps


def test_targets_are_the_frames_after_the_steps_rolled_out():
    y = torch.arange(5.0).view(1, 5, 1, 1)
    assert unrolled_targets(y, 2, 1).flatten().tolist() == [2.0]
    assert unrolled_targets(y, 0, 4).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_steps_drawn_depend_only_on_the_seed_and_cover_every_count():
    cfg = TrainConfig(objective="pushforward", rollout_steps=4)

    def draws(seed: int) -> list[int]:
        torch.manual_seed(seed)
        return [draw_steps(cfg) for _ in range(200)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
    assert {free for free, _ in draws(3)} == {0, 1, 2, 3} and {grad for _, grad in draws(3)} == {1}
    assert draw_steps(TrainConfig(objective="unrolled", rollout_steps=3)) == (0, 3)
    assert draw_steps(TrainConfig()) == (0, 1)
    assert [target_frames(TrainConfig(objective=o, rollout_steps=3)) for o in ("one_step", "unrolled")] == [1, 3]
