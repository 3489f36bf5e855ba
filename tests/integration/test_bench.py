"""The benchmarks run end to end (``--quick``: tiny data and few steps, so their figures are not the targets')."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration


def bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``python -m train.bench ARGS --quick`` with its output and work folders in ``tmp_path``; must succeed."""
    folders = ["--out", str(tmp_path), "--workdir", str(tmp_path / "w")]
    proc = subprocess.run(
        [sys.executable, "-m", "train.bench", *args, "--quick", *folders],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_options_without_a_subcommand_run_every_benchmark():
    from train.bench.__main__ import parse_args

    assert parse_args([]).command == "all"
    args = parse_args(["--quick", "--strict"])
    assert (args.command, args.quick, args.strict) == ("all", True, True)
    args = parse_args(["trainer", "--steps", "50", "--warmup", "10", "--repeats", "2"])
    assert (args.command, args.steps, args.warmup, args.repeats) == ("trainer", 50, 10, 2)
    assert parse_args(["cache-io", "--cache-gb", "0.5"]).cache_gb == 0.5


def test_quick_cache_io_benchmark_writes_every_figure(tmp_path):
    proc = bench(tmp_path, "cache-io")
    result = json.loads((tmp_path / "cache_io.json").read_text())
    assert set(result["loaders"]) == {"mmap", "h5py", "shared"}
    for name, figures in result["loaders"].items():
        assert figures["samples_per_s"] > 0 and math.isfinite(figures["samples_per_s"]), name
        assert figures["samples_timed"] == 2 * (10 if name != "h5py" else 4) * (32 + 16), name
        assert figures["processes"] == 2 + 2 * 2 * 2  # ranks, and 2 workers per task loader on each
        assert figures["shm_peak_bytes"] >= 0
    # a shared-memory cache holds the data in /dev/shm once per rank; ours holds none of it there
    assert result["loaders"]["shared"]["shm_peak_bytes"] >= 2 * result["cache_bytes"]
    assert result["build"]["build_MBps"] > 0 and result["build"]["raw_read_MBps"] > 0
    assert len(result["targets"]) == 5 and all(isinstance(v, bool) for v in result["targets"].values())
    table = (tmp_path / "cache_io.md").read_text()
    assert "(a) mmap cache" in table and "build >= 50% of raw read" in table
    assert table in proc.stdout


def test_quick_trainer_benchmark_writes_every_figure(tmp_path):
    proc = bench(tmp_path, "trainer")
    result = json.loads((tmp_path / "trainer_step.json").read_text())
    for loop in ("ours", "bare"):
        assert result[loop]["step_time_s"] > 0 and math.isfinite(result[loop]["step_time_s"]), loop
        assert result[loop]["launch_to_first_step_s"] > 0, loop
    assert math.isfinite(result["ratio"]) and result["ratio"] > 0
    assert 0 <= result["ours"]["data_wait"] <= 1
    assert [r["bare"]["steps"] for r in result["repeats"]] == [result["setup"]["steps"]]
    assert list(result["targets"]) == ["step time ratio <= 1.05"]
    assert all(isinstance(met, bool) for met in result["targets"].values())
    table = (tmp_path / "trainer_step.md").read_text()
    assert "bare DDP loop" in table and table in proc.stdout


def test_quick_models_benchmark_trains_every_model_and_objective_and_tabulates_them(tmp_path):
    from train.bench.models import ENTRIES, QUICK_ENTRIES, QUICK_OWN_ENTRIES

    proc = bench(tmp_path, "models")
    result = json.loads((tmp_path / "models.json").read_text())
    entries = [(e["data"], e["model"], e["objective"]) for e in result["entries"]]
    assert entries == [("default", *e) for e in QUICK_ENTRIES] + [("own-data", *e) for e in QUICK_OWN_ENTRIES]
    own = result["entries"][-1]  # the generic arrays' periodic 1D task: its rollout scored at fixed steps
    assert set(own["nrmse"]) == {"ks"} and set(own["nrmse_at_step"]["ks"]) == {"1", "10", "50", "100", "200", "last"}
    assert (
        result["best"]["own-data"]["ks"]["model"] == "fno"
        and "Best at equal wall time: ks: fno one_step" in (tmp_path / "models.md").read_text()
    )
    result["entries"] = result["entries"][: len(QUICK_ENTRIES)]
    # Every objective and every model but the local convolutional baselines, which only the full benchmark runs.
    assert {e[0] for e in ENTRIES} - {e[0] for e in QUICK_ENTRIES} == {"conv", "resnet"}
    assert {e[0] for e in QUICK_ENTRIES} <= {e[0] for e in ENTRIES}
    assert {e[1] for e in QUICK_ENTRIES} == {e[1] for e in ENTRIES}
    assert result["setup"]["ranks"] == 1
    for e in result["entries"]:
        assert e["parameters"] > 1000 and e["step_time_s"] > 0 and e["steps"] == 8, e
        assert set(e["nrmse"]) == {"advection1d", "darcy2d"} and all(math.isfinite(v) for v in e["nrmse"].values())
    # Different models and objectives train different weights, so their scores differ.
    assert len({e["nrmse"]["advection1d"] for e in result["entries"]}) == len(QUICK_ENTRIES)
    assert len({e["parameters"] for e in result["entries"]}) == 3
    table = (tmp_path / "models.md").read_text()
    assert "PDEBench FNO, published" in table and table in proc.stdout
    rows = [line for line in table.splitlines() if line.startswith(("| fno", "| unet", "| transformer"))]
    assert sum(" ms |" in line for line in rows) == len(QUICK_ENTRIES) + len(QUICK_OWN_ENTRIES)  # the step times


def test_quick_remote_benchmark_mirrors_checkpoints_and_writes_the_ratio(tmp_path):
    proc = bench(tmp_path, "remote")
    result = json.loads((tmp_path / "remote.json").read_text())
    assert math.isfinite(result["ratio"]) and result["ratio"] > 0
    (pair,) = result["repeats"]
    assert pair["without"]["mirrored"] == [] and pair["with"]["mirrored"], pair  # at least the last checkpoint
    assert pair["with"]["step_time_s"] > 0 and pair["without"]["step_time_s"] > 0
    assert list(result["targets"]) == ["step time ratio with/without a slow remote <= 1.02"]
    table = (tmp_path / "remote.md").read_text()
    assert "slow remote" in table and table in proc.stdout


def test_quick_well_benchmark_runs_the_demo_config_from_nothing(tmp_path):
    proc = bench(tmp_path, "well")
    result = json.loads((tmp_path / "well.json").read_text())
    assert sorted(result["by_field"]) == ["A", "B"] and result["statistics"] == "train split"
    assert result["vrmse_ratio"] == result["baseline_one_step_vrmse"] / result["one_step_vrmse"] > 0
    assert result["wall_s"] > 0 and len(result["targets"]) == 2
    table = (tmp_path / "well.md").read_text()
    assert "| A |" in table and "vrmse_6_12" in table and table in proc.stdout


def test_quick_pretrain_benchmark_pretrains_on_1d_3d_and_well_data_and_fine_tunes_onto_the_held_out_set(tmp_path):
    """configs/pretrain.yaml's mix cut to three datasets (1D PDEBench, 3D PDEBench, The Well's 2D schema) through
    the CLI, each alone, then configs/finetune-riemann1d.yaml from the pretrained run and from scratch."""
    from train.checkpoint import SPECS, load_checkpoint

    proc = bench(tmp_path, "pretrain")
    result = json.loads((tmp_path / "pretrain.json").read_text())
    assert sorted(result["pretrained"]) == sorted(result["alone"]) == ["advection", "flow3d", "gray_scott"]
    assert result["held_out"] == "riemann1d" and sorted(result["curves"]) == ["fine-tuned", "scratch"]
    assert all(math.isfinite(v) for curve in result["curves"].values() for v in curve.values())
    assert result["summary"]["pretrained"]["tasks"] == 3
    runs = tmp_path / "w" / "pretrain" / "runs"
    specs = load_checkpoint(runs / "pretrain" / "checkpoints" / "best.pt")[SPECS]
    assert list(specs["flow3d"]["fields"]) == ["density", "pressure", "velocity_x", "velocity_y", "velocity_z"]
    assert list(specs["gray_scott"]["fields"]) == ["concentration_a", "concentration_b", "feed_rate", "kill_rate"]
    tuned = (runs / "fine-tuned-3" / "logs" / "rank0.log").read_text()
    # 1D Euler's fields are all known to the mix (from its 2D and 3D flows), and 1D patches of 8 from advection
    assert "initial weights from" in tuned and "fresh" not in tuned.partition("initial weights from")[2].split("\n")[0]
    table = (tmp_path / "pretrain.md").read_text()
    assert "| flow3d | cfd3d |" in table and table in proc.stdout


def test_quick_transfer_benchmark_fine_tunes_and_trains_from_scratch_on_held_out_shocks_over_seeds(tmp_path):
    """The data-efficiency benchmark at a tiny size: a mix of 2D Euler and Burgers pretrained, each alone, then
    1D Riemann problems from 2 and 8 trajectories, 2 seeds, both arms; the zero-shot error; the table."""
    from train.run_dir import RunDir

    proc = bench(tmp_path, "transfer")
    result = json.loads((tmp_path / "transfer.json").read_text())
    assert sorted(result["mix"]) == ["burgers", "euler2d"] and result["parameters"] > 0
    ((name, held),) = result["held_out"].items()
    assert name == "riemann1d" and held["pde"] == "euler1d" and math.isfinite(held["zero_shot"])
    for arm in ("scratch", "fine-tuned"):
        assert sorted(held["arms"][arm]) == ["2", "8"]
        for runs in held["arms"][arm].values():
            assert [r["seed"] for r in runs] == [0, 1] and all(math.isfinite(r["test"]) for r in runs)
        assert sorted(held["figures"][arm]) == ["2", "8"]
    assert len(result["targets"]) == 3 and all(isinstance(v, bool) for v in result["targets"].values())
    assert sorted(held["variants"]) == ["every weight at one rate (the arm)", "output rows zeroed", "trunk 0.1x"]
    runs = tmp_path / "w" / "transfer" / "runs"
    tuned, scratch = (
        RunDir(runs / "riemann1d-fine-tuned-n2-s1-lr0.001"),
        RunDir(runs / "riemann1d-scratch-n2-s1-lr0.001"),
    )
    assert tuned.weights_from()["source"] == str(runs / "pretrain") and scratch.weights_from() is None
    assert RunDir(runs / "riemann1d-fine-tuned-trunk-n2-s0-lr0.001").load_config().train.lr_groups == {"trunk": 0.1}
    zeroed = RunDir(runs / "riemann1d-fine-tuned-output-n2-s0-lr0.001").load_config()
    assert zeroed.train.init_reset == {"field_out": "zero"} and zeroed.train.init_from == str(runs / "pretrain")
    # the seeds' training files: the first trajectories of one pool in another order, the fixed test file beside
    folder = tmp_path / "w" / "transfer" / "held_out" / "riemann1d"
    assert (folder / "riemann1d_test.h5").is_file() and (folder / "n2-s0" / "riemann1d_train.h5").is_file()
    table = (tmp_path / "transfer.md").read_text()
    assert "| riemann1d (euler1d) | 2 |" in table and table in proc.stdout


def test_quick_scale_benchmark_builds_in_place_and_copied_caches_and_launches_in_a_memory_cgroup(tmp_path):
    from tests.helpers import unavailable
    from train.bench import cgroup

    reason = cgroup.why_not()
    if reason is not None:
        unavailable(f"no memory cgroup can be made: {reason}", "TRAIN_REQUIRE_CGROUP")
    proc = bench(tmp_path, "scale")
    result = json.loads((tmp_path / "scale.json").read_text())
    assert result["in_place"]["tasks"]["advection1d"]["in_place"] and result["in_place"]["tasks"]["cfd2d"]["in_place"]
    assert not result["copy"]["tasks"]["advection1d"]["in_place"]
    assert result["launch"]["exit"] == 0 and result["launch"]["oom_kills"] == 0
    roles = sorted({p["role"] for p in result["launch"]["processes"]})
    assert {"launcher", "rank", "worker"} <= set(roles), roles
    assert result["loader"]["samples_per_s_per_core"] > 0 and len(result["targets"]) == 7
    assert "| advection1d (in place) |" in (tmp_path / "scale.md").read_text() and "PASS" in proc.stdout
