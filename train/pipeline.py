"""The stages in order: data -> cache -> fit -> evaluate. Each is a no-op when its output is already valid.

Data and cache run here, in the launcher, before any rank starts: no rank ever sits in a collective's
timeout while a dataset is generated or a cache is built.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from train.atomic import write_json_atomic, write_text_atomic
from train.config import Config, load_config, to_yaml, training_differences
from train.data.cache import CacheInfo, build_cache, node_lock
from train.data.latent import build_latent_cache
from train.data.sources import SplitFiles, stage_data
from train.dist.launch import launch, resolve_nproc
from train.dist.preflight import check_shm_at_launch, doctor
from train.dist.session import LaunchSession, launch_session
from train.engine.checkpoint import archive_checkpoints, latest_checkpoint, load_checkpoint
from train.errors import ConfigError
from train.model.multitask import TaskSpec, check_specs
from train.obs.report import report_is_current
from train.worker import INPUTS

log = logging.getLogger(__name__)

STAGES = ("data", "cache", "fit", "evaluate")


def run_dir_of(cfg: Config) -> Path:
    assert cfg.run.name, "load_config names every run"
    return Path(cfg.run.runs_dir) / cfg.run.name


def stage_cache(cfg: Config, sources: dict[str, SplitFiles]) -> dict[str, dict[str, str | None]]:
    """Build (or find) every task's cache and latent cache; returns their folders by task."""
    root = Path(cfg.run.cache_dir)
    infos = {name: build_cache(name, cfg.tasks[name], sources[name], root) for name in cfg.tasks}
    problems, specs = [], {}
    for name, info in infos.items():
        task = cfg.tasks[name]
        if info.autoregressive and task.initial_step >= info.n_frames:
            problems.append(
                f"tasks.{name}.initial_step={task.initial_step} leaves nothing to predict: the data has "
                f"{info.n_frames} frames after temporal_stride={task.temporal_stride}"
            )
        specs[name] = TaskSpec(
            info.grid, info.in_channels, info.out_channels, task.patch_size, task.initial_step, info.autoregressive
        )
        problems += check_specs({name: specs[name]})
    if problems:
        raise ConfigError("the data does not fit the config:\n  - " + "\n  - ".join(problems))
    folders: dict[str, dict[str, str | None]] = {}
    for name, info in infos.items():
        encoder = cfg.tasks[name].latent_encoder
        latent = None
        if encoder is not None:
            with node_lock(root):
                latent = build_latent_cache(
                    name, info, specs[name], cfg.model.d_model, Path(encoder), f"tasks.{name}.latent_encoder"
                )
        folders[name] = {"cache": str(info.path), "latent": str(latent.path) if latent else None}
    return folders


def prepare_run_dir(cfg: Config) -> Path:
    """Create runs/<name>/ with the resolved config; refuse a folder that holds a different run."""
    run_dir = run_dir_of(cfg)
    saved = run_dir / "config.yaml"
    if saved.is_file():
        previous = load_config(saved)
        differences = training_differences(previous, cfg)
        if differences:
            raise ConfigError(
                f"{run_dir} holds a run with a different config ({', '.join(differences)}); pick another run "
                f"name (RUN=... or --run) or delete {run_dir} to start over"
            )
    write_text_atomic(saved, to_yaml(cfg))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return run_dir


def fit_is_done(cfg: Config, run_dir: Path) -> bool:
    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        return False
    progress = load_checkpoint(path)["progress"]
    return progress["early_stopped"] or progress["epoch"] >= cfg.train.epochs


def run_stages(
    cfg: Config,
    command: str,
    nproc: str | int | None = None,
    *,
    dry_run: bool = False,
    b2_api=None,
    preflight: bool = False,
) -> Path | None:
    """Run ``command`` (a stage, or 'run' for all) and the stages it needs, skipping what is valid.

    ``dry_run`` stops after printing what the data stage would fetch; ``b2_api`` replaces the B2 client
    built from the environment (tests use b2sdk's simulator); ``preflight`` runs the doctor first, and its
    /dev/shm check again once the caches are known. Commands that start ranks hold the run folder (and, across
    nodes, meet the other launchers) from their first stage to their last.
    """
    if command in ("data", "cache") or dry_run:
        sources = stage_data(cfg, dry_run=dry_run, b2_api=b2_api)
        if command == "cache" and not dry_run:
            stage_cache(cfg, sources)
        return None
    with launch_session(cfg, run_dir_of(cfg)) as session:
        return _launch_stages(cfg, command, nproc, session, b2_api=b2_api, preflight=preflight)


def _launch_stages(
    cfg: Config, command: str, nproc: str | int | None, session: LaunchSession, *, b2_api, preflight: bool
) -> Path:
    if preflight:
        doctor(cfg, nproc, quiet=True, data=False, rendezvous_held=session.hosts_rendezvous)
    session.between_stages()
    sources = stage_data(cfg, b2_api=b2_api)
    session.between_stages()
    folders = stage_cache(cfg, sources)
    session.between_stages()
    run_dir = prepare_run_dir(cfg)
    write_json_atomic(run_dir / INPUTS, folders)
    stages = []
    if command in ("run", "fit"):
        if cfg.train.resume == "never":
            archive_checkpoints(run_dir / "checkpoints")
            stages.append("fit")
        elif fit_is_done(cfg, run_dir):
            log.info("fit: %s already holds %d trained epochs", run_dir, cfg.train.epochs)
        else:
            stages.append("fit")
    if command in ("run", "evaluate"):
        if not stages and report_is_current(run_dir, latest_checkpoint(run_dir / "checkpoints")):
            log.info("evaluate: report in %s is up to date", run_dir / "report")
        else:
            stages.append("evaluate")
    if stages:
        n = resolve_nproc(nproc, cfg)
        if preflight:
            check_shm_at_launch(cfg, n, {name: CacheInfo.load(Path(f["cache"])) for name, f in folders.items()})
        session.ready_to_launch()
        launch(run_dir, n, cfg, ["--run-dir", str(run_dir), "--stages", ",".join(stages)])
    if command in ("run", "evaluate"):
        summary = json.loads((run_dir / "report" / "summary.json").read_text())
        for name, r in summary.items():
            log.info("%s: test nRMSE %.4g (baseline %.4g)", name, r["nrmse"], r["baseline_nrmse"])
        log.info("run folder: %s", run_dir)
    return run_dir
