"""Tests of the typed config: defaults, YAML files, ``--set`` overrides, error messages, round trips."""

from __future__ import annotations

import re

import pydantic
import pytest
import yaml

from train.checkpoint import CONFIG, model_differences
from train.config import (
    ArraysConfig,
    CompileConfig,
    Config,
    ConvConfig,
    DataConfig,
    DatasetFilesConfig,
    DistConfig,
    FNOConfig,
    KubernetesConfig,
    ModelConfig,
    MultiphysicsConfig,
    ObsConfig,
    ResNetConfig,
    RunConfig,
    Section,
    SkyPilotConfig,
    SlurmConfig,
    TaskConfig,
    TrainConfig,
    TransformerConfig,
    UNetConfig,
    WandbConfig,
    WellConfig,
    apply_override,
    load_config,
    model_keys_in_use,
    run_identity,
    to_yaml,
    training_differences,
)
from train.errors import ConfigError

MINIMAL = """\
tasks:
  adv:
    pde: advection1d
    batch_size: 8
  darcy:
    pde: darcy2d
    patch_size: 4
"""


def _write(path, text):
    path.write_text(text)
    return path


@pytest.fixture
def minimal(tmp_path):
    return _write(tmp_path / "minimal.yaml", MINIMAL)


# -------------------------------------------------------------------------------------------- defaults
def test_shipped_default_config_loads(repo):
    cfg = load_config(repo / "configs" / "default.yaml")
    raw = yaml.safe_load((repo / "configs" / "default.yaml").read_text())
    assert set(cfg.tasks) == set(raw["tasks"])
    for name, task in raw["tasks"].items():
        for key, value in task.items():
            assert getattr(cfg.tasks[name], key) == value, f"tasks.{name}.{key}"
    assert cfg.model.name == raw["model"]["name"] and cfg.model.fno.width == raw["model"]["fno"]["width"]
    assert cfg.train.epochs == raw["train"]["epochs"]
    assert cfg.train.lr == pytest.approx(float(raw["train"]["lr"]))
    assert cfg.run.name == "default"  # the file stem


def test_code_defaults_fill_what_the_file_leaves_out(minimal):
    cfg = load_config(minimal)
    # values the file does not set come from the schema's defaults
    assert cfg.model == ModelConfig()
    assert cfg.train == TrainConfig()
    assert cfg.dist == DistConfig()
    assert cfg.run.runs_dir == RunConfig().runs_dir
    assert cfg.train.lr == 1e-3
    assert cfg.train.weight_decay == 1e-4
    assert cfg.dist.nproc == "auto"
    assert cfg.tasks["adv"].batch_size == 8
    assert cfg.tasks["adv"].patch_size == TaskConfig.model_fields["patch_size"].default
    assert cfg.tasks["darcy"].patch_size == 4
    assert cfg.tasks["darcy"].test_fraction == 0.1


def test_no_file_needs_tasks_from_overrides():
    with pytest.raises(ConfigError, match="missing required key 'tasks'"):
        load_config(None)
    cfg = load_config(None, ["tasks.a.pde=burgers1d"])
    assert cfg.tasks["a"].pde == "burgers1d"
    assert cfg.run.name is None  # no file: no stem to default to


def test_empty_file_is_defaults_only(tmp_path):
    path = _write(tmp_path / "empty.yaml", "")
    with pytest.raises(ConfigError, match="missing required key 'tasks'"):
        load_config(path)
    cfg = load_config(path, ["tasks.a.pde=darcy2d"])
    assert cfg.run.name == "empty"


# ------------------------------------------------------------------------------------------- overrides
def test_yaml_file_overrides_defaults(tmp_path):
    path = _write(
        tmp_path / "c.yaml",
        MINIMAL
        + "model:\n  d_model: 64\n  n_heads: 8\ntrain:\n  epochs: 7\n  lr: 2.0e-4\ncompile:\n  enabled: false\n",
    )
    cfg = load_config(path)
    assert cfg.model.transformer.d_model == 64
    assert cfg.model.transformer.n_heads == 8
    assert cfg.model.transformer.n_layers == ModelConfig().transformer.n_layers
    assert cfg.train.epochs == 7
    assert cfg.train.lr == 2e-4
    assert cfg.compile.enabled is False


