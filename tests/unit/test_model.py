"""Tests of the multi-task surrogate: patch tokens, output shapes, identity start, gradients, spec checks."""

from __future__ import annotations

import pytest
import torch

from train.config import TransformerConfig
from train.model.multitask import MultiTaskSurrogate, check_specs, patchify, unpatchify
from train.model.specs import TaskSpec

CFG = TransformerConfig(d_model=16, n_heads=2, n_layers=2, mlp_ratio=2)


def specs():
    return {
        "adv": TaskSpec(grid=(32,), in_channels=1, out_channels=1, patch_size=4, initial_step=3, autoregressive=True),
        "cfd": TaskSpec(grid=(16,), in_channels=3, out_channels=3, patch_size=8, initial_step=2, autoregressive=True),
        "darcy": TaskSpec(
            grid=(8, 12), in_channels=1, out_channels=1, patch_size=4, initial_step=10, autoregressive=False
        ),
    }


def batch(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "adv": torch.randn(b, 3, 32, 1, generator=g),
        "cfd": torch.randn(b, 2, 16, 3, generator=g),
        "darcy": torch.randn(b, 8, 12, 1, generator=g),
    }


# ---------------------------------------------------------------------------------------------- patches
@pytest.mark.parametrize(("shape", "patch"), [((2, 16, 3), 4), ((1, 12, 1), 12), ((2, 8, 12, 2), 4), ((3, 6, 6, 1), 1)])
def test_patchify_round_trip(shape, patch):
    x = torch.randn(*shape)
    grid = shape[1:-1]
    tokens = patchify(x, patch)
    n_tokens = 1
    for n in grid:
        n_tokens *= n // patch
    assert tokens.shape == (shape[0], n_tokens, patch ** len(grid) * shape[-1])
    assert torch.equal(unpatchify(tokens, grid, patch), x)


def test_patchify_1d_token_content():
    b, n, c, p = 2, 12, 3, 4
    x = torch.arange(b * n * c, dtype=torch.float32).reshape(b, n, c)
    tokens = patchify(x, p)
    for j in range(n // p):
        # token j holds grid points j*p .. j*p+p-1, each with all its channels
        assert torch.equal(tokens[:, j], x[:, j * p : (j + 1) * p, :].reshape(b, -1))


def test_patchify_2d_token_content_row_major():
    b, nx, ny, c, p = 2, 8, 12, 2, 4
    x = torch.arange(b * nx * ny * c, dtype=torch.float32).reshape(b, nx, ny, c)
    tokens = patchify(x, p)
    cols = ny // p
    assert tokens.shape == (b, (nx // p) * cols, p * p * c)
    for j in range(tokens.shape[1]):
        r, q = divmod(j, cols)  # row-major over the patch grid
        expected = x[:, r * p : (r + 1) * p, q * p : (q + 1) * p, :].reshape(b, -1)
        assert torch.equal(tokens[:, j], expected), j


def test_unpatchify_places_tokens():
    grid, p = (4, 6), 2
    tokens = torch.zeros(1, 6, p * p)
    tokens[0, 4] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # patch row 1, column 1
    x = unpatchify(tokens, grid, p)[0, ..., 0]
    expected = torch.zeros(grid)
    expected[2:4, 2:4] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(x, expected)


# ------------------------------------------------------------------------------------------------ model
def test_output_shapes():
    torch.manual_seed(0)
    model = MultiTaskSurrogate(specs(), CFG)
    out = model(batch(b=3))
    assert set(out) == {"adv", "cfd", "darcy"}
    assert out["adv"].shape == (3, 32, 1)  # the next frame
    assert out["cfd"].shape == (3, 16, 3)
    assert out["darcy"].shape == (3, 8, 12, 1)  # the solution field
    assert all(torch.isfinite(v).all() for v in out.values())


def test_subset_of_tasks():
    torch.manual_seed(0)
    model = MultiTaskSurrogate(specs(), CFG)
    inputs = batch(b=2)
    out = model({"darcy": inputs["darcy"]})
    assert set(out) == {"darcy"}
    assert out["darcy"].shape == (2, 8, 12, 1)


def test_autoregressive_tasks_start_as_identity_on_last_frame():
    torch.manual_seed(0)
    model = MultiTaskSurrogate(specs(), CFG)
    inputs = batch(b=4)
    out = model(inputs)
    assert torch.equal(out["adv"], inputs["adv"][:, -1])
    assert torch.equal(out["cfd"], inputs["cfd"][:, -1])
    # the steady task is not an identity (it has no previous frame to copy)
    assert not torch.allclose(out["darcy"], torch.zeros_like(out["darcy"]))


def test_samples_do_not_mix_in_eval_mode():
    torch.manual_seed(0)
    model = MultiTaskSurrogate(specs(), CFG).eval()
    inputs = batch(b=4)
    whole = model(inputs)["darcy"]
    one = model({"darcy": inputs["darcy"][2:3]})["darcy"]
    torch.testing.assert_close(one, whole[2:3], rtol=1e-5, atol=1e-6)


def test_every_parameter_gets_a_gradient_from_one_forward():
    torch.manual_seed(0)
    model = MultiTaskSurrogate(specs(), CFG)
    inputs, targets = batch(b=2, seed=1), batch(b=2, seed=2)
    out = model(inputs)
    loss = sum(
        torch.nn.functional.mse_loss(out[name], targets[name][:, -1] if name != "darcy" else targets[name])
        for name in out
    )
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []
    # the zero-initialised decoders of autoregressive tasks still learn: their gradient is not zero
    for name in ("adv", "cfd"):
        assert model.codecs[name].decode[1].weight.grad.abs().sum() > 0


def test_missing_task_leaves_its_codec_without_gradient():
    # the converse: the property above holds only because every task is in the forward
    torch.manual_seed(0)
    model = MultiTaskSurrogate(specs(), CFG)
    inputs = batch(b=2)
    out = model({"adv": inputs["adv"], "darcy": inputs["darcy"]})
    (out["adv"].square().mean() + out["darcy"].square().mean()).backward()
    without = {n for n, p in model.named_parameters() if p.grad is None}
    assert without == {n for n, _ in model.named_parameters() if n.startswith("codecs.cfd.")}


def test_same_seed_same_weights():
    torch.manual_seed(3)
    a = MultiTaskSurrogate(specs(), CFG)
    torch.manual_seed(3)
    b = MultiTaskSurrogate(specs(), CFG)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb
        assert torch.equal(pa, pb)


def test_task_spec_in_features():
    s = specs()
    assert s["adv"].in_features == 3
    assert s["cfd"].in_features == 6
    assert s["darcy"].in_features == 1  # initial_step does not apply to a steady task
    assert s["darcy"].as_dict()["grid"] == (8, 12)


# ------------------------------------------------------------------------------------------- check_specs
def test_check_specs_accepts_dividing_patches():
    assert check_specs(specs()) == []


@pytest.mark.parametrize(("grid", "patch"), [((30,), 4), ((8, 10), 4), ((10, 8), 4), ((3,), 4)])
def test_check_specs_reports_non_dividing_patch(grid, patch):
    bad = TaskSpec(grid=grid, in_channels=1, out_channels=1, patch_size=patch, initial_step=2, autoregressive=True)
    problems = check_specs({**specs(), "bad": bad})
    assert len(problems) == 1
    assert f"tasks.bad.patch_size={patch}" in problems[0]
    assert str(grid) in problems[0]
