"""Using a trained model without training one: the model table, the real-arithmetic spectral layer, loading
checkpoints with Surrogate, fine-tuning's weight matching and freezing, and export of every built-in model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from train.checkpoint import CONFIG, MODEL, SPECS, TASK_CARDS, save_best
from train.config import BUILT_IN_MODELS, Config, FNOConfig, ModelConfig, TaskConfig
from train.errors import ConfigError, DataError
from train.model.builtin import MODELS, parameter_count
from train.model.factory import build_model
from train.model.fno import SpectralConv
from train.model.specs import TaskSpec

ADV = TaskSpec((32,), 1, 1, 4, 3, True)
DARCY = TaskSpec((16, 16), 1, 1, 4, 1, False)
SMALL = {
    "transformer": {"transformer": {"d_model": 16, "n_heads": 2, "n_layers": 1}},
    "fno": {"fno": {"modes": 6, "width": 8, "layers": 2}},
    "unet": {"unet": {"init_features": 4}},
    "multiphysics": {"multiphysics": {"d_model": 16, "n_heads": 2, "n_layers": 1, "field_width": 4}},
    "conv": {"conv": {"width": 8, "depth": 2, "kernel": 3}},
    "resnet": {"resnet": {"width": 8, "blocks": 1, "kernel": 3, "norm": "group"}},
}


def model_config(name: str) -> ModelConfig:
    return ModelConfig.model_validate({"name": name, **SMALL[name]})


# ------------------------------------------------------------------------------------------- the table
def test_the_table_holds_every_built_in_model_with_its_settings_section():
    assert tuple(MODELS) == BUILT_IN_MODELS
    for name, entry in MODELS.items():
        assert ModelConfig.model_fields[name].annotation is entry.settings, name


@pytest.mark.parametrize("name", BUILT_IN_MODELS)
def test_the_meta_device_count_is_the_built_models(name):
    specs = {"adv": ADV, "darcy": DARCY}
    cfg = model_config(name)
    real = sum(p.numel() for p in build_model(specs, cfg).parameters())
    assert parameter_count(specs, cfg) == real > 0


# ----------------------------------------------------------------------------------- spectral layers
@pytest.mark.parametrize(
    ("sizes", "modes"),
    [((64,), (8,)), ((33,), (17,)), ((18, 20), (6, 11)), ((18, 20), (9, 11)), ((10, 12, 9), (4, 5, 5))],
)
def test_the_real_spectral_layer_equals_the_fft_one(sizes, modes):
    """Odd and even sizes, the Nyquist mode of the last axis kept (20 // 2 + 1 = 11), all corners in 3D: the
    truncated DFTs (what torch.compile and export trace) equal ``irfftn(W * rfftn(x))`` (what runs eagerly, as it
    always did) to float32 rounding, whether the layer was built for the input's size or not."""
    for built in (sizes, None):
        torch.manual_seed(0)
        conv = SpectralConv(5, modes, built)
        conv.weights.data = torch.randn_like(conv.weights)
        x = torch.randn(3, 5, *sizes)
        with torch.no_grad():
            want, got, eager = fft_spectral(conv, x), conv._dft(x), conv(x)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
        assert torch.equal(eager, want)  # eagerly the layer is the FFT's
        assert list(conv.state_dict()) == ["weights"]  # the DFT matrices are not saved: checkpoints load as before


def fft_spectral(conv: SpectralConv, x: torch.Tensor) -> torch.Tensor:
    """The spectral layer by FFT, as it was computed until it moved to real arithmetic (PDEBench's form)."""
    dims = tuple(range(2, x.dim()))
    spectrum = torch.fft.rfftn(x.float(), dim=dims)
    w = torch.view_as_complex(conv.weights.float())
    out = torch.zeros_like(spectrum)
    axes = "xyz"[: len(conv.modes)]
    for block, corner in enumerate(conv.corners):
        index = (
            slice(None),
            slice(None),
            *[slice(-m, None) if high else slice(None, m) for high, m in zip(corner, conv.modes[:-1], strict=True)],
            slice(None, conv.modes[-1]),
        )
        out[index] = torch.einsum(f"bi{axes},io{axes}->bo{axes}", spectrum[index], w[block])
    return torch.fft.irfftn(out, s=x.shape[2:], dim=dims)


# ---------------------------------------------------------------------------------------- checkpoints


def _card(pde: str, mean: float = 0.0, std: float = 1.0) -> dict:
    """A checkpoint's task card as the trainer writes one, for a one-channel task."""
    moments = {"input_mean": [mean], "input_std": [std], "target_mean": [mean], "target_std": [std]}
    return {"pde": pde, "channels": [], "n_frames": 8, **moments, "const_mean": [], "const_std": [],
            "statistics": "train split"}  # fmt: skip


def _checkpoint(tmp_path, name: str, specs: dict[str, TaskSpec], cards: bool = True, seed: int = 0):
    """A checkpoint as the trainer writes one (model, config, specs, task cards) for a random model."""
    tasks = {
        "adv": TaskConfig(pde="advection1d", initial_step=ADV.initial_step, patch_size=4),
        "darcy": TaskConfig(pde="darcy2d", patch_size=4),
    }
    cfg = Config(tasks={k: v for k, v in tasks.items() if k in specs}, model=model_config(name))
    torch.manual_seed(seed)
    model = build_model(specs, cfg.model)
    state = {
        MODEL: model.state_dict(),
        CONFIG: cfg.model_dump(mode="json"),
        SPECS: {n: s.as_dict() for n, s in specs.items()},
    }
    if cards:
        state[TASK_CARDS] = {n: _card(cfg.tasks[n].pde, 0.5, 2.0) for n in specs}
    folder = tmp_path / f"{name}-{seed}-{'-'.join(specs)}"
    folder.mkdir()
    return save_best(folder, state), model, cfg


def test_a_surrogate_predicts_in_physical_units_numpy_or_torch(tmp_path):
    from train.use.surrogate import Surrogate

    path, model, _ = _checkpoint(tmp_path, "fno", {"adv": ADV, "darcy": DARCY})
    s = Surrogate.load(path)
    x = np.random.default_rng(0).normal(size=(5, 3, 32, 1)).astype(np.float32)
    with torch.no_grad():
        want = model.eval()({"adv": torch.from_numpy((x - 0.5) / 2)})["adv"] * 2 + 0.5
    got = s.predict("adv", x, batch_size=2)
    assert isinstance(got, np.ndarray) and got.shape == (5, 32, 1)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    as_torch = s.predict("adv", torch.from_numpy(x))
    assert isinstance(as_torch, torch.Tensor) and torch.allclose(as_torch, want, atol=1e-6)
    frames = s.rollout("adv", x, steps=4)
    assert frames.shape == (5, 4, 32, 1)
    np.testing.assert_allclose(frames[:, 0], got, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match=r"takes \('batch', 3, 32, 1\)"):
        s.predict("adv", x[:, :2])
    with pytest.raises(ConfigError, match="trained on adv, darcy"):
        s.predict("burgers", x)
    with pytest.raises(ConfigError, match="steady"):
        s.rollout("darcy", np.zeros((1, 16, 16, 1), np.float32), 2)


def test_a_checkpoint_without_its_statistics_says_what_is_missing(tmp_path):
    from train.use.surrogate import Surrogate

    path, _, _ = _checkpoint(tmp_path, "unet", {"adv": ADV}, cards=False)
    with pytest.raises(DataError, match=r"does not carry the normalisation statistics of task 'adv'.*run folder"):
        Surrogate.load(path)
    with pytest.raises(DataError, match="no such run folder or checkpoint file"):
        Surrogate.load(tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------- fine-tuning
def _record(path) -> dict:
    from train.engine.init_from import sha256_of

    return {"source": str(path), "checkpoint": str(path), "sha256": sha256_of(path)}


def test_init_from_loads_matching_weights_and_starts_new_tasks_fresh(tmp_path):
    from train.engine.init_from import load_initial_weights

    path, source, _ = _checkpoint(tmp_path, "transformer", {"adv": ADV})
    _, target, cfg = _checkpoint(tmp_path, "transformer", {"adv": ADV, "darcy": DARCY}, seed=1)
    fresh = {k: v.clone() for k, v in target.state_dict().items() if k.startswith("codecs.darcy.")}
    done = load_initial_weights(target, cfg, _record(path))
    assert done["fresh_tasks"] == ["darcy"] and done["loaded"] == len(source.state_dict())
    for key, value in target.state_dict().items():
        expected = fresh[key] if key.startswith("codecs.darcy.") else source.state_dict()[key]
        assert torch.equal(value, expected), key


def test_init_from_names_a_parameter_whose_shape_differs_and_another_architecture(tmp_path):
    from train.engine.init_from import load_initial_weights

    path, _, _ = _checkpoint(tmp_path, "fno", {"adv": ADV})
    _, target, cfg = _checkpoint(tmp_path, "fno", {"adv": TaskSpec((32,), 1, 1, 4, 5, True)}, seed=1)
    with pytest.raises(ConfigError, match=r"networks\.adv\.lift\.weight: \(8, 4\) there, \(8, 6\) here"):
        load_initial_weights(target, cfg, _record(path))
    _, unet, unet_cfg = _checkpoint(tmp_path, "unet", {"adv": ADV})
    with pytest.raises(ConfigError, match=r"holds a model\.name=fno model; this run builds model\.name=unet"):
        load_initial_weights(unet, unet_cfg, _record(path))


def test_freeze_fixes_what_its_prefixes_name_and_refuses_a_prefix_that_names_nothing():
    from train.engine.init_from import freeze

    model = build_model({"adv": ADV, "darcy": DARCY}, ModelConfig(name="fno", fno=FNOConfig(modes=4, width=4)))
    frozen = freeze(model, ["networks.adv."])
    assert frozen == sum(p.numel() for n, p in model.named_parameters() if n.startswith("networks.adv."))
    assert all(p.requires_grad == n.startswith("networks.darcy.") for n, p in model.named_parameters())
    with pytest.raises(ConfigError, match=r"'codecs\.' matches no parameter.*start with networks"):
        freeze(model, ["codecs."])
    with pytest.raises(ConfigError, match="freezes every parameter"):
        freeze(model, ["networks."])


# --------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("name", BUILT_IN_MODELS)
def test_every_built_in_model_exports_to_torchscript_and_onnx(tmp_path, name):
    from train.use.export import export_run

    path, _, _ = _checkpoint(tmp_path, name, {"adv": ADV, "darcy": DARCY})
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is a test dependency ('.[dev]')")
    from train.use.surrogate import Surrogate

    surrogate = Surrogate.load(path)
    for fmt in ("torchscript", "onnx"):
        files = export_run(path, fmt, tmp_path / fmt)
        assert sorted(p.name for p in files) == sorted(f"{t}.{'pt' if fmt == 'torchscript' else 'onnx'}" for t in
                                                       ("adv", "darcy"))  # fmt: skip
    for task in ("adv", "darcy"):
        card = surrogate.tasks[task]
        x = np.random.default_rng(1).normal(size=card.input_shape(4)).astype(np.float32)
        want = surrogate.predict(task, x)
        scripted = torch.jit.load(str(tmp_path / "torchscript" / f"{task}.pt"))
        np.testing.assert_allclose(scripted(torch.from_numpy(x)).detach().numpy(), want, rtol=1e-4, atol=1e-5)
        session = ort.InferenceSession(str(tmp_path / "onnx" / f"{task}.onnx"), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(None, {"inputs": x})[0], want, rtol=1e-4, atol=1e-5)


def test_an_export_that_would_be_wrong_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    from train.use import export

    path, _, _ = _checkpoint(tmp_path, "fno", {"adv": ADV})
    # A step to export that drops a mode of a spectral layer: the graph no longer equals the model.
    exportable = export.exportable

    def broken(surrogate, card):
        step, reference = exportable(surrogate, card)
        with torch.no_grad():
            step.model.networks["adv"].spectral[0].weights[..., -1, :] = 0
        return step, reference

    monkeypatch.setattr(export, "exportable", broken)
    with pytest.raises(export.ExportError, match="differs from the PyTorch model"):
        export.export_run(path, "torchscript", tmp_path / "out")
    assert not list((tmp_path / "out").glob("*"))


def test_a_run_mirrored_to_b2_loads_from_its_remote_once_and_verified(tmp_path, monkeypatch):
    """b2://bucket/prefix/<run>: the best checkpoint the pointer lists, fetched once, checked against its SHA1."""
    from tests.b2sim import Account
    from train.remote.mirror import RunMirror
    from train.remote.store import open_remote
    from train.run_dir import RunDir
    from train.use.surrogate import Surrogate

    account = Account(monkeypatch)
    monkeypatch.setenv("TRAIN_MODEL_CACHE", str(tmp_path / "cache"))
    run = RunDir(tmp_path / "runs" / "run")
    run.checkpoints.mkdir(parents=True)
    path, _, _ = _checkpoint(tmp_path, "fno", {"adv": ADV})
    path.rename(run.checkpoints / "best.pt")
    assert RunMirror(open_remote("b2://pdebench/runs", "run", account.api), run, keep=2, poll_s=0.01).start().finish(30)

    x = np.random.default_rng(0).normal(size=(2, 3, 32, 1)).astype(np.float32)
    local = Surrogate.load(run.root).predict("adv", x)
    remote = Surrogate.load("b2://pdebench/runs/run", b2_api=account.api)
    assert remote.checkpoint.is_relative_to(tmp_path / "cache")
    np.testing.assert_array_equal(remote.predict("adv", x), local)
    fetched = len(account.downloads)
    Surrogate.load("b2://pdebench/runs/run", b2_api=account.api)
    assert len(account.downloads) == fetched + 1, "the pointer is read again, the checkpoint not fetched again"
    with pytest.raises(DataError, match="no checkpoint of a run"):
        Surrogate.load("b2://pdebench/runs/other", b2_api=account.api)


def test_predict_writes_a_group_per_seed_file_in_its_layout(tmp_path):
    """PDEBench's group-per-seed layout (diffusion-sorption): a group per sample, its data [t, x, channel]."""
    import h5py

    from train.use.predict import predict_file

    spec = TaskSpec((32,), 1, 1, 4, 3, True)
    cfg = Config(tasks={"ds": TaskConfig(pde="diffsorp1d", initial_step=3, patch_size=4)}, model=model_config("fno"))
    torch.manual_seed(0)
    model = build_model({"ds": spec}, cfg.model)
    card = _card("diffsorp1d", 0.1, 0.5)
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    save_best(folder, {MODEL: model.state_dict(), CONFIG: cfg.model_dump(mode="json"), SPECS: {"ds": spec.as_dict()},
                       TASK_CARDS: {"ds": card}})  # fmt: skip
    source = tmp_path / "ds.h5"
    data = np.random.default_rng(0).normal(size=(3, 8, 32, 1)).astype(np.float32)
    with h5py.File(source, "w") as f:
        for i, sample in enumerate(data):
            f[f"{i:04d}/data"] = sample
            f[f"{i:04d}/grid/x"] = np.linspace(0, 1, 32)
            f[f"{i:04d}/grid/t"] = np.linspace(0, 1, 8)
    scores = predict_file(tmp_path / "run", source, tmp_path / "out.h5", steps=6)
    assert scores["frames_scored"] == 5 and scores["n_samples"] == 3
    with h5py.File(tmp_path / "out.h5") as g:
        assert sorted(g) == ["0000", "0001", "0002"]
        for i in range(3):
            out = g[f"{i:04d}/data"][()]
            assert out.shape == (3 + 6, 32, 1) and len(g[f"{i:04d}/grid/t"]) == 9
            np.testing.assert_array_equal(out[:3], data[i, :3])
            assert not np.array_equal(out[3:8], data[i, 3:])


def test_a_model_of_your_own_that_moved_is_named_with_how_to_point_at_it(tmp_path, monkeypatch):
    import shutil

    from tests.helpers import REPO
    from train.use.surrogate import Surrogate

    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "examples" / "my_model.py", tmp_path / "mine.py")
    cfg = Config(
        tasks={"adv": TaskConfig(pde="advection1d", initial_step=3, patch_size=4)},
        model=ModelConfig(name="mine.py:build", args={"width": 4, "depth": 1, "kernel": 3}),
    )
    model = build_model({"adv": ADV}, cfg.model)
    card = _card("advection1d")
    (tmp_path / "ckpt").mkdir()
    path = save_best(tmp_path / "ckpt", {MODEL: model.state_dict(), CONFIG: cfg.model_dump(mode="json"),
                                         SPECS: {"adv": ADV.as_dict()}, TASK_CARDS: {"adv": card}})  # fmt: skip
    (tmp_path / "models").mkdir()
    (tmp_path / "mine.py").rename(tmp_path / "models" / "mine.py")
    with pytest.raises(ConfigError, match=r"model.name=mine.py:build .*factory='path/to/file.py:function'"):
        Surrogate.load(path)
    moved = Surrogate.load(path, factory="models/mine.py:build")
    x = np.ones((1, 3, 32, 1), np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(moved.predict("adv", x), model.eval()({"adv": torch.from_numpy(x)})["adv"].numpy())


def test_the_api_refuses_inputs_and_settings_it_cannot_predict_from_with_the_projects_errors(tmp_path):
    """NaN in, NaN out, and an empty array for batch_size=-1, were silent; a KeyError, an AssertionError and a
    float step count were tracebacks."""
    from train.errors import PreflightError
    from train.use.surrogate import Surrogate

    path, _, _ = _checkpoint(tmp_path, "fno", {"adv": ADV})
    s = Surrogate.load(path)
    x = np.random.default_rng(0).normal(size=(4, 3, 32, 1)).astype(np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[2, 1, 5, 0] = bad
        with pytest.raises(DataError, match=r"task adv: sample 2 of the inputs holds NaN or inf \(1 of 4 samples"):
            s.predict("adv", y)
        with pytest.raises(DataError, match=r"task adv: sample 2"):
            s.rollout("adv", torch.from_numpy(y), 2)
    for size in (-1, 0, 2.0, True):
        with pytest.raises(ConfigError, match=rf"batch_size={size!r}: samples per forward pass"):
            s.predict("adv", x, batch_size=size)
    for steps in (2.5, 0, "3"):
        with pytest.raises(ConfigError, match=rf"steps={steps!r}: a rollout predicts a whole number"):
            s.rollout("adv", x, steps)
    assert s.rollout("adv", x, np.int64(2)).shape == (4, 2, 32, 1)
    with pytest.raises(ConfigError, match=r"precision='fp8': choose one of auto, fp32, bf16, fp16"):
        Surrogate.load(path, precision="fp8")
    with pytest.raises(ConfigError, match=r"device='tpu:0': not a device name"):
        Surrogate.load(path, device="tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(PreflightError, match=r"device=cuda: (this PyTorch is built without CUDA|no CUDA GPU)"):
            Surrogate.load(path, device="cuda")


def test_predict_and_export_check_their_output_first_and_never_write_into_a_runs_own_files(tmp_path):
    """An output over checkpoints/best.pt was written (the next launch set it aside and retrained from an older
    step); a folder given as predict's output was found only after every prediction was computed."""
    import h5py

    from train.config import to_yaml
    from train.use.export import export_run
    from train.use.predict import predict_file

    path, _, cfg = _checkpoint(tmp_path, "fno", {"adv": ADV})
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    best = path.rename(run / "checkpoints" / "best.pt")
    step = run / "checkpoints" / "step_00000010.pt"
    step.write_bytes(best.read_bytes())
    before = {p: p.read_bytes() for p in (best, step)}
    source = tmp_path / "adv.h5"
    with h5py.File(source, "w") as f:
        f["tensor"] = np.random.default_rng(0).normal(size=(2, 8, 32)).astype(np.float32)
        f["x-coordinate"], f["t-coordinate"] = np.linspace(0, 1, 32), np.linspace(0, 1, 9)

    for output in (best, step, run / "checkpoints" / "new.h5", run / "config.yaml", run / "metrics.jsonl"):
        with pytest.raises(ConfigError, match=r"is inside the run folder .* own files.*Write elsewhere"):
            predict_file(run, source, output)
    for output in (step, run / "checkpoints"):
        with pytest.raises(ConfigError, match=r"is inside the run folder"):
            export_run(run, "torchscript", output)
    with pytest.raises(ConfigError, match=r"--output .* is a folder; give the file to write"):
        predict_file(run, source, tmp_path)
    with pytest.raises(ConfigError, match=r"--batch-size 0: give the trajectories per forward pass"):
        predict_file(run, source, tmp_path / "out.h5", batch_size=0)
    assert {p: p.read_bytes() for p in (best, step)} == before
    assert predict_file(run, source, run / "predictions.h5") is not None  # beside them is fine
    (tmp_path / "x.pt").mkdir()  # a folder with the format's suffix was told "e.g. x.pt/predictions.h5": it is one
    assert export_run(run, "torchscript", tmp_path / "x.pt") == [tmp_path / "x.pt" / "adv.pt"]


def test_an_empty_batch_predicts_an_empty_batch_of_the_outputs_shape_and_a_yaml_is_no_checkpoint(tmp_path):
    """predict(task, x[:0]) returned shape (0,); Surrogate.load of a YAML file said to re-run the launch."""
    from train.use.surrogate import Surrogate

    path, _, _ = _checkpoint(tmp_path, "fno", {"adv": ADV})
    s = Surrogate.load(path)
    x = np.zeros((0, 3, 32, 1), np.float32)
    assert s.predict("adv", x).shape == (0, 32, 1) and s.rollout("adv", torch.from_numpy(x), 3).shape == (0, 3, 32, 1)
    config = tmp_path / "tiny.yaml"
    config.write_text("tasks: {}\n")
    with pytest.raises(DataError, match=r"it is not a checkpoint \(a \.pt file training wrote") as e:
        Surrogate.load(config)
    assert "Re-run the same command" not in str(e.value) and "--checkpoint" in str(e.value)


def test_export_refuses_a_model_whose_source_changed_since_training_unless_told(tmp_path, monkeypatch):
    import shutil

    from tests.helpers import REPO
    from train.use.export import export_run

    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "examples" / "my_model.py", tmp_path / "mine.py")
    cfg = Config(
        tasks={"adv": TaskConfig(pde="advection1d", initial_step=3, patch_size=4)},
        model=ModelConfig(name="mine.py:build", args={"width": 4, "depth": 1, "kernel": 3}),
    )
    from train.checkpoint import MODEL_SOURCE
    from train.model.factory import factory_source

    model = build_model({"adv": ADV}, cfg.model)
    (tmp_path / "ckpt").mkdir()
    path = save_best(tmp_path / "ckpt", {MODEL: model.state_dict(), CONFIG: cfg.model_dump(mode="json"),
                                         SPECS: {"adv": ADV.as_dict()}, TASK_CARDS: {"adv": _card("advection1d")},
                                         MODEL_SOURCE: factory_source(cfg.model.name)})  # fmt: skip
    with open(tmp_path / "mine.py", "a") as f:
        f.write("\n# edited after training\n")
    with pytest.raises(ConfigError, match=r"mine\.py as it was then .* has changed since .*--accept-changed-model"):
        export_run(path, "torchscript", tmp_path / "out")
    assert not (tmp_path / "out" / "adv.pt").exists()
    assert export_run(path, "torchscript", tmp_path / "out", accept_changed_source=True) == [
        tmp_path / "out" / "adv.pt"
    ]


def test_a_fine_tuned_run_keeps_its_first_launchs_record_of_the_source_and_needs_it_no_more(tmp_path):
    """A relaunch recorded the SHA-256 of whatever file the source path held by then, and failed (exit 2) once
    the source was gone, although the run resumes from its own checkpoints."""
    import json

    from train.checkpoint import WEIGHTS_FROM, save_checkpoint
    from train.config import TrainConfig
    from train.engine.init_from import sha256_of
    from train.launch.continuity import initial_weights
    from train.run_dir import RunDir

    source, _, cfg = _checkpoint(tmp_path, "fno", {"adv": ADV})
    cfg = cfg.model_copy(update={"train": TrainConfig(init_from=str(source))})
    run = RunDir(tmp_path / "run")
    first = initial_weights(cfg, run, "fit")  # a first start resolves the source
    assert first["sha256"] == sha256_of(source) and first["source"] == str(source)
    run.root.mkdir()
    run.inputs.write_text(json.dumps({"adv": {"cache": "unused", "latent": None, "weights_from": first}}))
    save_checkpoint(run.checkpoints, 5, {"model": {}, WEIGHTS_FROM: first}, keep=1)

    other, _, _ = _checkpoint(tmp_path, "fno", {"adv": ADV}, seed=1)
    source.write_bytes(other.read_bytes())  # the source path now holds other weights
    assert initial_weights(cfg, run, "fit") == first
    source.unlink()
    assert initial_weights(cfg, run, "fit") == first
    run.inputs.unlink()  # a new machine: the run restored from its remote, whose checkpoint carries the record
    assert initial_weights(cfg, run, "fit") == first
    assert initial_weights(cfg, run, "evaluate") == first
