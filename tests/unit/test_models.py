"""The model seam: built-in FNO shapes and precision, a user's factory, and every way a factory can be wrong."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

from train.config import FNOConfig, ModelConfig, UNetConfig
from train.errors import ConfigError
from train.model.factory import build_model, check_outputs, resolve_factory
from train.model.fno import FNO, SpectralConv
from train.model.specs import TaskSpec

ADVECTION = TaskSpec(grid=(64,), in_channels=1, out_channels=1, patch_size=8, initial_step=4, autoregressive=True)
DARCY = TaskSpec(grid=(16, 16), in_channels=1, out_channels=1, patch_size=4, initial_step=1, autoregressive=False)
FLOW = TaskSpec(grid=(16, 12), in_channels=3, out_channels=3, patch_size=4, initial_step=2, autoregressive=True)


def inputs_for(specs: dict[str, TaskSpec], batch: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        name: torch.randn(batch, *([s.initial_step] if s.autoregressive else []), *s.grid, s.in_channels)
        for name, s in specs.items()
    }


@pytest.mark.parametrize("padding", [None, 0, 3])
def test_fno_predicts_every_task_in_the_contract_shape(padding):
    specs = {"adv": ADVECTION, "darcy": DARCY, "flow": FLOW}
    model = build_model(specs, ModelConfig(name="fno", fno=FNOConfig(modes=6, width=8, layers=2, padding=padding)))
    inputs = inputs_for(specs)
    out = model(inputs)
    check_outputs(out, inputs, specs, "fno")  # raises on a missing task or a wrong shape
    assert out["flow"].shape == (3, 16, 12, 3)
    sum(o.square().mean() for o in out.values()).backward()
    assert all(p.grad is not None for p in model.parameters()), "every parameter takes part"


def test_unet_predicts_every_task_in_the_contract_shape_on_grids_it_must_pad():
    specs = {"adv": ADVECTION, "flow": FLOW, "odd": TaskSpec((20,), 2, 1, 4, 1, False)}  # 12 and 20 get padded
    model = build_model(specs, ModelConfig(name="unet", unet=UNetConfig(init_features=4)))
    inputs = inputs_for(specs)
    out = model(inputs)
    check_outputs(out, inputs, specs, "unet")
    sum(o.square().mean() for o in out.values()).backward()
    assert all(p.grad is not None for p in model.parameters()), "every parameter takes part"


def test_fno_keeps_no_more_modes_than_the_grid_holds():
    net = FNO(DARCY, FNOConfig(modes=64, width=4, layers=1, padding=0))
    assert net.spectral[0].modes == (8, 9)  # 16 // 2 along the full FFT axis, 16 // 2 + 1 along the real one
    assert FNO(ADVECTION, FNOConfig(modes=12, width=4, layers=1)).spectral[0].modes == (12,)


def test_a_spectral_layer_is_translation_equivariant_on_a_periodic_grid():
    """The defining property of a Fourier layer: shifting the input shifts the output."""
    torch.manual_seed(0)
    layer = SpectralConv(4, (5,))
    x = torch.randn(2, 4, 32)
    assert torch.allclose(layer(torch.roll(x, 7, -1)), torch.roll(layer(x), 7, -1), atol=1e-5)


def test_fno_under_bf16_autocast_runs_its_transforms_in_fp32(monkeypatch):
    seen = []
    rfftn = torch.fft.rfftn

    def spy(x, *args, **kwargs):
        seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        return rfftn(x, *args, **kwargs)

    monkeypatch.setattr(torch.fft, "rfftn", spy)
    specs = {"adv": ADVECTION, "darcy": DARCY}
    model = build_model(specs, ModelConfig(name="fno", fno=FNOConfig(modes=4, width=8, layers=2)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(inputs_for(specs))
    assert seen and all(dtype == torch.float32 and not autocast for dtype, autocast in seen)
    assert all(torch.isfinite(o.float()).all() for o in out.values())


# -- a user's factory ----------------------------------------------------------------------------------------

USER_MODEL = """
import torch
from torch import nn


