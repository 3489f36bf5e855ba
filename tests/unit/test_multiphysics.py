"""The multi-physics model: 1D/2D/3D and steady tasks through one processor, the field vocabulary shared by name,
per-sample normalisation reversed on the output, every parameter in every step, fine-tuning's row matching, and
the field names a task gets from its format or its config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train.checkpoint import CONFIG, MODEL, SPECS, save_best
from train.config import Config, ModelConfig, MultiphysicsConfig, TaskConfig, load_config
from train.data.cache.info import CacheInfo
from train.errors import ConfigError
from train.model.builtin import check_builtin
from train.model.factory import build_model, check_outputs
from train.model.fields import task_fields
from train.model.multiphysics import MultiPhysicsSurrogate
from train.model.specs import TaskSpec

FLOW = ("density", "pressure", "velocity_x", "velocity_y")
SPECS_MIX = {
    "adv": TaskSpec((32,), 1, 1, 8, 3, True, fields=("tracer",)),
    "flow2d": TaskSpec((16, 16), 4, 4, 4, 2, True, fields=FLOW),
    "flow3d": TaskSpec((8, 8, 8), 5, 5, 4, 2, True, fields=(*FLOW, "velocity_z")),
    "darcy": TaskSpec((16, 16), 1, 1, 4, 1, False, fields=("permeability", "pressure")),
}
SMALL = MultiphysicsConfig(d_model=16, n_heads=2, n_layers=2, field_width=4)


def inputs(specs: dict[str, TaskSpec], batch: int = 2, scale: float = 1.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        name: torch.randn(batch, *([s.initial_step] if s.autoregressive else []), *s.grid, s.in_channels) * scale
        for name, s in specs.items()
    }


def model(specs=SPECS_MIX, cfg=SMALL, seed: int = 0) -> MultiPhysicsSurrogate:
    torch.manual_seed(seed)
    return build_model(specs, ModelConfig(name="multiphysics", multiphysics=cfg))


def test_one_processor_predicts_1d_2d_3d_and_steady_tasks_with_no_weights_of_its_own_per_task():
    net = model()
    x = inputs(SPECS_MIX)
    check_outputs(net(x), x, SPECS_MIX, "multiphysics")  # every task, in the contract's shape, finite
    assert net.vocabulary == sorted({*FLOW, "velocity_z", "tracer", "permeability"})
    # Rows by field, projections by patch geometry, one processor: nothing is named after a task.
    assert not [n for n, _ in net.named_parameters() if any(task in n for task in SPECS_MIX)]
    assert sorted(net.patch_in) == ["1d_p8", "2d_p4", "3d_p4"]


@pytest.mark.parametrize("task", list(SPECS_MIX))
def test_every_parameter_gets_a_gradient_whichever_task_runs(task):
    """What lets ranks that drew different datasets reduce the same gradients (DDP without the unused-parameter
    search, FSDP/HSDP at all)."""
    net = model()
    net({task: inputs(SPECS_MIX)[task]})[task].square().mean().backward()
    assert [n for n, p in net.named_parameters() if p.grad is None] == []


def test_a_field_named_by_two_tasks_is_one_row_that_both_train():
    net = model()
    rows = {n: getattr(net, f"rows_in_{n}").tolist() for n in ("flow2d", "flow3d")}
    assert rows["flow2d"] == rows["flow3d"][:4], "density, pressure, velocity_x, velocity_y: the same rows"
    with torch.no_grad():  # as after a first step (the decoder starts at zero: the identity map)
        net.field_out.normal_()
    net({"flow3d": inputs(SPECS_MIX)["flow3d"]})["flow3d"].square().mean().backward()
    pressure = net.vocabulary.index("pressure")
    assert net.field_in.grad[pressure].abs().sum() > 0, "the 3D task trains the row the 2D task reads"
    assert net.field_in.grad[net.vocabulary.index("tracer")].abs().sum() == 0, "a field it has not: untouched"


def test_a_time_dependent_prediction_starts_as_the_last_frame_and_steps_in_the_samples_own_units():
    net = model()
    x = inputs(SPECS_MIX, scale=1000.0)["flow2d"] + 5.0
    with torch.no_grad():
        torch.testing.assert_close(net({"flow2d": x})["flow2d"], x[:, -1], rtol=0, atol=1e-3)  # decoder starts at 0
        net.field_out[:, -1] = 1.0  # a step of one (normalised) unit in every field
        step = net({"flow2d": x})["flow2d"] - x[:, -1]
    # ... is one standard deviation of that sample's channel over its input window: the normalisation reversed
    std = (x.var(dim=(1, 2, 3), unbiased=False) + SMALL.std_floor**2).sqrt()
    torch.testing.assert_close(step, std[:, None, None, :].expand_as(step), rtol=1e-4, atol=1e-3)
    assert std.min() > 100, "per sample: the inputs' scale of 1000 comes back"


def test_the_model_table_checks_patches_frames_and_dimensions():
    cfg = ModelConfig(name="multiphysics", multiphysics=MultiphysicsConfig(max_frames=4, d_model=16, n_heads=2))
    problems = check_builtin({"a": TaskSpec((30,), 1, 1, 8, 2, True), "b": TaskSpec((16,), 1, 1, 4, 6, True)}, cfg)
    assert any("tasks.a.patch_size=8 must divide the strided grid (30,)" in p for p in problems)
    assert any("tasks.b.initial_step=6 is more than model.multiphysics.max_frames=4" in p for p in problems)


# ------------------------------------------------------------------------------------------- fine-tuning
def _save(tmp_path: Path, net, specs: dict[str, TaskSpec], cfg: Config) -> dict:
    from train.engine.init_from import sha256_of

    folder = tmp_path / "source"
    folder.mkdir()
    path = save_best(folder, {MODEL: net.state_dict(), CONFIG: cfg.model_dump(mode="json"),
                              SPECS: {n: s.as_dict() for n, s in specs.items()}})  # fmt: skip
    return {"source": str(path), "checkpoint": str(path), "sha256": sha256_of(path)}


def _config(specs: dict[str, TaskSpec], cfg: MultiphysicsConfig = SMALL, extra: dict | None = None) -> Config:
    tasks = {name: TaskConfig(pde="advection1d") for name in specs}
    return Config(tasks=tasks, model=ModelConfig(name="multiphysics", multiphysics=cfg), **(extra or {}))


def test_fine_tuning_onto_an_unseen_dataset_reuses_the_rows_of_known_fields_and_starts_new_ones_fresh(tmp_path):
    from train.engine.init_from import load_initial_weights

    pretrain = {k: SPECS_MIX[k] for k in ("flow2d", "darcy")}
    source = model(pretrain, seed=1)
    record = _save(tmp_path, source, pretrain, _config(pretrain))
    # A 1D flow with a field the mix never saw: known names, a new name, a new patch geometry
    unseen = {"flow1d": TaskSpec((32,), 4, 3, 8, 2, True, fields=("density", "pressure", "velocity_x", "salinity"))}
    target = model(unseen, seed=2)
    fresh = {k: v.clone() for k, v in target.state_dict().items()}
    done = load_initial_weights(target, _config(unseen), record)
    assert done["new_fields"] == ["salinity"] and done["new_geometries"] == ["1d_p8"] and done["fresh_tasks"] == []
    theirs, ours = source.state_dict(), target.state_dict()
    for name in ("density", "pressure", "velocity_x"):
        for table in ("field_in", "field_out"):
            i, j = source.vocabulary.index(name), target.vocabulary.index(name)
            assert torch.equal(ours[table][j], theirs[table][i]), (name, table)
    new = target.vocabulary.index("salinity")
    assert torch.equal(ours["field_in"][new], fresh["field_in"][new])
    assert torch.equal(ours["patch_in.1d_p8.weight"], fresh["patch_in.1d_p8.weight"])
    for key in ("blocks.0.space.qkv.weight", "blocks.1.mlp.1.weight", "frame", "dimension"):
        assert torch.equal(ours[key], theirs[key]), key
    assert "patch_in.2d_p4.weight" not in ours, "the source's 2D projections are left out"


# ------------------------------------------------------------------------------------------- field names
def _info(pde: str, autoregressive=True, in_channels=1, out_channels=1, channels=()) -> CacheInfo:
    return CacheInfo(Path("/nonexistent"), pde, autoregressive, (16,), 9, in_channels, out_channels, {},
                     (0.0,), (1.0,), (0.0,), (1.0,), {}, channels=channels)  # fmt: skip


@pytest.mark.parametrize(
    ("pde", "info", "names"),
    [
        ("cfd2d", _info("cfd2d", True, 4, 4), ("density", "pressure", "velocity_x", "velocity_y")),
        ("advection1d", _info("advection1d"), ("advection1d/tensor",)),
        ("darcy2d", _info("darcy2d", False), ("darcy2d/nu", "darcy2d/tensor")),
        ("diffreact2d", _info("diffreact2d", True, 2, 2), ("diffreact2d/data_0", "diffreact2d/data_1")),
        ("pdearena_ns", _info("pdearena_ns", True, 3, 3), ("pdearena_ns/u", "velocity_x", "velocity_y")),
        ("well", _info("well", True, 3, 2, ("velocity_x", "A", "F")), ("velocity_x", "well/A", "well/F")),
    ],
)
def test_a_tasks_field_names_come_from_its_format(pde, info, names):
    task = TaskConfig(pde=pde, **({"well": {"n_steps_input": 2}} if pde == "well" else {}))
    assert task_fields("t", task, info) == names


def test_field_names_that_do_not_fit_the_channels_are_refused_naming_the_task():
    info = _info("cfd2d", True, 4, 4)
    with pytest.raises(ConfigError, match=r"tasks\.flow\.fields names 3 field\(s\); the data has 4 channel\(s\)"):
        task_fields("flow", TaskConfig(pde="cfd2d", fields=["density", "pressure", "u"]), info)
    with pytest.raises(ConfigError, match=r"tasks\.flow\.fields names pressure more than once"):
        task_fields("flow", TaskConfig(pde="cfd2d", fields=["density", "pressure", "pressure", "v"]), info)
    # a steady task may name one field on both sides (Burgers' velocity at t=0 -> at t=1)
    steady = _info("fno_burgers", False)
    assert task_fields("b", TaskConfig(pde="fno_burgers", fields=["velocity_x"] * 2), steady) == ("velocity_x",) * 2
    with pytest.raises(ConfigError, match=r"tasks\.flow\.fields.*field name 'wind speed'"):
        load_config("configs/tiny.yaml", ["tasks.flow.pde=cfd2d", "tasks.flow.fields=[wind speed]"])


# ------------------------------------------------------------------------------------------- the mix
def test_a_mix_that_trains_a_held_out_dataset_or_draws_nothing_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"tasks\.darcy2d is named in train\.held_out"):
        load_config("configs/tiny.yaml", ["train.held_out=[darcy2d]"])
    zero = ["tasks.advection1d.sampling_weight=0", "tasks.darcy2d.sampling_weight=0"]
    with pytest.raises(ConfigError, match=r"every task's sampling_weight is 0 \(tasks\.advection1d, tasks\.darcy2d"):
        load_config("configs/tiny.yaml", ["train.task_sampling=weighted", *zero])
    load_config("configs/tiny.yaml", ["train.task_sampling=weighted", zero[0]])  # one left to draw: fine


# ------------------------------------------------------------------------------------------- fine-tuning's recipe
def test_learning_rate_groups_reach_the_optimizer_by_the_models_group_names_or_prefixes():
    from train.config import TrainConfig
    from train.engine.optim import build_optimizer
    from train.engine.param_groups import optimizer_groups

    net = model()
    groups = optimizer_groups(net, {"trunk": 0.1, "field_in": 2.0}, 1e-3)
    optimizer, scheduler = build_optimizer(groups, TrainConfig(lr=1e-3, warmup_steps=0), 10)
    by_lr = {round(g["lr"], 12): {n for n, p in net.named_parameters() if any(p is q for q in g["params"])}
             for g in optimizer.param_groups}  # fmt: skip
    assert set(by_lr) == {1e-4, 2e-3, 1e-3}
    assert by_lr[1e-4] == {n for n, _ in net.named_parameters() if n.startswith(("blocks.", "frame", "dimension"))}
    assert by_lr[2e-3] == {"field_in"} and "field_out" in by_lr[1e-3] and "patch_in.1d_p8.weight" in by_lr[1e-3]
    scheduler.step()  # every group follows the one schedule
    assert sorted(g["lr"] for g in optimizer.param_groups) == pytest.approx(sorted(scheduler.get_last_lr()))
    with pytest.raises(ConfigError, match=r"train.lr_groups: 'trunks' matches no parameter .*groups: decoders, "):
        optimizer_groups(net, {"trunks": 0.1}, 1e-3)


@pytest.mark.parametrize("output", ["state", "increment"])
def test_zeroed_output_rows_start_fine_tuning_at_repeat_the_last_frame_exactly_and_learn(tmp_path, output):
    """train.init_reset={field_out: zero}: the source's output rows (trained to mean other things) are not carried
    over; the fine-tuned model starts where training from scratch does, the last input frame, exactly, and its
    rows get a gradient. Zeroing the whole decoders gave none (a zero projection feeding zero rows): refused."""
    from train.engine.init_from import load_initial_weights

    cfg = MultiphysicsConfig(d_model=16, n_heads=2, n_layers=2, field_width=4, output=output)
    pretrain = {k: SPECS_MIX[k] for k in ("flow2d", "darcy")}
    source = model(pretrain, cfg, seed=1)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.1 * torch.randn_like(p))  # trained: every weight, the decoders' too, away from its start
    record = _save(tmp_path, source, pretrain, _config(pretrain, cfg))
    x = inputs({"flow2d": pretrain["flow2d"]}, scale=3.0)["flow2d"]
    for reset, exact in (({}, False), ({"field_out": "zero"}, True)):
        target = model(pretrain, cfg, seed=2)
        load_initial_weights(target, _config(pretrain, cfg, {"train": {"init_reset": reset}}), record)
        prediction = target({"flow2d": x})["flow2d"]
        assert torch.equal(prediction.detach(), x[:, -1]) is exact, reset
        (prediction - x[:, -1] - 1.0).square().mean().backward()
        assert target.field_out.grad.abs().sum() > 0, reset
    with pytest.raises(ConfigError, match=r"'zero' on patch_out\..* without a gradient.*\{field_out: zero\}"):
        load_initial_weights(target, _config(pretrain, cfg, {"train": {"init_reset": {"decoders": "zero"}}}), record)


def test_an_increment_keeps_a_field_constant_over_its_window_constant():
    """output=increment: a uniform velocity stays exactly uniform (its window's steps are zero); with state, it
    drifts by the decoder's output times the std floor (the drift that once dominated a fine-tuning score)."""
    spec = {"flow2d": SPECS_MIX["flow2d"]}
    x = inputs(spec)["flow2d"]
    x[..., 2] = 0.003  # velocity_x: constant in space and time
    for output, constant in (("state", False), ("increment", True)):
        net = model(spec, MultiphysicsConfig(d_model=16, n_heads=2, n_layers=2, field_width=4, output=output))
        with torch.no_grad():
            net.field_out.normal_()  # a decoder that predicts something
            y = net({"flow2d": x})["flow2d"]
        assert bool((y[..., 2] == x[:, -1, ..., 2]).all()) is constant, output
        assert not torch.equal(y[..., 0], x[:, -1, ..., 0]), "the changing field is predicted"


def test_learning_rate_groups_survive_a_resume_bitwise(tmp_path):
    """A run with train.lr_groups stopped after 2 steps and resumed from its checkpoint's components ends its 4th
    step with the weights and per-group rates of the run that went straight through."""
    from tests.helpers import local_trainer, prepare_run
    from train.engine.streams import EpochStreams

    settings = ["model.name=multiphysics", "model.multiphysics.d_model=16", "model.multiphysics.n_heads=2",
                "model.multiphysics.n_layers=1", "train.lr_groups={trunk: 0.1, decoders: 3.0}",
                "train.warmup_steps=1", "train.steps_per_epoch=4", "train.epochs=1"]  # fmt: skip
    run = prepare_run(tmp_path, "configs/tiny.yaml", settings)

    def steps(trainer, n: int) -> None:
        streams = EpochStreams(trainer.loaders, trainer.samplers, 0, trainer.state.step_in_epoch, trainer.steps, None)
        for _ in range(n):
            trainer.train_step(streams)
            trainer.state.step_in_epoch += 1
            trainer.state.global_step += 1
        trainer.stop_workers()

    straight = local_trainer(run)
    steps(straight, 4)
    first = local_trainer(run)
    steps(first, 2)
    saved = first.state_dict()
    resumed = local_trainer(run)
    resumed.load_state_dict(saved)
    steps(resumed, 2)
    assert len(resumed.optimizer.param_groups) == 3
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [g["lr"] for g in straight.optimizer.param_groups]
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