def test_set_overrides_win_over_the_file(minimal):
    cfg = load_config(
        minimal,
        ["train.lr=5e-4", "train.epochs=3", "tasks.adv.batch_size=2", "compile.enabled=true", "tasks.new.pde=cfd1d"],
    )
    assert cfg.train.lr == 5e-4
    assert isinstance(cfg.train.lr, float)
    assert cfg.train.epochs == 3
    assert cfg.tasks["adv"].batch_size == 2
    assert cfg.tasks["adv"].pde == "advection1d"  # siblings of an overridden key stay
    assert cfg.compile.enabled is True
    assert cfg.tasks["new"].pde == "cfd1d"
    assert list(cfg.tasks) == ["adv", "darcy", "new"]


@pytest.mark.parametrize(
    ("raw", "value", "kind"),
    [
        ("1e-3", 1e-3, float),  # PyYAML alone reads this as a string
        ("1E+2", 100.0, float),
        ("2.5e-4", 2.5e-4, float),
        ("1.0e-3", 1e-3, float),
        ("0.5", 0.5, float),
        (".5", 0.5, float),
        ("-3.", -3.0, float),
        ("3", 3, int),
        ("-7", -7, int),
        ("true", True, bool),
        ("false", False, bool),
        ("auto", "auto", str),
        ("some/path.h5", "some/path.h5", str),
        ("null", None, type(None)),
    ],
)
def test_override_values_are_typed_as_yaml(raw, value, kind):
    tree: dict = {"train": {"epochs": 1}}
    apply_override(tree, f"train.x={raw}")
    assert type(tree["train"]["x"]) is kind
    assert tree["train"]["x"] == value
    assert tree["train"]["epochs"] == 1


def test_override_builds_nested_sections():
    tree: dict = {}
    apply_override(tree, "tasks.a.pde=darcy2d")
    apply_override(tree, "tasks.a.patch_size=4")
    assert tree == {"tasks": {"a": {"pde": "darcy2d", "patch_size": 4}}}


@pytest.mark.parametrize("bad", ["train.epochs", "=3", "  =3"])
def test_override_without_key_or_value_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        apply_override({}, bad)


def test_override_into_a_value_is_a_config_error():
    tree = {"train": {"epochs": 3}}
    with pytest.raises(ConfigError, match=r"train\.epochs is a value, not a section"):
        apply_override(tree, "train.epochs.x=1")


def test_override_with_bad_yaml_is_a_config_error():
    with pytest.raises(ConfigError, match="not valid YAML"):
        apply_override({}, "train.lr=[1, 2")


@pytest.mark.parametrize("raw", ["-e1", ".e3", "+E2"])
def test_override_with_exponent_only_scalar_is_a_string(raw):
    tree: dict = {}
    apply_override(tree, f"run.name={raw}")
    assert tree == {"run": {"name": raw}}


