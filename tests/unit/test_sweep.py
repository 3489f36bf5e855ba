"""Sweeps without training: the search space checked against the config, the study's claims across workers, the
samplers' draws, the leaderboard and best config, the job array, the division of the machine, and a sweep's W&B
group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.helpers import folders, run_cli
from tests.sweeps import BASE
from train.config import load_config
from train.errors import ConfigError
from train.sweep.driver import open_sweep, write_array
from train.sweep.results import write_results
from train.sweep.space import read_spec
from train.sweep.study import Claim, SweepStudy
from train.sweep.trials import Slot, TrialRun, divide_machine, trial_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def overrides(tmp: Path) -> list[str]:
    words = [*BASE[2:], *folders(tmp)]
    return [w for w in words if w != "--set"]


def open_with(tmp: Path, space: str, name: str = "s") -> SweepStudy:
    path = tmp / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(space)
    study, _ = open_sweep("configs/tiny.yaml", overrides(tmp), str(path), name)
    return study


BAD = {
    "unknown key": ("space:\n  model.fno.widht: [8]\n", r"space\.model\.fno\.widht is not a key.*model\.fno\.width"),
    "range on text": ("space:\n  model.name: {low: 1, high: 2}\n", r"space\.model\.name: a range needs a numeric key"),
    "empty choices": ("space:\n  train.lr: []\n", r"space\.train\.lr: the list of choices is empty"),
    "refused choice": ("space:\n  train.epochs: [2, 0]\n", r"space\.train\.epochs: the choice 0 is refused"),
    "unreported metric": (
        "sampler: grid\nmetric: val_acc\nspace:\n  train.lr: [0.001]\n",
        r"metric='val_acc' is not reported.*val_nrmse",
    ),
    "grid range without step": (
        "sampler: grid\nspace:\n  train.lr: {low: 0.001, high: 0.01}\n",
        r"space\.train\.lr: the grid sampler needs",
    ),
    "grid too small": ("sampler: grid\ntrials: 3\nspace:\n  train.lr: [0.001, 0.002]\n", r"trials=3 is more than"),
    "no trials": ("sampler: tpe\nspace:\n  train.lr: [0.001, 0.002]\n", r"trials is required with sampler=tpe"),
    "unknown spec key": ("samplr: grid\nspace:\n  train.lr: [0.001]\n", r"samplr: Extra inputs are not permitted"),
    "swept run name": ("space:\n  run.name: [a, b]\n", r"space\.run\.name: the sweep names each trial's folder"),
    "infinite bound": ("sampler: random\ntrials: 2\nspace:\n  train.lr: {low: 0.001, high: .inf}\n",
                       r"space\.train\.lr\.high: Value error, inf is not a finite number"),
    "negative seed": ("seed: -5\nsampler: grid\nspace:\n  train.lr: [0.001]\n",
                      r"seed: Input should be greater than or equal to 0"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_search_space_is_refused_before_any_trial_naming_the_key(tmp_path, case):
    text, message = BAD[case]
    with pytest.raises(ConfigError, match=message):
        open_with(tmp_path, text)
    assert not (tmp_path / "runs" / "s").exists()


def test_the_command_exits_2_on_a_bad_space_and_starts_nothing(tmp_path):
    space = tmp_path / "bad.yaml"
    space.write_text("space:\n  model.fno.widht: [8, 16]\n")
    proc = run_cli("sweep", *BASE, "--space", str(space), *folders(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.fno.widht" in proc.stderr and not (tmp_path / "runs").exists()


def test_grid_ranges_step_from_low_to_high_and_set_the_grid_size(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("sampler: grid\nspace:\n  model.fno.modes: {low: 4, high: 12, step: 4}\n  train.lr: [0.1, 0.2]\n")
    spec = read_spec(path)
    assert spec.grid() == {"model.fno.modes": [4, 8, 12], "train.lr": [0.1, 0.2]} and spec.grid_size() == 6


def test_a_trial_is_claimed_by_one_worker_and_a_stopped_one_resumes_in_another(tmp_path):
    space = "sampler: grid\npruner: none\nspace:\n  train.lr: [0.001, 0.002, 0.003]\n"
    a, b = open_with(tmp_path, space), open_with(tmp_path, space)
    first, second = a.claim_next(), b.claim_next()
    assert (first.number, second.number) == (0, 1) and first.params != second.params
    assert a.is_claimed(0) and not first.resumed
    first.release()  # its worker died: the trial is RUNNING and nobody's
    again = b.claim_next()
    assert (again.number, again.resumed, again.params) == (0, True, first.params)
    a.finish(second, TrialState.COMPLETE, 0.5)
    second.release()
    third = a.claim_next()
    assert third.number == 2 and a.claim_next() is None  # the budget is spent, the rest are held
    a.finish(third, TrialState.COMPLETE, 0.4)
    b.finish(again, TrialState.COMPLETE, 0.6)
    assert a.is_done() and len(a.trials()) == 3


def test_workers_taking_turns_draw_what_one_worker_draws(tmp_path):
    space = "sampler: random\ntrials: 4\nseed: 3\nspace:\n  train.lr: {low: 1.0e-4, high: 1.0e-2, log: true}\n"
    one = open_with(tmp_path / "one", space)
    alone = [one.claim_next().params for _ in range(4)]
    a, b = open_with(tmp_path / "two", space), open_with(tmp_path / "two", space)
    turns = [(a if i % 2 else b).claim_next().params for i in range(4)]
    assert turns == alone and len({p["train.lr"] for p in alone}) == 4


def test_the_leaderboard_ranks_finished_trials_and_best_yaml_is_a_config_of_its_own(tmp_path):
    study = open_with(tmp_path, "sampler: grid\npruner: none\nspace:\n  model.fno.width: [8, 12, 16]\n")
    base = load_config("configs/tiny.yaml", overrides(tmp_path))
    values = {}
    for value, state in ((0.5, TrialState.COMPLETE), (None, TrialState.FAIL), (0.25, TrialState.COMPLETE)):
        claim = study.claim_next()
        cfg = trial_config(base.model_dump(mode="json"), claim.params, study.root, claim.number)
        (study.root / "configs").mkdir(exist_ok=True)
        from train.config import to_yaml

        (study.root / "configs" / f"trial-{claim.number:03d}.yaml").write_text(to_yaml(cfg))
        study.set_attrs(claim, steps=20, seconds=3.0, **({"exit_code": 1, "error": "boom"} if value is None else {}))
        study.finish(claim, state, value)
        values[claim.number] = (claim.params["model.fno.width"], value)
        claim.release()
    summary = write_results(study, base.run.runs_dir).read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "rank" not in line]
    assert [r.split(" | ")[1] for r in rows] == ["trial-002", "trial-000", "trial-001"]
    assert "failed (exit 1)" in rows[2] and "- trial-001: boom" in summary
    best = load_config(study.root / "best.yaml")
    assert best.model.fno.width == values[2][0] and best.run.name == "s-best"
    assert best.run.runs_dir == base.run.runs_dir and best.obs.wandb.group is None
    assert (study.root / "plots" / "by_parameter.png").stat().st_size > 0


def test_the_job_array_runs_one_task_per_trial_some_at_once_each_taking_trials(tmp_path):
    study = open_with(tmp_path, "sampler: grid\nparallel: 2\nspace:\n  train.lr: [0.001, 0.002, 0.003]\n")
    base = load_config("configs/tiny.yaml", overrides(tmp_path))
    text = write_array(study, base, "configs/tiny.yaml", ["model.name=fno"], "s.yaml", None).read_text()
    assert "#SBATCH --array=0-2%2" in text and "#SBATCH --output=%x-%A_%a.out" in text
    assert "#SBATCH --job-name=s" in text and "#SBATCH --requeue" in text
    assert "-m train sweep --config configs/tiny.yaml --space s.yaml --name s --set model.name=fno --array-task" in text
    with pytest.raises(ConfigError, match=r"slurm\.nodes=2: a sweep's array tasks run single-node trials"):
        write_array(study, base.model_copy(update={"slurm": base.slurm.model_copy(update={"nodes": 2})}),
                    "configs/tiny.yaml", [], "s.yaml", None)  # fmt: skip


def test_trials_at_once_get_disjoint_cores_and_never_more_than_there_are(tmp_path):
    base = load_config("configs/tiny.yaml", overrides(tmp_path))
    cores = len(os.sched_getaffinity(0))
    slots = divide_machine(cores, base)
    assert sorted(c for s in slots for c in s.cpus) == sorted(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=rf"parallel={cores + 1} trials at once, but this process may use {cores}"):
        divide_machine(cores + 1, base)
    if cores >= 2:
        two_ranks = base.model_copy(update={"dist": base.dist.model_copy(update={"nproc": cores})})
        with pytest.raises(ConfigError, match=r"dist\.nproc=\d+ CPU ranks per trial"):
            divide_machine(2, two_ranks)


def test_a_trial_lives_in_the_sweeps_folder_its_remote_beside_its_siblings_and_wandb_groups_it(tmp_path):
    base = load_config("configs/tiny.yaml", [*overrides(tmp_path), "run.remote=/shared/runs"])
    cfg = trial_config(base.model_dump(mode="json"), {"model.fno.width": 12}, tmp_path / "runs" / "sw", 3)
    assert (cfg.run.runs_dir, cfg.run.name, cfg.model.fno.width) == (str(tmp_path / "runs" / "sw"), "trial-003", 12)
    assert cfg.run.remote == "/shared/runs/sw" and cfg.obs.wandb.group == "sw"


def test_a_sweeps_trial_is_a_wandb_run_in_the_sweeps_group(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from tests.wandb_offline import offline_runs
    from train.obs.tracking import Outcome, open_tracker

    base = load_config("configs/tiny.yaml", [*overrides(tmp_path), "obs.wandb.mode=offline", "obs.wandb.project=t"])
    cfg = trial_config(base.model_dump(mode="json"), {}, tmp_path / "runs" / "sw", 0)
    root = tmp_path / "runs" / "sw" / "trial-000"
    root.mkdir(parents=True)
    (root / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    tracking = open_tracker(cfg, root)
    tracking.finish(Outcome("finished", 0), root / "report")
    (run,) = offline_runs(root)
    assert run.group == "sw" and run.history[0]["loss"] == 0.5 and run.summary["outcome"] == "finished"


def test_a_sweep_folder_is_continued_only_by_the_same_search(tmp_path):
    open_with(tmp_path, "sampler: grid\nspace:\n  train.lr: [0.001, 0.002]\n")
    open_with(tmp_path, "sampler: grid\nparallel: 2\nspace:\n  train.lr: [0.001, 0.002]\n")  # how it runs may change
    with pytest.raises(ConfigError, match=r"search space differs in space"):
        open_with(tmp_path, "sampler: grid\nspace:\n  train.lr: [0.001, 0.003]\n")
    path = tmp_path / "s.yaml"
    path.write_text("sampler: grid\nspace:\n  train.lr: [0.001, 0.002]\n")
    with pytest.raises(ConfigError, match=r"another base config \(it differs in train\.epochs\)"):
        open_sweep("configs/tiny.yaml", [*overrides(tmp_path), "train.epochs=9"], str(path), "s")


def test_the_shipped_search_space_fits_the_default_config(tmp_path):
    study, base = open_sweep("configs/default.yaml", [f"run.runs_dir={tmp_path}"], "configs/sweeps/fno.yaml", None)
    assert study.name == "fno" and study.budget == 8 and base.model.name == "fno"
    claim = study.claim_next()
    assert set(claim.params) == {"model.fno.width", "model.fno.modes", "train.lr"}
    assert claim.params["model.fno.width"] % 4 == 0 and 3e-4 <= claim.params["train.lr"] <= 1e-2


def test_a_trials_scores_are_followed_through_a_metrics_file_restored_shorter(tmp_path):
    """A trial's run folder restored from an older mirror rewrites metrics.jsonl shorter: the scores written
    after it still reach the scheduler."""
    base = load_config("configs/tiny.yaml", overrides(tmp_path))
    cfg = trial_config(base.model_dump(mode="json"), {}, tmp_path / "runs" / "sw", 0)
    trial = TrialRun(Claim(0, 0, {}, False, -1), cfg, Slot(), "val/loss", set())
    metrics = Path(cfg.run.runs_dir) / cfg.run.name / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"step": 10, "val/loss": 0.5}\n{"step": 20, "val/loss": 0.4}\n{"step": 30, "val/loss": 0.3}\n')
    assert trial.new_scores() == [(10, 0.5), (20, 0.4), (30, 0.3)]
    metrics.write_text('{"step": 10, "val/loss": 0.5}\n{"step": 40, "val/loss": 0.2}\n')
    assert trial.new_scores() == [(40, 0.2)] and trial.best() == 0.2
