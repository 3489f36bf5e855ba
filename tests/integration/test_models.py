"""The model seam through the CLI and torchrun (2 gloo ranks): a model file the package never saw, the built-in
FNO, and bad factories stopped with exit 2 and a message that names the problem."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal

import pytest
import yaml

from tests.farm import LONG, final_weights
from tests.helpers import REPO, assert_bitwise_equal, folders, run_cli, startup_s
from tests.integration.test_faults import rank_pid, start, wait_for_step
from train.checkpoint import BEST, latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.integration

TINY = ["--config", "configs/tiny.yaml"]


def summary(tmp, run="tiny") -> dict:
    return json.loads((tmp / "runs" / run / "report" / "summary.json").read_text())


def test_a_model_file_outside_the_package_trains_from_a_config_line(tmp_path):
    elsewhere = tmp_path / "lab" / "convnet.py"
    elsewhere.parent.mkdir()
    shutil.copy(REPO / "examples" / "my_model.py", elsewhere)
    proc = run_cli(
        "run", *TINY, *folders(tmp_path), "--set", f"model.name={elsewhere}:build", "--set", "model.args.width=12",
        timeout=120 * startup_s(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for task, scores in summary(tmp_path).items():
        assert scores["nrmse"] < scores["baseline_nrmse"] * 5, (task, scores)  # trained, and evaluated by rollout
    saved = (tmp_path / "runs" / "tiny" / "config.yaml").read_text()
    assert f"{elsewhere}:build" in saved and "width: 12" in saved

    # Edited since: every shape is the same, so the old weights would load silently into another model.
    elsewhere.write_text(elsewhere.read_text().replace("nn.GELU()", "nn.ReLU()"))
    latest_checkpoint(tmp_path / "runs" / "tiny" / "checkpoints").unlink()  # the run resumes from epoch 1's
    more = ["fit", *TINY, *folders(tmp_path), "--set", f"model.name={elsewhere}:build", "--set", "model.args.width=12"]
    again = run_cli(*more, timeout=120 * startup_s())
    assert again.returncode == 2, again.stderr[-3000:]
    assert f"{elsewhere}, the source of model.name={elsewhere}:build, changed since the checkpoint" in again.stderr
    accepted = run_cli(*more, "--set", "train.accept_changed_model_source=true", timeout=120 * startup_s())
    assert accepted.returncode == 0, accepted.stderr[-3000:]


def test_a_factory_that_cannot_be_imported_stops_before_the_data_stage(tmp_path):
    proc = run_cli("run", *TINY, *folders(tmp_path), "--set", f"model.name={tmp_path}/nowhere.py:build")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"no such file '{tmp_path}/nowhere.py'" in proc.stderr
    assert not (tmp_path / "data").exists(), "nothing may run after a bad model name"


def test_a_prediction_of_the_wrong_shape_is_named_before_training(tmp_path):
    model = tmp_path / "flat.py"
    model.write_text(
        "import torch\n"
        "class Flat(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(torch.zeros(1))\n"
        "    def forward(self, inputs):\n"
        "        return {name: x.flatten(1) * self.w for name, x in inputs.items()}\n"
        "def build(specs):\n"
        "    return Flat()\n"
    )
    proc = run_cli("run", *TINY, *folders(tmp_path), "--set", f"model.name={model}:build", timeout=120 * startup_s())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "prediction has shape" in proc.stderr and "(batch, *grid, out_channels)" in proc.stderr
    assert not list((tmp_path / "runs" / "tiny").glob("checkpoints/*.pt")), "no step may run"


def test_fno_trained_with_its_whole_step_compiled_scores_as_eager(tmp_path):
    """The FNO through torchrun, with the whole step compiled on each rank (forward, loss, gradients, their
    all-reduce and AdamW: one graph, no break, its spectral layers included) and eagerly under DDP: the two runs
    score alike. The graphs run on PyTorch's kernels (aot_eager): inductor's code for this step is
    tests/unit/test_compiled_step.py's (the same FNO's pushforward step, its losses within 1e-6 of eager's), and
    generating it again here took two minutes of CI's two cores. One step, 2 spectral layers. The compiled run
    asks for reduce-overhead, whose CUDA graphs CPU ranks cannot capture: coerced to the default mode. (The eager
    run is the FNO trained through torchrun, which a resume with another model must not continue.)"""
    scores = {}
    for compiled in (False, True):
        run = f"compiled_{compiled}".lower()
        proc = run_cli(
            "run", *TINY, *folders(tmp_path), "--run", run, "--set", "model.name=fno", "--set", "model.fno.layers=2",
            "--set", f"compile.enabled={str(compiled).lower()}", "--set", "compile.mode=reduce-overhead",
            "--set", "compile.backend=aot_eager",
            timeout=240 * startup_s(),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        scores[compiled] = summary(tmp_path, run)
    assert "compile.mode=reduce-overhead captures CUDA graphs" not in proc.stderr  # whole step: not the DDP model
    assert "compile" not in scores[False]  # compile.enabled=false: no block
    facts = scores[True].pop("compile")
    assert facts["mode"] == "whole step" and facts["breaks"] == [] and facts["frames_skipped"] == 0, facts
    assert facts["backend"] == "aot_eager" and facts["graphs"] == 1 and facts["recompiles_after_warmup"] == 0, facts
    assert facts["ops_outside_graphs"] <= 20, facts
    assert re.search(
        r"torch.compile \(whole step; backend aot_eager\): 1 training graph\(s\) in [\d.]+ s, 0 graph break",
        proc.stderr,
    )
    assert set(scores[False]) == {"advection1d", "darcy2d"}
    for task in scores[False]:
        assert scores[True][task]["nrmse"] == pytest.approx(scores[False][task]["nrmse"], rel=1e-3), task

    again = run_cli(
        "fit", *TINY, *folders(tmp_path), "--run", "compiled_false", "--set", "train.epochs=3",
        timeout=120 * startup_s(),
    )  # fmt: skip
    assert again.returncode == 2, again.stderr[-3000:]
    assert "model.name" in again.stderr


BREAKING = """
import torch
from torch import nn