def test_config_file_with_exponent_only_scalar_loads(tmp_path):
    path = _write(tmp_path / "c.yaml", MINIMAL + "run:\n  name: -e1\n")
    assert load_config(path).run.name == "-e1"


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("override", "bad", "suggestion"),
    [
        ("train.epoch=3", "train.epoch", "train.epochs"),
        ("tasks.adv.batchsize=3", "tasks.adv.batchsize", "tasks.adv.batch_size"),
        ("model.transformer.d_modle=64", "model.transformer.d_modle", "model.transformer.d_model"),
        ("run.cache_dri=x", "run.cache_dri", "run.cache_dir"),
        ("dist.backnd=gloo", "dist.backnd", "dist.backend"),
    ],
)
def test_unknown_key_names_full_path_and_nearest_key(minimal, override, bad, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config(minimal, [override])
    msg = str(e.value)
    assert f"unknown key '{bad}'" in msg
    assert f"did you mean '{suggestion}'" in msg
    assert str(minimal) in msg
    assert e.value.exit_code == 2


@pytest.mark.parametrize(("old", "new"), [("train.compile", "compile.enabled"), ("train.compile_mode", "compile.mode")])
def test_moved_key_says_where_it_went(minimal, old, new):
    with pytest.raises(ConfigError, match=rf"unknown key '{old}' \(moved: use '{new}'\)"):
        load_config(minimal, [f"{old}=default"])


def test_unknown_key_without_a_close_match_lists_the_keys_of_its_section(minimal):
    with pytest.raises(ConfigError) as e:
        load_config(minimal, ["train.zzzzqqq=1"])
    assert "unknown key 'train.zzzzqqq'" in str(e.value)
    assert "did you mean" not in str(e.value)
    assert f"(the keys of train are: {', '.join(TrainConfig.model_fields)})" in str(e.value)
    with pytest.raises(ConfigError, match=r"the keys of tasks\.adv are: pde, source, "):
        load_config(minimal, ["tasks.adv.qqqzzz=1"])
    with pytest.raises(ConfigError, match=r"the keys of the top level are: tasks, model, "):
        load_config(minimal, ["qqqzzz.x=1"])


def test_an_error_in_an_override_names_the_override_not_the_file(minimal):
    with pytest.raises(ConfigError) as e:
        load_config(minimal, ["train.log_every=3", "train.epochs=abc"])
    first_line = str(e.value).splitlines()[0]
    assert first_line == f"--set train.epochs=abc: invalid override of {minimal}:"
    # A file's own error stays the file's; an override's beside it is marked as such.
    path = _write(minimal.parent / "bad.yaml", MINIMAL + "model:\n  dropout: high\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["train.epochs=abc"])
    assert str(e.value).startswith(f"{path}: invalid config:")
    assert "'train.epochs': Input should be a valid integer (got 'abc') (set by --set train.epochs=abc)" in str(e.value)
    assert "'model.transformer.dropout'" in str(e.value) and "high') (set by" not in str(e.value)


def test_a_problem_of_several_keys_that_an_override_caused_names_the_override(minimal):
    """A check across sections (a held-out dataset that is also a task) names no one key: it was blamed on the
    file ("configs/x.yaml: invalid config") though the file alone was valid."""
    with pytest.raises(ConfigError) as e:
        load_config(minimal, ["train.log_every=3", "train.held_out=[adv]"])
    assert str(e.value).startswith(
        f"--set train.log_every=3, --set train.held_out=[adv]: invalid override of {minimal}:"
    )
    assert "tasks.adv is named in train.held_out" in str(e.value)


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    path = _write(tmp_path / "c.yaml", MINIMAL + "train:\n  epochs: 2\nmodel:\n  name: fno\ntrain:\n  lr: 0.001\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"{path}: 'train' appears twice, at line 8 and line 12" in str(e.value)
    assert e.value.exit_code == 2
    nested = _write(tmp_path / "d.yaml", MINIMAL.replace("batch_size: 8", "batch_size: 8\n    batch_size: 4"))
    with pytest.raises(ConfigError, match=r"'tasks\.adv\.batch_size' appears twice, at line 4 and line 5"):
        load_config(nested)
    with pytest.raises(ConfigError, match=r"override 'model\.fno=\{modes: 4, modes: 8\}'.*'modes' appears twice"):
        load_config(None, ["model.fno={modes: 4, modes: 8}"])


def test_unknown_section_in_file(tmp_path):
    path = _write(tmp_path / "c.yaml", MINIMAL + "trian:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trian' \(did you mean 'train'\?\)"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("train.epochs=abc", "train.epochs"),
        ("train.epochs=2.5", "train.epochs"),
        ("train.epochs=true", "train.epochs"),  # strict: a bool is not an int
        ("tasks.adv.batch_size=x", "tasks.adv.batch_size"),
        ("compile.enabled=maybe", "compile.enabled"),  # a union: the key, not 'compile.enabled.bool'
        ("model.dropout=high", "model.transformer.dropout"),
        ("tasks.darcy.pde=heat", "tasks.darcy.pde"),
        ("run.name=3", "run.name"),
    ],
)
def test_wrong_type_names_the_key(minimal, override, key):
    with pytest.raises(ConfigError) as e:
        load_config(minimal, [override])
    msg = str(e.value)
    assert f"'{key}'" in msg
    assert f"'{key}." not in msg  # no union member or other internal suffix
    assert e.value.exit_code == 2


def test_out_of_range_value_names_the_key(minimal):
    with pytest.raises(ConfigError, match=r"'train\.lr'"):
        load_config(minimal, ["train.lr=0"])
    with pytest.raises(ConfigError, match=r"'tasks\.adv\.patch_size'"):
        load_config(minimal, ["tasks.adv.patch_size=0"])


def test_missing_task_pde_is_reported(minimal):
    with pytest.raises(ConfigError, match=r"missing required key 'tasks\.extra\.pde'"):
        load_config(minimal, ["tasks.extra.batch_size=3"])


def test_missing_config_file(tmp_path):
    path = tmp_path / "nope" / "absent.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value)
    assert "not found" in str(e.value)
    assert e.value.exit_code == 2


def test_config_path_that_is_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)


def test_bad_yaml(tmp_path):
    path = _write(tmp_path / "bad.yaml", "tasks:\n  adv: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value)
    assert "not valid YAML" in str(e.value)
    assert e.value.exit_code == 2


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("just a string\n", "str"), ("3\n", "int")])
def test_top_level_not_a_mapping(tmp_path, text, kind):
    path = _write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "top level must be a mapping" in str(e.value)
    assert kind in str(e.value)
    assert str(path) in str(e.value)