class PointwiseNet(nn.Module):
    def __init__(self, specs, hidden):
        super().__init__()
        self.specs = specs
        self.nets = nn.ModuleDict({
            name: nn.Sequential(nn.Linear(s.initial_step * s.in_channels if s.autoregressive else s.in_channels,
                                          hidden), nn.GELU(), nn.Linear(hidden, s.out_channels))
            for name, s in specs.items()
        })

    def forward(self, inputs):
        out = {}
        for name, x in inputs.items():
            if self.specs[name].autoregressive:
                x = x.movedim(1, -2).flatten(-2)
            out[name] = self.nets[name](x)
        return out


def build(specs, hidden=16):
    return PointwiseNet(specs, hidden)


def build_missing_task(specs):
    model = PointwiseNet(specs, 4)
    return Dropping(model)


class Dropping(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, inputs):
        out = self.inner(inputs)
        out.pop(sorted(out)[0])
        return out


def build_raises(specs):
    raise RuntimeError("no GPU kernel for this grid")


def build_not_a_module(specs):
    return "a model"
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_models" / "model.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(USER_MODEL))
    return path


def test_a_factory_from_a_file_gets_the_specs_and_model_args(user_file):
    specs = {"adv": ADVECTION, "darcy": DARCY}
    model = build_model(specs, ModelConfig(name=f"{user_file}:build", args={"hidden": 7}))
    assert model.nets["adv"][0].out_features == 7
    inputs = inputs_for(specs)
    check_outputs(model(inputs), inputs, specs, "mine")


def test_a_factory_from_a_module_path():
    assert resolve_factory("train.model.factory:build_model") is build_model


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_package.models:build", "module 'no_such_package.models' cannot be imported"),
        ("train.model.fno:no_such_function", "'train.model.fno' has no function 'no_such_function'"),
        ("/no/such/dir/model.py:build", "no such file '/no/such/dir/model.py'"),
        ("build", "write 'package.module:function' or 'path/to/file.py:function'"),
    ],
)
def test_a_wrong_factory_name_is_a_config_error_naming_it(name, message):
    with pytest.raises(ConfigError) as error:
        resolve_factory(name)
    assert message in str(error.value)
    assert error.value.exit_code == 2


