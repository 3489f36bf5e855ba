"""The local convolutional baselines (model.name=conv and resnet): shapes in 1D, 2D and 3D, time-dependent and
steady; circular padding on periodic axes and zeros on the others; the table's parameter count; built from a
config; traced whole by torch.compile. Small networks only: every test takes well under a second but the
compiled one."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import REPO
from train.config import ConvConfig, ModelConfig, ResNetConfig, load_config
from train.model.builtin import MODELS, check_builtin, parameter_count
from train.model.factory import build_model, check_outputs
from train.model.specs import TaskSpec

NAMES = ("conv", "resnet")
SMALL = {
    "conv": ModelConfig(name="conv", conv=ConvConfig(width=8, depth=2, kernel=3)),
    "resnet": ModelConfig(name="resnet", resnet=ResNetConfig(width=8, blocks=2, kernel=3, norm="group")),
}
PERIODIC, WALL = (2, 2), (0, 1)
SPECS = {
    "1d": TaskSpec(grid=(32,), in_channels=3, out_channels=2, patch_size=4, initial_step=2, autoregressive=True),
    "2d": TaskSpec(grid=(12, 10), in_channels=1, out_channels=1, patch_size=2, initial_step=3, autoregressive=True),
    "3d": TaskSpec(grid=(6, 5, 4), in_channels=2, out_channels=2, patch_size=1, initial_step=1, autoregressive=True),
    "steady": TaskSpec(
        grid=(12, 10), in_channels=2, out_channels=1, patch_size=2, initial_step=1, autoregressive=False
    ),
}


def inputs(spec: TaskSpec, batch: int = 2, seed: int = 0) -> torch.Tensor:
    frames = (spec.initial_step,) if spec.autoregressive else ()
    return torch.randn(batch, *frames, *spec.grid, spec.in_channels, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_every_dimension_time_dependent_or_steady_in_the_contract_shape(name):
    torch.manual_seed(0)
    model = build_model(SPECS, SMALL[name])
    x = {key: inputs(spec) for key, spec in SPECS.items()}
    out = model(x)
    check_outputs(out, x, SPECS, name)  # raises on a missing task or a wrong shape
    assert out["3d"].shape == (2, 6, 5, 4, 2) and out["steady"].shape == (2, 12, 10, 1)
    sum(o.square().mean() for o in out.values()).backward()
    assert all(p.grad is not None for p in model.parameters()), "every parameter takes part"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(torch.isfinite(o.float()).all() for o in model(x).values())


def _spec(boundary) -> TaskSpec:
    return TaskSpec((16, 12), 2, 1, 4, 2, True, boundary=boundary)


@pytest.mark.parametrize("name", NAMES)
def test_a_periodic_axis_wraps_around_and_a_walled_one_is_padded_with_zeros(name):
    """Shifting the input along an axis shifts the output exactly where that axis is periodic (the grid has no
    edge), not where it has walls; a pulse at the last point reaches the first through the wrap only."""
    torch.manual_seed(0)
    x = inputs(_spec(()))
    shift = lambda t, dim: torch.roll(t, (5, 3)[dim - 2], dims=dim)  # noqa: E731  (b, [k,] x, y, c): x, y at -3, -2
    for boundary, along_x, along_y in (
        ((PERIODIC, PERIODIC), True, True),
        ((PERIODIC, WALL), True, False),
        ((WALL, WALL), False, False),
    ):
        model = build_model({"w": _spec(boundary)}, SMALL[name]).eval()
        with torch.no_grad():
            out = model({"w": x})["w"]
            for dim, wraps in ((2, along_x), (3, along_y)):  # the input's x, y axes are 2, 3; the output's 1, 2
                got = model({"w": shift(x, dim)})["w"]
                assert torch.allclose(got, shift(out.unsqueeze(1), dim).squeeze(1), atol=1e-5) == wraps, boundary

    line = lambda wraps: TaskSpec((32,), 1, 1, 4, 1, True, boundary=((PERIODIC if wraps else WALL),))  # noqa: E731
    pulse = torch.zeros(1, 1, 32, 1)
    pulse[:, :, -1] = 1.0
    # Without the group norm, whose statistics span the whole grid: the networks are local.
    local = SMALL[name].model_copy(update={"resnet": ResNetConfig(width=8, blocks=2, kernel=3)})
    for wraps in (True, False):
        torch.manual_seed(0)
        model = build_model({"l": line(wraps)}, local).eval()
        with torch.no_grad():
            first = model({"l": pulse})["l"][0, 0], model({"l": torch.zeros_like(pulse)})["l"][0, 0]
        assert torch.equal(*first) != wraps  # the first point sees the last only through the wrap


@pytest.mark.parametrize("name", NAMES)
def test_the_tables_parameter_count_is_the_built_models_at_the_defaults(name):
    specs = {"advection1d": TaskSpec((256,), 1, 1, 8, 10, True), "darcy2d": TaskSpec((64, 64), 1, 1, 8, 1, False)}
    for cfg in (ModelConfig(name=name), SMALL[name]):
        torch.manual_seed(0)
        model = build_model(specs, cfg)
        assert parameter_count(specs, cfg) == sum(p.numel() for p in model.parameters()) > 0
    one = ModelConfig(name=name)
    assert 30_000 <= parameter_count({"advection1d": specs["advection1d"]}, one) <= 100_000  # a small model
    assert MODELS[name].shard_units == ("networks.*",)


def test_built_from_a_config_file_with_its_section_and_refused_with_a_wrong_setting():
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["model.name=conv", "model.conv.width=6", "model.conv.depth=1"])
    spec = TaskSpec((64,), 1, 1, 8, 4, True)
    model = build_model({"advection1d": spec}, cfg.model)
    assert [m.conv.out_channels for m in model.networks["advection1d"].layers if hasattr(m, "conv")] == [6]
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["model.name=resnet", "model.resnet.activation=silu"])
    assert isinstance(
        build_model({"advection1d": spec}, cfg.model).networks["advection1d"].blocks[0].act, torch.nn.SiLU
    )
    with pytest.raises(Exception, match="must be odd"):
        ModelConfig.model_validate({"name": "conv", "conv": {"kernel": 4}})
    with pytest.raises(Exception, match="gelu"):
        ModelConfig.model_validate({"name": "resnet", "resnet": {"activation": "elu"}})


def test_every_setting_is_documented():
    for section in (ConvConfig, ResNetConfig):
        for key, field in section.model_fields.items():
            assert field.description and len(field.description.strip()) > 5, f"{section.__name__}.{key}"
    for name in NAMES:
        assert ModelConfig.model_fields[name].description == f"Settings of model.name={name}."


def test_a_kernel_that_would_wrap_a_periodic_axis_twice_is_named_before_training():
    small = {"p": TaskSpec((4, 16), 1, 1, 4, 1, True, boundary=(PERIODIC, WALL))}
    cfg = ModelConfig(name="conv", conv=ConvConfig(kernel=11))
    (problem,) = check_builtin(small, cfg)
    assert "tasks.p: model.conv.kernel=11 wraps its periodic axis 0 of 4 points" in problem and "at most 9" in problem
    assert check_builtin(small, ModelConfig(name="resnet", resnet=ResNetConfig(kernel=9))) == []


@pytest.mark.parametrize("name", NAMES)
def test_the_same_seed_builds_the_same_model_and_a_residual_one_starts_from_the_last_frame(name):
    spec = SPECS["1d"]
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(build_model({"t": spec}, SMALL[name])({"t": inputs(spec)})["t"])
    assert torch.equal(*outs)
    section = SMALL[name].model_dump()
    section[name]["residual"] = True
    model = build_model({"t": spec}, ModelConfig.model_validate(section))
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    x = inputs(spec)
    torch.testing.assert_close(model({"t": x})["t"], x[:, -1, ..., : spec.out_channels])


@pytest.mark.parametrize("name", NAMES)
def test_traced_whole_forward_and_backward_as_eager(name):
    """fullgraph=True raises at the first graph break: the loss and its gradients in one graph, periodic and
    walled axes both (a 2D grid of one of each), fp32, equal to eager."""
    import torch._dynamo

    spec = _spec((PERIODIC, WALL))
    torch.manual_seed(0)
    model = build_model({"w": spec}, SMALL[name])
    params = list(model.parameters())
    x, y = inputs(spec), torch.randn(2, *spec.grid, spec.out_channels)

    def step(x, y):
        loss = (model({"w": x})["w"] - y).square().mean()
        return loss.detach(), torch.autograd.grad(loss, params)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        loss, grads = torch.compile(step, fullgraph=True, backend="aot_eager")(x, y)
    want, want_grads = step(x, y)
    torch.testing.assert_close(loss, want)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)
