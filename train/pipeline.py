"""The stages in order: data -> cache -> fit -> evaluate. Each is a no-op when its output is already valid.

Data and cache run here, in the launcher, before any rank starts: no rank ever sits in a collective's
timeout while a dataset is generated or a cache is built.
"""

from __future__ import annotations

import logging
from pathlib import Path

from train.checkpoint import (
    archive_checkpoints,
    checkpoint_for_evaluation,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    set_aside_unreadable,
)
from train.config import Config
from train.data.acquire.sources import SplitFiles, stage_data
from train.data.cache.build import build_cache, building_caches, window_span, write_window_index
from train.data.cache.info import CacheInfo
from train.data.dataset import target_frames
from train.data.stream.published import index_published
from train.data.stream.shards import write_shard_set
from train.data.stream.stage import describe_stream, prepare_stream
from train.disk import human
from train.errors import ConfigError, DataError, PreflightError, TrainError
from train.launch.continuity import check_same_data, initial_weights
from train.launch.doctor import check_shm_at_launch, doctor, require_writable_folders
from train.launch.plan import CheckpointRef, LaunchPlan
from train.launch.push import catch_up
from train.launch.session import LaunchSession, launch_session
from train.launch.torchrun import launch, resolve_nproc
from train.launch.watchers import watched_launch
from train.model.builtin import MODELS, check_builtin
from train.model.factory import resolve_factory
from train.model.latent import build_latent_cache
from train.model.specs import task_spec
from train.obs.report import diverged, diverged_error, figure, read_summary, report_is_current, summary_score
from train.obs.tracking import check_tracking
from train.remote.lease import RemoteLease
from train.remote.restore import check_remote_config, restore_run
from train.remote.store import Remote, open_remote
from train.run_dir import RunDir

log = logging.getLogger(__name__)

STAGES = ("data", "cache", "fit", "evaluate")


def stage_cache(cfg: Config, sources: dict[str, SplitFiles]) -> dict[str, dict[str, str | None]]:
    """Build (or find) every task's cache and latent cache; returns their folders by task."""
    root = Path(cfg.run.cache_dir)
    infos = {
        name: prepare_stream(name, cfg)
        if cfg.streamed(name)
        else build_cache(name, cfg.tasks[name], sources[name], root)
        for name in cfg.tasks
    }
    problems, specs = [], {}
    for name, info in infos.items():
        task = cfg.tasks[name]
        horizon, stride = target_frames(cfg.train), task.window_stride
        if task.well is not None and window_span(task.initial_step, task.well.n_steps_output, stride) > info.n_frames:
            w = task.well
            problems.append(
                f"tasks.{name}.well: a window of n_steps_input={w.n_steps_input} + n_steps_output={w.n_steps_output} "
                f"frames {stride} step(s) apart spans {window_span(task.initial_step, w.n_steps_output, stride)} "
                f"saved steps, longer than the trajectories' {info.n_frames}: lower them or dt_stride"
            )
        elif info.autoregressive and window_span(task.initial_step, 1, stride) > info.n_frames:
            problems.append(
                f"tasks.{name}.initial_step={task.initial_step} leaves nothing to predict: the data has "
                f"{info.n_frames} frames after temporal_stride={task.temporal_stride}"
            )
        elif info.autoregressive and window_span(task.initial_step, horizon, stride) > info.n_frames:
            problems.append(
                f"train.objective={cfg.train.objective} with train.rollout_steps={horizon} needs "
                f"tasks.{name}.initial_step + rollout_steps <= {info.n_frames} (the frames of its data after "
                f"temporal_stride={task.temporal_stride}): lower train.rollout_steps or initial_step"
            )
        elif info.autoregressive and horizon > 1:
            with building_caches(root):  # the ranks only read it
                write_window_index(info, task.initial_step, horizon, stride)
        specs[name] = task_spec(info, task, name)
        if cfg.model.name == "multiphysics":
            log.info("fields of %s: %s", name, ", ".join(specs[name].fields))
        problems += check_builtin({name: specs[name]}, cfg.model)
    if problems:
        raise ConfigError("the data does not fit the config:\n  - " + "\n  - ".join(problems))
    folders: dict[str, dict[str, str | None]] = {}
    for name, info in infos.items():
        encoder = cfg.tasks[name].latent_encoder
        latent = None
        if encoder is not None:
            with building_caches(root):
                latent = build_latent_cache(
                    name,
                    info,
                    specs[name],
                    cfg.model.transformer.d_model,
                    Path(encoder),
                    f"tasks.{name}.latent_encoder",
                )
        folders[name] = {"cache": str(info.path), "latent": str(latent.path) if latent else None}
    return folders


