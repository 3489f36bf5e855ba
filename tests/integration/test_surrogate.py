"""A trained run used as users use it: loaded in a fresh process, predicting files, fine-tuned, exported.

One tiny FNO run (both tiny tasks, one rank: the farm's, tests/farm.py) is only read by every test here.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tests.farm import FNO
from tests.helpers import REPO, folders, run_cli
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.errors import DataError, TrainError
from train.obs.sinks import read_metrics
from train.use.predict import predict_file

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(farm) -> Path:
    """The run folder of the farm's finished tiny FNO run (read only: a test that changes it copies it)."""
    return farm.fno()


def report(run: Path) -> dict:
    return json.loads((run / "report" / "summary.json").read_text())


def test_a_fresh_process_loads_the_run_and_reproduces_the_reports_test_nrmse(trained):
    """Surrogate.load from the run folder alone: rollouts of the raw test trajectories in physical units."""
    script = textwrap.dedent(f"""
        import json, numpy as np, torch
        from train import Surrogate
        from train.data.formats.pdebench import pdebench_reader
        from train.engine.metrics import error_sums, finish

        model = Surrogate.load({str(trained)!r})
        out = {{}}
        for name, card in model.tasks.items():
            test = json.load(open({str(trained / "report" / "summary.json")!r}))[name]["data"]["test"]
            reader = pdebench_reader(test["file"], card.pde, card.settings["spatial_stride"],
                                 card.settings["temporal_stride"])
            parts = list(reader.parts(range(*test["samples"])))
            if card.spec.autoregressive:
                traj = np.concatenate([p[""] for p in parts])
                k = card.spec.initial_step
                pred = model.rollout(name, traj[:, :k], traj.shape[1] - k, batch_size=3)
                true = traj[:, k:]
            else:
                pred = model.predict(name, torch.from_numpy(np.concatenate([p["x"] for p in parts])))[:, None]
                assert isinstance(pred, torch.Tensor)
                pred, true = pred.numpy(), np.concatenate([p["y"] for p in parts])[:, None]
            out[name] = finish(error_sums(torch.from_numpy(pred), torch.from_numpy(true)))["nrmse"]
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, scores in report(trained).items():
        assert got[name] == pytest.approx(scores["nrmse"], rel=1e-6, abs=1e-9), name


def _test_file(trained: Path, task: str, dest: Path) -> Path:
    """The test samples of ``task``'s data, as a PDEBench file of their own."""
    test = report(trained)[task]["data"]["test"]
    a, b = test["samples"]
    with h5py.File(test["file"]) as src, h5py.File(dest, "w") as f:
        for key, ds in src.items():
            f.create_dataset(key, data=ds[a:b] if ds.ndim > 1 else ds[()])
    return dest


def test_predict_writes_the_inputs_layout_and_scores_as_the_report(trained, tmp_path):
    for task in ("advection1d", "darcy2d"):
        source = _test_file(trained, task, tmp_path / f"{task}.h5")
        output = tmp_path / f"{task}-pred.h5"
        proc = run_cli("predict", "--run", str(trained), "--input", str(source), "--output", str(output))
        assert proc.returncode == 0, proc.stderr[-4000:]
        scores = json.loads((tmp_path / f"{task}-pred.h5.scores.json").read_text())[task]
        assert scores["nrmse"] == pytest.approx(report(trained)[task]["nrmse"], rel=1e-6), task
        with h5py.File(source) as f, h5py.File(output) as g:
            assert set(g) == set(f)
            key = "tensor"
            if task == "advection1d":  # the run's temporal stride, the initial frames kept as they were
                true = f[key][:, ::10]
                assert g[key].shape == true.shape
                np.testing.assert_array_equal(g[key][:, :4], true[:, :4])
                assert not np.array_equal(g[key][:, 4:], true[:, 4:])
            else:
                assert g[key].shape == f[key].shape
                np.testing.assert_array_equal(g["nu"][()], f["nu"][()])
    # Rollouts longer than the truth: the frames the input holds are scored, the rest predicted.
    longer = run_cli("predict", "--run", str(trained), "--input", str(tmp_path / "advection1d.h5"),
                     "--output", str(tmp_path / "long.h5"), "--steps", "30")  # fmt: skip
    assert longer.returncode == 0, longer.stderr[-3000:]
    with h5py.File(tmp_path / "long.h5") as g:
        assert g["tensor"].shape[1] == 4 + 30 and len(g["t-coordinate"]) == 34
    assert json.loads((tmp_path / "long.h5.scores.json").read_text())["advection1d"]["frames_scored"] == 17


def test_predict_refuses_data_the_model_was_not_trained_on(trained, tmp_path):
    source = _test_file(trained, "advection1d", tmp_path / "adv.h5")
    coarse = tmp_path / "coarse.h5"
    with h5py.File(source) as f, h5py.File(coarse, "w") as g:
        g["tensor"] = f["tensor"][:, :, ::2]
    short = tmp_path / "short.h5"
    with h5py.File(source) as f, h5py.File(short, "w") as g:
        g["tensor"] = f["tensor"][:, :25]  # 3 frames after the stride of 10; the model starts from 4
    darcy = _test_file(trained, "darcy2d", tmp_path / "darcy.h5")
    cases = [
        (["--input", str(coarse)], 3, "grid (32,)"),
        (["--input", str(coarse), "--task", "advection1d"], 3, "trained on (64,)"),
        (["--input", str(short), "--task", "advection1d"], 3, "starts from 4 initial frames"),
        (["--input", str(darcy), "--task", "advection1d"], 3, "a advection1d field is [sample, t, 1D space]"),
        (["--input", str(darcy), "--steps", "3"], 2, "steady"),
        (["--input", str(source), "--task", "burgers"], 2, "trained on advection1d, darcy2d"),
        (["--input", str(tmp_path / "missing.h5")], 3, "missing.h5"),
    ]
    out = tmp_path / "out.h5"
    for args, code, words in cases:
        options = dict(zip(args[::2], args[1::2], strict=True))
        with pytest.raises(TrainError) as e:
            predict_file(trained, Path(options["--input"]), out, int(options.get("--steps", 0)) or None,
                         task=options.get("--task"))  # fmt: skip
        assert e.value.exit_code == code and words in str(e.value), (args, e.value)
        assert not out.exists() and not list(tmp_path.glob(".out.h5.*")), "no file, not even a partial one"
    proc = run_cli("predict", "--run", str(trained), "--input", str(coarse), "--output", str(out))  # the exit code
    assert proc.returncode == 3 and "grid (32,)" in proc.stderr and not out.exists(), proc.stderr[-2000:]


def _fine_tune_argv(trained: Path, tmp: Path, run: str, command: str = "fit") -> list[str]:
    """``trained``: the run folder (or a checkpoint file) train.init_from names."""
    return [
        command, "--config", "configs/tiny.yaml", "--nproc", "1", "--run", run, *FNO, *folders(tmp),
        "--set", "tasks.advection1d.coefficient=0.4", "--set", f"train.init_from={trained}",
        "--set", "train.freeze=[networks.darcy2d.lift]", "--set", "train.epochs=3", "--set", "train.steps_per_epoch=20",
        "--set", "train.checkpoint_every=5", "--set", "train.log_every=1", "--set", "train.lr=5e-4",
    ]  # fmt: skip


def test_fine_tuning_starts_from_the_runs_weights_and_resumes_bitwise_after_a_sigkill(trained, tmp_path):
    base = load_checkpoint(trained / "checkpoints" / "best.pt")["model"]
    reference = run_cli(*_fine_tune_argv(trained, tmp_path, "reference", "run"), timeout=600)
    assert reference.returncode == 0, reference.stderr[-4000:]
    ref_dir = tmp_path / "runs" / "reference"
    final = load_checkpoint(latest_checkpoint(ref_dir / "checkpoints"))
    assert final["progress"]["global_step"] == 60
    # Frozen parameters are the source's own; the others moved from them.
    for key in ("networks.darcy2d.lift.weight", "networks.darcy2d.lift.bias"):
        assert torch.equal(final["model"][key], base[key]), key
    assert not torch.equal(final["model"]["networks.advection1d.lift.weight"], base["networks.advection1d.lift.weight"])
    inputs = json.loads((ref_dir / "inputs.json").read_text())
    assert inputs["advection1d"]["weights_from"]["source"] == str(trained)
    assert f"Fine-tuned: the initial weights came from `{trained}`" in (ref_dir / "report" / "summary.md").read_text()

    # The source is a copy of the same checkpoint, which goes away once the fine-tuned run has checkpoints of its
    # own: a relaunch resumes from them without the source, and keeps the first launch's record of it.
    source = tmp_path / "source.pt"
    shutil.copy(trained / "checkpoints" / "best.pt", source)
    at = random.Random().randrange(8, 50)
    print(f"SIGKILL to the whole job at step {at}")
    argv = [sys.executable, "-m", "train", *_fine_tune_argv(source, tmp_path, "killed")]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    metrics = tmp_path / "runs" / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not any(r.get("step", 0) >= at for r in read_metrics(metrics) if "loss" in r):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"step {at} not reached"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    first = json.loads((tmp_path / "runs" / "killed" / "inputs.json").read_text())["advection1d"]["weights_from"]
    source.unlink()
    again = run_cli(*_fine_tune_argv(source, tmp_path, "killed"), timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    kept = json.loads((tmp_path / "runs" / "killed" / "inputs.json").read_text())["advection1d"]["weights_from"]
    assert kept == first and kept["sha256"] == inputs["advection1d"]["weights_from"]["sha256"]
    resumed = (tmp_path / "runs" / "killed" / "logs" / "rank0.log").read_text()
    assert "resumed from" in resumed
    weights = load_checkpoint(latest_checkpoint(tmp_path / "runs" / "killed" / "checkpoints"))["model"]
    different = [k for k in weights if not torch.equal(weights[k], final["model"][k])]
    assert not different, f"differs from the uninterrupted fine-tuning: {different}"


def test_the_exported_fno_runs_in_onnxruntime_as_in_pytorch(trained, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is a test dependency ('.[dev]')")
    from train.use.surrogate import Surrogate

    proc = run_cli("export", "--run", str(trained), "--format", "onnx", "--output", str(tmp_path / "export"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    model = Surrogate.load(trained)
    for name, card in model.tasks.items():
        session = ort.InferenceSession(str(tmp_path / "export" / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        test = report(trained)[name]["data"]["test"]
        from train.data.formats.pdebench import pdebench_reader

        reader = pdebench_reader(
            test["file"], card.pde, card.settings["spatial_stride"], card.settings["temporal_stride"]
        )
        part = next(reader.parts(range(*test["samples"])))
        real = part[""][:, : card.spec.initial_step] if card.spec.autoregressive else part["x"]
        noise = np.random.default_rng(0).normal(size=(5, *real.shape[1:])).astype(np.float32) * card.input_std
        for inputs in (real, noise + card.input_mean, real[:1]):  # real, random, and another batch size
            want = model.predict(name, np.ascontiguousarray(inputs))
            (got,) = session.run(["prediction"], {"inputs": np.ascontiguousarray(inputs, dtype=np.float32)})
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), name


def test_the_example_script_runs_on_the_run(trained):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "use_surrogate.py"), str(trained)],
        capture_output=True, text=True, timeout=300, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "advection1d: 17 frames rolled out for 16 new trajectories" in proc.stdout


def test_a_checkpoint_from_before_task_cards_loads_from_its_run_folder(trained, tmp_path):
    from train.checkpoint import INTEGRITY, TASK_CARDS
    from train.use.surrogate import Surrogate

    old = tmp_path / "old"
    shutil.copytree(trained, old)
    state = torch.load(old / "checkpoints" / "best.pt", weights_only=True)
    del state[TASK_CARDS], state[INTEGRITY]  # as checkpoints were written before either
    torch.save(state, old / "checkpoints" / "best.pt")
    x = np.random.default_rng(0).normal(size=(2, 4, 64, 1)).astype(np.float32)
    np.testing.assert_array_equal(Surrogate.load(old).predict("advection1d", x),
                                  Surrogate.load(trained).predict("advection1d", x))  # fmt: skip
    (old / "inputs.json").unlink()
    with pytest.raises(DataError, match="does not carry the normalisation statistics"):
        Surrogate.load(old)