class Breaks(nn.Module):
    def __init__(self, specs):
        super().__init__()
        self.nets = nn.ModuleDict({n: nn.Linear(s.in_features, s.out_channels) for n, s in specs.items()})
        self.specs = specs

    def forward(self, inputs):
        out = {}
        for name, x in inputs.items():
            if self.specs[name].autoregressive:
                x = x.movedim(1, -2).flatten(-2)
            out[name] = self.nets[name](x)
        torch._dynamo.graph_break()  # what a print, a .item() or an unsupported call does
        return out


def build(specs):
    return Breaks(specs)
"""


def test_a_model_of_your_own_that_breaks_the_graph_is_reported_where_and_refused_only_when_strict(tmp_path):
    """A break in a model's forward cannot be compiled into the whole step: the run compiles the model alone and
    says where (the log line and summary.json's compile block); compile.strict=true stops it (exit 2) naming the
    place instead."""
    model = tmp_path / "breaks.py"
    model.write_text(BREAKING)
    line = BREAKING.splitlines().index(next(x for x in BREAKING.splitlines() if "graph_break()" in x)) + 1
    argv = ["fit", *TINY, *folders(tmp_path), "--nproc", "1", "--set", f"model.name={model}:build",
            "--set", "compile.enabled=true", "--set", "train.epochs=1"]  # fmt: skip
    strict = run_cli(*argv, "--run", "strict", "--set", "compile.strict=true", timeout=240 * startup_s())
    assert strict.returncode == 2, strict.stderr[-3000:]
    assert f"could not trace the training step whole: a graph break at {model}:{line}" in strict.stderr
    lenient = run_cli(*argv, timeout=240 * startup_s(), env={"TORCHINDUCTOR_CACHE_DIR": None})  # the default
    assert lenient.returncode == 0, lenient.stderr[-3000:]
    compiled = tmp_path / "cache" / "compiled"  # beside the run's caches: a resume loads its code, not compiles it
    assert compiled.is_dir() and any(p.is_file() for p in compiled.rglob("*")), "no compiled code cached"
    assert f"a graph break at {model}:{line}: Call to `torch._dynamo.graph_break()`" in lenient.stderr
    assert "the model is compiled alone" in lenient.stderr
    facts = json.loads((tmp_path / "runs" / "tiny" / "report" / "compile.json").read_text())
    assert facts["mode"] == "model" and facts["breaks"][0]["where"] == f"{model}:{line}", facts


def test_unet_trains_unrolled_through_torchrun_and_validates_by_rollout(tmp_path):
    proc = run_cli(
        "run", *TINY, *folders(tmp_path), "--set", "model.name=unet", "--set", "model.unet.init_features=4",
        "--set", "train.objective=unrolled", "--set", "train.rollout_steps=3", timeout=120 * startup_s(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(summary(tmp_path)) == {"advection1d", "darcy2d"}
    records = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in records if "val_nrmse" in r]
    assert len(validations) == 2  # one per epoch
    for r in validations:
        assert r["val_nrmse"] == pytest.approx((r["val_nrmse/advection1d"] + r["val_nrmse/darcy2d"]) / 2)
    best = min(validations, key=lambda r: r["val_nrmse"])["step"]  # best.pt follows the rollout nRMSE
    assert load_checkpoint(tmp_path / "runs" / "tiny" / "checkpoints" / BEST)["progress"]["global_step"] == best
    assert list((tmp_path / "cache").glob("advection1d/*/train_windows_k4_h3.npy"))


@pytest.mark.parametrize("model", ["conv", "resnet"])
def test_the_local_convolutional_baselines_train_through_torchrun_on_1d_and_2d_tasks(tmp_path, model):
    """The plain convolutional emulator and the ResNet at tiny width, by pushforward on the 1D advection and the 2D
    Darcy task (2 gloo ranks): trained, evaluated and reported as every built-in model. The plain one also with
    rank 1 SIGKILLed at a random step: the group restarts from the newest checkpoint and ends bitwise equal."""
    settings = [f"model.name={model}", f"model.{model}.width=8", "train.objective=pushforward", "train.rollout_steps=2"]
    settings = [arg for setting in settings for arg in ("--set", setting)]
    length = [*LONG[:6], "--set", "train.log_every=1"] if model == "conv" else ["--set", "train.epochs=1"]
    proc = run_cli("run", *TINY, "--nproc", "2", *folders(tmp_path), *settings, *length, timeout=120 * startup_s())
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = summary(tmp_path)
    assert set(scores) == {"advection1d", "darcy2d"}
    assert all(math.isfinite(s["nrmse"]) for s in scores.values()), scores
    saved = yaml.safe_load((tmp_path / "runs" / "tiny" / "config.yaml").read_text())["model"]
    assert saved["name"] == model and saved[model]["width"] == 8
    if model == "resnet":
        return
    killed_at = random.Random().randrange(12, 120)
    print(f"SIGKILL to rank 1 at step {killed_at}")
    restarts = ["--set", "dist.max_restarts=3", "--set", "dist.timeout_s=30"]
    job = start(tmp_path, "killed", *settings, *restarts)
    seen = wait_for_step(job, tmp_path / "runs" / "killed" / "metrics.jsonl", killed_at)
    os.kill(rank_pid(job.pid, 1), signal.SIGKILL)
    _, err = job.communicate(timeout=120 * startup_s())
    assert job.returncode == 0, err[-3000:]
    assert "resumed from" in (tmp_path / "runs" / "killed" / "logs" / "rank0.log").read_text(), f"killed after {seen}"
    assert_bitwise_equal(final_weights(tmp_path / "runs" / "killed"), final_weights(tmp_path / "runs" / "tiny"))


def test_a_rollout_longer_than_the_data_is_a_config_error_naming_the_settings(tmp_path):
    proc = run_cli(
        "run", *TINY, *folders(tmp_path), "--set", "train.objective=unrolled", "--set", "train.rollout_steps=30"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.rollout_steps=30 needs tasks.advection1d.initial_step + rollout_steps <= 21" in proc.stderr


BROKEN_FORWARD = {
    "raises": ("x.reshape(-1) @ self.w", "the model's forward raised RuntimeError"),
    "nan": ("torch.full((len(x), *self.specs[n].grid, self.specs[n].out_channels), float('nan')) * self.w",
            "is not finite (NaN or inf) on a probe batch"),
}  # fmt: skip


@pytest.mark.parametrize("broken", list(BROKEN_FORWARD))
def test_a_model_whose_forward_fails_or_is_not_finite_is_a_config_error(tmp_path, broken):
    prediction, message = BROKEN_FORWARD[broken]
    model = tmp_path / "broken.py"
    model.write_text(
        "import torch\n"
        "class Broken(torch.nn.Module):\n"
        "    def __init__(self, specs):\n"
        "        super().__init__()\n"
        "        self.specs, self.w = specs, torch.nn.Parameter(torch.ones(1))\n"
        "    def forward(self, inputs):\n"
        f"        return {{n: {prediction} for n, x in inputs.items()}}\n"
        "def build(specs):\n"
        "    return Broken(specs)\n"
    )
    proc = run_cli("fit", *TINY, *folders(tmp_path), "--set", f"model.name={model}:build", timeout=120 * startup_s())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