def write_shard_sets(cfg: Config, out: Path, shard_bytes: int, published: bool = False) -> None:
    """Every task's cache (built first where needed) as a shard set in ``out/<task>`` (train.data.stream);
    ``published``: each task's files as they are published, read once where they lie, and only the manifest
    written (train.data.stream.published)."""
    # The shards are written from the files themselves, whatever the config says of streaming them later.
    tasks = {name: task.model_copy(update={"stream": False}) for name, task in cfg.tasks.items()}
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"stream": False}), "tasks": tasks})
    require_writable_folders(cfg, "cache")
    if published:
        for name, task in cfg.tasks.items():
            shard_set = index_published(name, task, out / name, Path(cfg.run.cache_dir))
            print(
                f"{out / name}/stream.json: {len(shard_set.shards)} files as published, {human(shard_set.nbytes)}, "
                f"at {shard_set.published['files']}; stream them with tasks.{name}.source={out / name} (or the "
                "store you copy stream.json to) and data.stream=true"
            )
        return
    sources = stage_data(cfg)
    root = Path(cfg.run.cache_dir)
    for name, task in cfg.tasks.items():
        info = build_cache(name, task, sources[name], root)
        if not info.autoregressive:
            print(f"{name}: a steady task's pairs fit any disk; not sharded (it is read as before)")
            continue
        shard_set = write_shard_set(name, info, out / name, shard_bytes)
        print(
            f"{out / name}: {len(shard_set.shards)} shards, {human(shard_set.nbytes)}; stream it with "
            f"tasks.{name}.source={out / name} (or the store you copy the folder to) and data.stream=true"
        )


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
    if not dry_run:
        require_writable_folders(cfg, command)
    if command in ("data", "cache") or dry_run:
        sources = stage_data(cfg, dry_run=dry_run, b2_api=b2_api)
        for name in [n for n in cfg.tasks if cfg.streamed(n) and dry_run]:
            print("\n".join(describe_stream(name, cfg)))
        if command == "cache" and not dry_run:
            stage_cache(cfg, sources)
        return None
    with launch_session(cfg, RunDir.of(cfg)) as session:
        return _launch_stages(cfg, command, nproc, session, b2_api=b2_api, preflight=preflight)


def _launch_stages(
    cfg: Config, command: str, nproc: str | int | None, session: LaunchSession, *, b2_api, preflight: bool
) -> Path:
    if cfg.model.name not in MODELS:
        resolve_factory(cfg.model.name)  # a wrong path fails now, not after the data and cache stages
    check_tracking(cfg)
    if preflight:
        doctor(cfg, nproc, quiet=True, data=False, rendezvous_held=session.hosts_rendezvous)
    run = RunDir.of(cfg)
    remote = open_remote(cfg.run.remote, run.root.name, b2_api, run.root) if cfg.run.remote else None
    if remote is None or not session.leads:
        return _stages(cfg, command, nproc, session, run, remote, None, b2_api=b2_api, preflight=preflight)
    check_remote_config(cfg, remote)  # another run's remote is never written to, whatever train.resume says
    with RemoteLease(remote, cfg.run.remote_lease_s) as lease:  # one launch of the run at a time, on any box
        if cfg.train.resume != "never":
            restore_run(cfg, run, remote)  # a new machine, or unusable local checkpoints: the remote's copy
        return _stages(cfg, command, nproc, session, run, remote, lease, b2_api=b2_api, preflight=preflight)


def _stages(
    cfg: Config,
    command: str,
    nproc: str | int | None,
    session: LaunchSession,
    run: RunDir,
    remote: Remote | None,
    lease: RemoteLease | None,
    *,
    b2_api,
    preflight: bool,
) -> Path:
    session.between_stages()
    sources = stage_data(cfg, b2_api=b2_api)
    session.between_stages()
    folders = stage_cache(cfg, sources)
    session.between_stages()
    infos = {name: CacheInfo.load(Path(f["cache"])) for name, f in folders.items()}
    check_same_data(cfg, run, infos)  # the checkpoints were trained on these files, or the launch stops
    run.prepare(cfg)
    weights_from = initial_weights(cfg, run, command, b2_api)
    run.write_inputs(folders, {name: files.provenance for name, files in sources.items()}, weights_from)
    plan = None
    if session.leads:
        plan = plan_launch(cfg, command, run)
        run.write_node_token(plan.token)
    n = resolve_nproc(nproc, cfg)
    if preflight:
        check_shm_at_launch(cfg, n, infos)
    plan = session.ready_to_launch(plan)
    assert plan is not None, "node 0 posts a plan before it posts that it is ready"
    node_local = not session.leads and run.read_node_token() != plan.token
    if not session.leads:
        _say_node_0s_plan(plan, run, node_local)
    error = None
    if not plan.stages and remote is not None and session.leads:
        # A remote that fell behind in an earlier launch gets what it lacks.
        error = remote_behind(remote, run, catch_up(cfg, run, remote, lease))
    if plan.stages:
        try:
            start_over = cfg.train.resume == "never" and "fit" in plan.stages
            topology = session.topology
            watching = {"node_local": node_local, "lease": lease, "start_over": start_over, "topology": topology}
            with watched_launch(cfg, run, remote, **watching) as mirror:
                sha1 = plan.resume.sha1 if plan.resume else None
                stages = ["--stages", ",".join(plan.stages)]
                launch(run, n, cfg, stages, address=session.address, resume_sha1=sha1, topology=topology)
        except TrainError as e:
            error = e
        if error is None and mirror is not None and session.leads:
            error = remote_behind(remote, run, mirror.complete)
    session.conclude(error)
    if command in ("run", "evaluate") and session.leads:
        _say_scores(run)
    return run.root