def test_d_model_must_be_a_multiple_of_n_heads(minimal):
    with pytest.raises(ConfigError) as e:
        load_config(minimal, ["model.d_model=30", "model.n_heads=4"])
    msg = str(e.value)
    assert "model.transformer.d_model (30)" in msg
    assert "model.transformer.n_heads (4)" in msg
    assert load_config(minimal, ["model.d_model=32", "model.n_heads=4"]).model.transformer.n_heads == 4


def test_the_transformers_old_keys_move_into_its_section(tmp_path, minimal):
    """model.d_model and the other transformer keys of older configs, overrides and checkpoints still work."""
    old = load_config(minimal, ["model.d_model=64", "model.dropout=0.1"])
    assert (old.model.transformer.d_model, old.model.transformer.dropout) == (64, 0.1)
    path = _write(tmp_path / "old.yaml", MINIMAL + "model:\n  n_layers: 2\n")
    assert load_config(path).model.transformer.n_layers == 2
    assert load_config(path, ["model.n_layers=3"]).model.transformer.n_layers == 3  # an override is later
    both = _write(tmp_path / "both.yaml", MINIMAL + "model:\n  n_layers: 2\n  transformer:\n    n_layers: 3\n")
    with pytest.raises(ConfigError, match=r"model.n_layers=2 and model.transformer.n_layers=3 disagree"):
        load_config(both)
    assert model_differences({CONFIG: {"model": {"name": "transformer", "d_model": 64}}},
                             {"name": "transformer", "transformer": {"d_model": 32}}, {}) == [
        "model.transformer.d_model (64 there, 32 here)"
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["bad-name", "1task", "_hidden", "a.b"])
def test_invalid_task_name(tmp_path, name):
    path = _write(tmp_path / "c.yaml", f"tasks:\n  '{name}':\n    pde: darcy2d\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"task name {name!r}" in str(e.value)


@pytest.mark.parametrize("name", ["a", "Adv1", "adv_1d"])
def test_valid_task_names(tmp_path, name):
    path = _write(tmp_path / "c.yaml", f"tasks:\n  {name}:\n    pde: darcy2d\n")
    assert list(load_config(path).tasks) == [name]


def test_fractions_must_leave_training_samples(minimal):
    with pytest.raises(ConfigError, match=r"tasks\.adv: test_fraction \+ val_fraction"):
        load_config(minimal, ["tasks.adv.test_fraction=0.5", "tasks.adv.val_fraction=0.45"])
    cfg = load_config(minimal, ["tasks.adv.test_fraction=0.5", "tasks.adv.val_fraction=0.3"])
    assert cfg.tasks["adv"].val_fraction == 0.3


def test_empty_task_mapping_is_rejected(tmp_path):
    path = _write(tmp_path / "c.yaml", "tasks: {}\n")
    with pytest.raises(ConfigError, match="'tasks'"):
        load_config(path)


# -------------------------------------------------------------------------------------------- run name
def test_run_name_defaults_to_file_stem(tmp_path):
    path = _write(tmp_path / "my_experiment.v2.yaml", MINIMAL)
    assert load_config(path).run.name == "my_experiment.v2"


def test_run_name_from_file_wins_over_stem(tmp_path):
    path = _write(tmp_path / "stem.yaml", MINIMAL + "run:\n  name: from_file\n  seed: 4\n")
    cfg = load_config(path)
    assert cfg.run.name == "from_file"
    assert cfg.run.seed == 4


def test_run_name_argument_wins(tmp_path):
    path = _write(tmp_path / "stem.yaml", MINIMAL + "run:\n  name: from_file\n  seed: 4\n")
    cfg = load_config(path, ["run.name=from_set"], run_name="from_arg")
    assert cfg.run.name == "from_arg"
    assert cfg.run.seed == 4  # the rest of the run section survives
    assert load_config(path, ["run.name=from_set"]).run.name == "from_set"
    assert load_config(path, run_name="x").run.name == "x"


# ---------------------------------------------------------------------------------------- differences
def test_training_differences_ignore_runtime_settings(minimal):
    a = load_config(minimal)
    b = load_config(
        minimal,
        [
            "dist.nproc=4",
            "dist.backend=gloo",
            "dist.timeout_s=60",
            "run.name=other",
            "run.runs_dir=/elsewhere",
            "run.cache_dir=/other/cache",
            "train.num_workers=3",
            "train.log_every=1",
            "train.eval_batch_size=7",
            "run.remote=b2://bucket/runs",
            "run.remote_wait_s=30",
            "obs.wandb.mode=offline",
            "obs.wandb.project=other",
        ],
    )
    assert a != b
    assert training_differences(a, b) == []


def test_settings_of_a_model_not_in_use_are_no_training_difference(minimal):
    transformer = load_config(minimal)
    assert (
        training_differences(transformer, load_config(minimal, ["model.fno.width=8", "model.unet.init_features=4"]))
        == []
    )
    fno = load_config(minimal, ["model.name=fno"])
    assert training_differences(fno, load_config(minimal, ["model.name=fno", "model.d_model=32"])) == []
    assert training_differences(fno, load_config(minimal, ["model.name=fno", "model.fno.width=8"])) == [
        "model.fno.width"
    ]
    assert training_differences(transformer, fno) == ["model.name"]
    assert model_keys_in_use("fno") == ("name", "fno")
    assert model_keys_in_use("transformer") == ("name", "transformer")
    assert model_keys_in_use("my.pkg:build") == ("name", "args")


def test_rollout_steps_are_a_training_difference_only_under_a_rollout_objective(minimal):
    one_step = load_config(minimal)
    assert training_differences(one_step, load_config(minimal, ["train.rollout_steps=7"])) == []
    pushforward = load_config(minimal, ["train.objective=pushforward"])
    assert training_differences(
        pushforward, load_config(minimal, ["train.objective=pushforward", "train.rollout_steps=7"])
    ) == ["train.rollout_steps"]
    assert training_differences(one_step, pushforward) == ["train.objective"]


def test_rollout_objectives_need_true_inputs_and_two_frames(minimal):
    assert load_config(minimal, ["train.objective=unrolled"]).train.rollout_steps == 4
    with pytest.raises(ConfigError, match="rollout_steps"):
        load_config(minimal, ["train.objective=pushforward", "train.rollout_steps=1"])
    with pytest.raises(ConfigError, match=r"train\.objective=pushforward feeds the model its own predictions"):
        load_config(minimal, ["train.objective=pushforward", "tasks.adv.latent_encoder=old.pt"])


def test_training_differences_report_seed(minimal):
    a = load_config(minimal)
    b = load_config(minimal, ["run.seed=9"])
    assert training_differences(a, b) == ["run.seed"]


def test_training_differences_report_training_keys(minimal):
    a = load_config(minimal)
    b = load_config(minimal, ["train.lr=2e-3", "tasks.adv.batch_size=4", "model.n_layers=2", "train.num_workers=2"])
    assert training_differences(a, b) == ["model.transformer.n_layers", "tasks.adv.batch_size", "train.lr"]
    assert training_differences(b, a) == ["model.transformer.n_layers", "tasks.adv.batch_size", "train.lr"]
    assert training_differences(a, a) == []


def test_training_differences_report_added_task(minimal):
    a = load_config(minimal)
    b = load_config(minimal, ["tasks.extra.pde=burgers1d"])
    diff = training_differences(a, b)
    assert "tasks.extra.pde" in diff
    assert "tasks.extra.batch_size" in diff
    assert all(k.startswith("tasks.extra.") for k in diff)


# ------------------------------------------------------------------------------------------ round trip
def test_to_yaml_round_trips(tmp_path, minimal):
    cfg = load_config(
        minimal,
        ["train.lr=2.5e-4", "train.weight_decay=1e-10", "compile.enabled=false", "dist.nproc=3", "tasks.adv.seed=7"],
        run_name="named",
    )
    text = to_yaml(cfg)
    assert isinstance(yaml.safe_load(text), dict)
    again = load_config(_write(tmp_path / "dumped.yaml", text))
    assert again == cfg
    assert again.train.weight_decay == 1e-10
    assert again.run.name == "named"  # the dumped name, not the new file's stem


def test_to_yaml_round_trips_shipped_configs(tmp_path, repo):
    for name in ("default", "tiny", "well"):
        cfg = load_config(repo / "configs" / f"{name}.yaml")
        again = load_config(_write(tmp_path / f"x_{name}.yaml", to_yaml(cfg)))
        assert again == cfg


# --------------------------------------------------------------------------------------- documentation
def test_every_field_is_documented():
    def below(cls):
        return {c for sub in cls.__subclasses__() for c in (sub, *below(sub))}

    sections = {c for c in below(Section) if not c.__name__.startswith("_")}
    assert sections == {
        TaskConfig,
        ArraysConfig,
        DatasetFilesConfig,
        WellConfig,
        ModelConfig,
        TransformerConfig,
        MultiphysicsConfig,
        FNOConfig,
        UNetConfig,
        ConvConfig,
        ResNetConfig,
        TrainConfig,
        CompileConfig,
        DistConfig,
        DataConfig,
        RunConfig,
        SlurmConfig,
        SkyPilotConfig,
        KubernetesConfig,
        WandbConfig,
        ObsConfig,
        Config,
    }
    for section in sections:
        assert section.model_fields, section
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no docstring"
            assert len(field.description.strip()) > 5


def test_sections_are_frozen(minimal):
    cfg = load_config(minimal)
    with pytest.raises(Exception, match="frozen"):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_a_well_task_takes_its_history_from_n_steps_input_and_refuses_pdebench_settings():
    base = {"pde": "well", "source": "/data/x", "well": {"n_steps_input": 3}}
    assert TaskConfig.model_validate(base).initial_step == 3
    for extra, message in (
        ({"initial_step": 5}, "initial_step=5 contradicts well.n_steps_input=3"),
        ({"temporal_stride": 2}, "a Well task strides time with well.dt_stride"),
        ({"well": {"dataset": "x"}}, "well.dataset and well.base_path go together"),
    ):
        with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
            TaskConfig.model_validate({**base, **extra})
    with pytest.raises(pydantic.ValidationError, match="pde: well needs a 'well' section"):
        TaskConfig.model_validate({"pde": "well", "source": "/data/x"})
    with pytest.raises(pydantic.ValidationError, match="'well' settings are for pde: well"):
        TaskConfig.model_validate({"pde": "advection1d", "well": {}})


def test_a_runs_identity_reads_the_transformers_keys_either_way_and_fine_tuning_changes_it(minimal):
    """The remote's tags: old and new spellings of one run are one run; a fine-tuned run is another."""
    new = load_config(minimal, ["model.transformer.d_model=64"])
    assert run_identity(new) == run_identity(load_config(minimal, ["model.d_model=64"]))
    assert run_identity(new) != run_identity(load_config(minimal, ["model.transformer.d_model=32"]))
    assert run_identity(new) != run_identity(load_config(minimal, ["model.d_model=64", "train.init_from=runs/x"]))
    assert run_identity(new) != run_identity(load_config(minimal, ["model.d_model=64", "train.freeze=[codecs.]"]))


def test_the_fine_tuning_recipes_settings_keep_an_earlier_multiphysics_runs_identity_at_their_defaults(minimal):
    """model.multiphysics.output and steady_rows came after runs were tagged: at their defaults a run's identity is
    the one an earlier version gave it (its view without them); off them, and with lr_groups, another run's."""
    import hashlib
    import json

    from train.config import training_view

    cfg = load_config(minimal, ["model.name=multiphysics"])
    later = ("model.multiphysics.output", "model.multiphysics.steady_rows", "train.init_from", "train.freeze")
    later += ("data.stream", "data.canonical_nodes", "data.block_shards")  # streaming's order
    later_in_tasks = (".periodic", ".stream")  # tasks.<name>.periodic, .stream
    earlier = {k: v for k, v in training_view(cfg).items() if k not in later and not k.endswith(later_in_tasks)}
    assert run_identity(cfg) == hashlib.sha1(json.dumps(earlier, sort_keys=True).encode()).hexdigest()[:16]
    for change in (
        "model.multiphysics.output=increment",
        "model.multiphysics.steady_rows=true",
        "train.lr_groups={trunk: 0.1}",
        "train.init_reset={field_out: zero}",
        f"tasks.{next(iter(cfg.tasks))}.periodic=true",
    ):
        assert run_identity(load_config(minimal, ["model.name=multiphysics", change])) != run_identity(cfg), change


@pytest.mark.parametrize("name", ["../x", ".", "..", "a/b"])
def test_a_run_name_that_is_not_one_folder_is_refused_and_blamed_on_what_set_it(name, repo):
    """--run ../x put the run beside runs/, and --run . made runs/ itself the run folder."""
    with pytest.raises(ConfigError, match=rf"(?s)^--run {re.escape(name)}: invalid override .*is not a folder name"):
        load_config(repo / "configs" / "tiny.yaml", run_name=name)
    with pytest.raises(ConfigError, match=r"(?s)^--set run.name=.*is not a folder name"):
        load_config(repo / "configs" / "tiny.yaml", [f"run.name={name}"])


def test_a_misspelt_model_name_is_blamed_on_the_override_with_the_name_meant(repo):
    with pytest.raises(ConfigError, match=r"(?s)^--set model\.name=FNO: invalid override .*'FNO' is neither a built-in "
                       r"model .*\(did you mean fno\?\)"):  # fmt: skip
        load_config(repo / "configs" / "tiny.yaml", ["model.name=FNO"])