def test_a_file_that_fails_to_import_is_named(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import torch\nraise ImportError('needs my_lab_utils')\n")
    with pytest.raises(ConfigError, match=r"importing .*broken\.py' failed \(ImportError: needs my_lab_utils\)"):
        resolve_factory(f"{path}:build")


def test_a_factory_that_raises_or_returns_no_module_is_named(user_file):
    with pytest.raises(ConfigError, match=re.escape("the factory raised RuntimeError: no GPU kernel for this grid")):
        build_model({"adv": ADVECTION}, ModelConfig(name=f"{user_file}:build_raises"))
    with pytest.raises(ConfigError, match=re.escape("returned a str, not a torch.nn.Module")):
        build_model({"adv": ADVECTION}, ModelConfig(name=f"{user_file}:build_not_a_module"))


def test_outputs_missing_a_task_or_of_the_wrong_shape_are_named(user_file):
    specs = {"adv": ADVECTION, "darcy": DARCY}
    inputs = inputs_for(specs)
    model = build_model(specs, ModelConfig(name=f"{user_file}:build_missing_task"))
    with pytest.raises(ConfigError, match=r"no prediction for task 'adv'.*expected a tensor of shape \(3, 64, 1\)"):
        check_outputs(model(inputs), inputs, specs, "mine")
    wrong = {"adv": torch.zeros(3, 64), "darcy": torch.zeros(3, 16, 16, 1)}
    with pytest.raises(ConfigError, match=re.escape("task 'adv' prediction has shape (3, 64), expected (3, 64, 1)")):
        check_outputs(wrong, inputs, specs, "mine")
    with pytest.raises(ConfigError, match=re.escape("forward returned a Tensor")):
        check_outputs(torch.zeros(1), inputs, specs, "mine")


def test_a_user_factory_is_recorded_by_its_source_file_and_hash(user_file):
    from train.model.factory import factory_source

    before = factory_source(f"{user_file}:build")
    assert before["file"] == str(user_file) and len(before["sha256"]) == 64
    user_file.write_text(user_file.read_text().replace("hidden=16", "hidden=17"))
    assert factory_source(f"{user_file}:build")["sha256"] != before["sha256"]
    assert factory_source("fno") is None
    assert factory_source("train.model.fno:FNO")["file"].endswith("train/model/fno.py")


def test_weights_of_another_model_and_outputs_that_are_not_finite_are_config_errors(tmp_path, user_file):
    from train.checkpoint import load_model_state

    specs = {"adv": ADVECTION}
    model = build_model(specs, ModelConfig(name=f"{user_file}:build"))
    other = build_model(specs, ModelConfig(name=f"{user_file}:build", args={"hidden": 8}))
    with pytest.raises(ConfigError, match=r"ckpt\.pt holds the weights of another model \(.*size mismatch"):
        load_model_state(model, other.state_dict(), tmp_path / "ckpt.pt")
    inputs = inputs_for(specs)
    bad = {"adv": torch.full((3, 64, 1), float("nan"))}
    with pytest.raises(ConfigError, match=r"output for task 'adv' is not finite \(NaN or inf\)"):
        check_outputs(bad, inputs, specs, "mine")


def _well_spec(boundary) -> TaskSpec:
    """A Well-like task: 2 predicted channels plus 1 constant channel, on a 32 x 32 grid."""
    return TaskSpec((32, 32), 3, 2, 4, 2, True, boundary=boundary)


@pytest.mark.parametrize("name", ["fno", "unet"])
def test_periodic_axes_wrap_and_others_do_not(name):
    """A periodic axis is wrapped, never zero-padded: shifting the input by 16 points along y (a whole number of
    the U-Net's pooling cells) shifts the U-Net's output when y is periodic, not when it has walls; the FNO pads
    only the axes that are not periodic."""
    torch.manual_seed(0)
    cfg = ModelConfig(name=name, fno=FNOConfig(modes=4, width=8, layers=2), unet=UNetConfig(init_features=4))
    periodic, mixed = _well_spec(((2, 2), (2, 2))), _well_spec(((2, 2), (0, 1)))
    if name == "fno":
        assert FNO(periodic, cfg.fno).pads == [0, 0] and FNO(mixed, cfg.fno).pads == [0, 2]
        return
    x = torch.randn(2, 2, 32, 32, 3)
    shifted = lambda t, dim: torch.roll(t, 16, dims=dim)  # noqa: E731
    for spec, wraps in ((periodic, True), (mixed, False)):
        model = build_model({"w": spec}, cfg).eval()
        out, out_of_shift = model({"w": x})["w"], model({"w": shifted(x, 3)})["w"]  # along y
        assert torch.allclose(out_of_shift, shifted(out, 2), atol=1e-5) == wraps


@pytest.mark.parametrize("name", ["fno", "unet"])
def test_a_residual_model_predicts_the_change_from_the_last_frame(name):
    cfg = ModelConfig(name=name, fno=FNOConfig(width=4, layers=1, residual=True),
                      unet=UNetConfig(init_features=4, residual=True))  # fmt: skip
    model = build_model({"w": _well_spec(())}, cfg)
    for p in model.parameters():
        torch.nn.init.zeros_(p)  # the change is zero: the prediction is the last frame's predicted channels
    x = torch.randn(2, 2, 32, 32, 3)
    torch.testing.assert_close(model.eval()({"w": x})["w"], x[:, -1, ..., :2])


def test_the_gpu_ceiling_benchmark_runs_its_steps_at_toy_size_on_a_cpu():
    """make gpu-check's ceiling (the FNOs' step with the data on the device) is run by no CI: its code runs here."""
    from train.bench.gpu.ceiling import TOY, ceiling

    rows = ceiling(torch.device("cpu"))
    assert [(r["task"], r["batch"], r["mode"]) for r in rows] == TOY
    assert all(r["samples_per_s"] > 0 and 0.5 < r["loss"] < 2.0 for r in rows), rows  # random data: loss about 1