def _say_node_0s_plan(plan, run: RunDir, node_local: bool) -> None:
    """Another node's launcher: what node 0 decided, and whose run folder this is."""
    log.info(
        "node 0 decided: %s%s. Run folder %s: %s",
        " and ".join(plan.stages) or "nothing to do",
        f", continuing from its {plan.resume.name} (SHA1 {plan.resume.sha1}), sent to these ranks by rank 0"
        if plan.resume and "fit" in plan.stages
        else "",
        run.root,
        "this node's own (node 0 holds the run's checkpoints, metrics and report; this node keeps its ranks' logs)"
        if node_local
        else "node 0's too (one shared file system)",
    )


def _say_scores(run: RunDir) -> None:
    """The report's test scores in the log, per task and over the tasks; a diverged task is an error."""
    results = read_summary(run.root)
    for name, r in results.items():
        line = f"{name}: test nRMSE {figure(r.get('nrmse'))} (baseline {figure(r.get('baseline_nrmse'))})"
        if r.get("nrmse_dynamic") != r.get("nrmse"):  # a field constant over trajectories left out
            line += f"; of the changing fields {figure(r.get('nrmse_dynamic'))}"
            line += f" (baseline {figure(r.get('baseline_nrmse_dynamic'))})"
        log.info("%s", line)
    if len(results) > 1:
        score = summary_score(results)
        log.info(
            "over the %d tasks: mean test nRMSE of the changing fields %s, over the baseline's %s (geometric mean)",
            score["tasks"],
            figure(score["mean_nrmse"]),
            figure(score["nrmse_to_baseline"]),
        )
    failed = diverged(results)
    if failed:  # a report written earlier (this launch had nothing left to do) says so all the same
        raise diverged_error(failed, str(checkpoint_for_evaluation(run.checkpoints)), run.report)
    log.info("run folder: %s", run.root)


def remote_behind(remote: Remote, run: RunDir, complete: bool | None) -> PreflightError | None:
    """A launch whose training ended well but whose remote lacks part of it fails (exit 4): on a rented box
    that is given back after the job, what the remote lacks is lost, so a scheduler must not see success."""
    if complete is not False:
        return None
    return PreflightError(
        f"remote: {remote.url} does not hold all of {run.root} (the warnings above say what is missing and why); "
        "nothing is lost here: re-run the same command, or `python -m train push`, once the remote can be reached, "
        "before this machine goes"
    )


def plan_launch(cfg: Config, command: str, run: RunDir) -> LaunchPlan:
    """What this launch does, from the run folder of the node that decides (the only one, or node 0): the rank
    stages still to run and the checkpoint training continues from."""
    stages = []
    if cfg.train.resume != "never" or command == "evaluate":
        moved = set_aside_unreadable(run.checkpoints)  # resume or score the newest readable checkpoint, not stop
        steps_moved = [p for p in moved if checkpoint_step(p.name.rsplit(".", 1)[0]) is not None]
        if steps_moved and not list_checkpoints(run.checkpoints):
            where = "" if cfg.run.remote is None else f", nor could run.remote={cfg.run.remote} give an intact one"
            raise DataError(
                f"every checkpoint in {run.checkpoints} is unreadable (moved to {steps_moved[0].parent}/){where}; "
                "nothing is trained over them. Put an intact copy back, or start over with train.resume=never"
            )
    if command in ("run", "fit"):
        if cfg.train.resume == "never":
            archive_checkpoints(run.checkpoints)
            stages.append("fit")
        elif run.fit_is_done(cfg):
            log.info("fit: %s already holds %d trained epochs", run.root, cfg.train.epochs)
        else:
            stages.append("fit")
    if command in ("run", "evaluate"):
        if not stages and report_is_current(run.root, checkpoint_for_evaluation(run.checkpoints)):
            log.info("evaluate: report in %s is up to date", run.report)
        else:
            stages.append("evaluate")
    newest = latest_checkpoint(run.checkpoints) if "fit" in stages else None
    return LaunchPlan.new(stages, CheckpointRef.of(newest) if newest is not None else None)
