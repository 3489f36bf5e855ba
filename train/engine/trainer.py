"""The training loop of one rank: DDP (+ torch.compile) over the multi-task model, equal steps on every rank.

Every decision that changes control flow is taken identically on all ranks: non-finite gradients are detected
after the all-reduce (all ranks hold the same gradients), stop requests and early stopping go through a
collective. Position, optimizer, scheduler, scaler and early-stopping state are checkpointed by rank 0, so a
resumed run replays the uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from train import run_files
from train.atomic import write_json_atomic
from train.checkpoint import (
    BEST,
    BEST_SHARDED,
    CONFIG,
    DATA,
    MODEL,
    MODEL_SOURCE,
    OPTIMIZER,
    PROGRESS,
    SCALER,
    SCHEDULER,
    SPECS,
    TASK_CARDS,
    WEIGHTS_FROM,
    RunState,
    check_same_model,
    checkpoint_name,
    latest_checkpoint,
    load_model_state,
    prune,
    resume_source,
    save_best,
    save_checkpoint,
)
from train.checkpoint import shards as checkpoint_shards
from train.config import Config
from train.distributed.collectives import broadcast_from_main
from train.distributed.env import DistEnv
from train.distributed.shared_checkpoint import shared_checkpoint
from train.engine import parallel
from train.engine.compile_report import CompileWatch
from train.engine.evaluate import validation_scores
from train.engine.init_from import freeze, load_initial_weights
from train.engine.loaders import (
    initial_model,
    predict,
    probe_batches,
    run_on_batches,
    steps_per_epoch,
    training_loaders,
)
from train.engine.loss import SKIPPED, LossWindow, task_loss
from train.engine.nonfinite import NonFiniteSteps, skip_on_device
from train.engine.objective import Unroll, draw_steps, unrolled_targets
from train.engine.optim import build_optimizer
from train.engine.param_groups import optimizer_groups
from train.engine.setup import (
    break_place,
    captures_graphs,
    check_no_dead_parameters,
    compile_enabled,
    compile_errors,
    compile_model,
    compile_off_reason,
    graph_mode,
    resolve_precision,
    unused_parameters,
)
from train.engine.signals import StopRequest
from train.engine.step import WholeStep, whole_step_unavailable
from train.engine.streams import (
    EpochStreams,
    continue_on_world_size,
    draw_group,
    draw_probabilities,
    step_seed,
    task_draws,
)
from train.errors import ConfigError, DataError, Preempted, StoreUnavailable
from train.model.builtin import MODELS
from train.model.factory import check_outputs, factory_source, forward_failed
from train.model.specs import TaskData
from train.obs.monitor import DataWait, Progress, system_figures
from train.obs.sinks import MetricSinks
from train.run_dir import RunDir

log = logging.getLogger(__name__)


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a step draws from. torch.manual_seed would also queue seeds for every lazily
    initialised backend, formatting a stack trace each time: a measurable cost at every step."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


class Trainer:
    """One rank's training of a run: ``fit`` for the whole loop; ``train_step``, ``state_dict`` and
    ``load_state_dict`` for callers (tests, the bench) that drive or inspect it step by step."""

    compile_backend: str | Callable | None = None
    """torch.compile's backend for the step (or the model) in place of compile.backend: a seam for tests of a
    failing compiler."""

    def __init__(self, cfg: Config, env: DistEnv, tasks: list[TaskData], run: RunDir):
        self.cfg, self.env, self.tasks, self.run = cfg, env, tasks, run
        self.names = [t.name for t in tasks]
        self.checkpoints = run.checkpoints
        self._set_up_model()
        self._set_up_step()
        self._set_up_data()
        self._set_up_bookkeeping()

    def _set_up_model(self) -> None:
        """The model: built, its initial weights (a fine-tuning source's), frozen parts, its outputs checked on a
        probe batch, the parameters each task leaves unused."""
        cfg, env, tasks, run = self.cfg, self.env, self.tasks, self.run
        self.model = initial_model(cfg, tasks, env.device)
        self.weights_from = run.weights_from() if cfg.train.init_from is not None else None
        # With checkpoints of its own the run resumes from them, whose weights replace the source's: the source,
        # which may be gone by now, is read only for a run's first start.
        if cfg.train.init_from is not None and latest_checkpoint(run.checkpoints) is None:
            if self.weights_from is None:
                raise DataError(
                    f"train.init_from is set but {run.inputs} records no source checkpoint; launch with "
                    "'python -m train fit' (or run), which resolves it"
                )
            load_initial_weights(self.model, cfg, self.weights_from)
        self.data = {t.name: t.info.source_checksums() for t in tasks}
        """The checksums of the files each task was built from, recorded in every checkpoint (train.run_data)."""
        freeze(self.model, cfg.train.freeze)
        for task in tasks:
            if task.latent is not None:  # before DDP, which then leaves the frozen encoder out of its buckets
                self.model.freeze_encoder(task.name, task.latent.encoder_state())
        probe = probe_batches(tasks, env.device)
        with torch.no_grad():
            inputs = {n: b["x"] for n, b in probe.items()}
            latents = {n: b["z"] for n, b in probe.items() if "z" in b}
            try:
                outputs = predict(self.model, inputs, latents)
            except Exception as e:
                if cfg.model.name in MODELS:
                    raise
                raise forward_failed(cfg.model.name, e, {n: x.shape for n, x in inputs.items()}) from None
            check_outputs(outputs, inputs, {t.name: t.spec for t in tasks}, cfg.model.name)
        self.model_source = factory_source(cfg.model.name)
        check_no_dead_parameters(self.model, lambda m: run_on_batches(m, probe))
        # Which parameters each task's forward leaves out: named if DDP ever reports a missing gradient (probed
        # now, because once DDP's hooks are attached a probe would count as a step).
        self.unused_by_task = {
            n: unused_parameters(self.model, lambda m, n=n: run_on_batches(m, {n: probe[n]})) for n in self.names
        }

    def _set_up_step(self) -> None:
        """The step: precision, compilation (the whole step, the model alone, or eager), the model spread over the
        ranks, the optimizer and its schedule."""
        cfg, env, tasks, run = self.cfg, self.env, self.tasks, self.run
        self.weighted = cfg.train.task_sampling == "weighted" and len(tasks) > 1
        # Tasks trained by rolling out (train.objective); DDP then wraps the rollout, run as one forward call.
        self.rolled_out = {t.name for t in tasks if t.spec.autoregressive and cfg.train.objective != "one_step"}
        self.unroll = bool(self.rolled_out)
        self.trained = Unroll(self.model, self.rolled_out) if self.unroll else self.model
        self.precision = resolve_precision(cfg.train.precision, env.device)
        self.compiling = compile_enabled(cfg.compile, env.device)
        self.backend = self.compile_backend or cfg.compile.backend
        not_whole = whole_step_unavailable(cfg, env, self.model, self.precision) if self.compiling else None
        whole = self.compiling and not_whole is None
        # The whole step compiled reduces the gradients itself; otherwise DDP (or FSDP2) wraps the model.
        self.ddp = self.trained if whole else self._wrap()
        self.sharded = parallel.is_sharded(self.model)
        self.shard_checkpoints = self.sharded and parallel.writes_shards(cfg, env, run.read_node_token())
        self.scaler = self.precision.scaler()
        self.steps = steps_per_epoch(cfg, tasks, env.world_size)
        self.micro = cfg.train.accumulate_steps
        groups = optimizer_groups(self.model, cfg.train.lr_groups, cfg.train.lr)  # train.lr_groups' rates
        self.optimizer, self.scheduler = build_optimizer(groups, cfg.train, self.steps * cfg.train.epochs)
        self.whole_step: WholeStep | None = None
        self.forward = self.ddp
        if whole:
            self.whole_step = WholeStep(
                self.model,
                self._predictions,
                self.optimizer,
                cfg,
                env,
                self.names,
                {t.name: cfg.tasks[t.name].loss_weight for t in tasks},
                self.rolled_out,
                self.precision,
                self.micro,
                graph_mode(cfg.compile, env),
                self.backend,
            )
            self.watch = CompileWatch("whole step", backend=str(self.backend))
        elif self.compiling:
            self.forward = compile_model(self.ddp, cfg.compile, env, self.backend)
            self.watch = CompileWatch("model", not_whole, str(self.backend))
        else:
            self.watch = CompileWatch("eager", compile_off_reason(cfg.compile, env.device))
        self.graphed = captures_graphs(cfg.compile, env)

    def _set_up_data(self) -> None:
        """The data: each task's loader and sampler, how tasks are drawn, the tasks validated."""
        cfg, env, tasks = self.cfg, self.env, self.tasks
        self.loaders, self.samplers = training_loaders(cfg, env, tasks, self.steps * self.micro)
        weights = [cfg.tasks[n].sampling_weight for n in self.names]
        sizes = [self.samplers[n].n_items for n in self.names]
        self.draw_p = draw_probabilities(weights, sizes, cfg.train.sampling_alpha)
        self.draw_group = draw_group(cfg.dist.parallel, env.rank, parallel.shard_group_size(cfg, env))
        self.weights = {t.name: cfg.tasks[t.name].loss_weight for t in tasks}
        self.val_tasks = [t for t in tasks if t.info.sizes["val"]]
        if cfg.train.early_stop_patience and not self.val_tasks:
            raise ConfigError(
                "train.early_stop_patience is set but no task has validation data: give a val file or set "
                "tasks.<name>.val_fraction > 0"
            )

    def _set_up_bookkeeping(self) -> None:
        """What the loop keeps count of: the run's state, non-finite steps, data waits, timings."""
        cfg = self.cfg
        self.state = RunState()
        self.nonfinite = NonFiniteSteps(
            self.names,
            cfg.train.on_nonfinite == "stop" and self.scaler is None,
            cfg.train.max_skipped_steps,
            lambda: latest_checkpoint(self.checkpoints),
        )
        self.data_wait = DataWait()
        self.first_step_done: float | None = None  # wall time; launch-to-first-step is logged once
        self.first_step_logged = False
        self.timings: dict[str, float] = {}
        self._count_tensors: dict[tuple, torch.Tensor] = {}
        self.compile_logged = False
        """Seconds of the last checkpoint write and of the resume's load, for the next metrics record."""
        self.launched_at: float | None = None

    def _wrap(self) -> nn.Module:
        """The rollout (or the model) wrapped for several ranks by dist.parallel (DDP, FSDP2)."""
        # Ranks drawing different tasks leave some parameters without a gradient, unless the model uses all of
        # them whatever the task (the multi-physics model): DDP searches for them only where the probe found any.
        find_unused = self.cfg.train.find_unused_parameters or (self.weighted and any(self.unused_by_task.values()))
        return parallel.wrap(self.trained, self.model, self.env, self.cfg, find_unused, self.precision)

    def _predictions(self, inputs: dict, latents: dict, free: int, grad: int) -> dict[str, torch.Tensor]:
        """The predictions a step trains on: the rollout of (free, grad) steps, or one step."""
        if self.unroll:
            return self.forward(inputs, free, grad)
        return predict(self.forward, inputs, latents)

    def _whole_step_failed(self, error: Exception) -> None:
        """The step could not be compiled whole; every rank meets the same failure at the same step, before any
        update. A graph break (in a model of the user's own) is said with its place and the model is compiled
        alone from then on; a compiler that fails leaves the step eager. compile.strict stops the run instead."""
        from torch._dynamo.exc import Unsupported

        place = break_place(error)
        broke = isinstance(error, Unsupported)
        if self.cfg.compile.strict and broke:
            raise ConfigError(
                f"torch.compile could not trace the training step whole: a graph break at {place}. Remove what "
                "breaks the graph there (docs/models.md, 'What compiles'), or set compile.strict=false to compile the "
                "model alone and run the rest of the step eagerly"
            ) from None
        if self.cfg.compile.strict:
            raise ConfigError(
                f"torch.compile failed ({type(error).__name__}: {str(error)[:500]}); set compile.strict=false to run "
                "the step eagerly, or compile.enabled=false"
            ) from None
        self.whole_step = None
        self.ddp = self._wrap()
        if broke:
            log.warning(
                "torch.compile: a graph break at %s; the model is compiled alone, the step around it eager", place
            )
            where, _, reason = place.partition(": ")
            self.watch.add_break(f"Graph break in user code at {where}\nGraph Break Reason: {reason}")
            self.watch.facts.mode, self.watch.facts.why = "model", f"a graph break at {where}"
            self.forward = compile_model(self.ddp, self.cfg.compile, self.env, self.backend)
        else:
            log.warning("torch.compile failed (%s: %s): the step runs eagerly", type(error).__name__, str(error)[:300])
            self.watch.facts.mode, self.watch.facts.why = "eager", f"the compiler failed: {str(error)[:200]}"
            self.forward = self.ddp

    # -- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self, whole: bool = True) -> dict:
        """A checkpoint's components (train.checkpoint's keys): model, optimizer, schedule, scaler, progress,
        and the config and task specs it was trained with; ``whole=False``: all but the model and optimizer
        (which a sharded checkpoint's ranks write as shards)."""
        return {
            **({MODEL: parallel.model_state(self.model)} if whole else {}),
            **({OPTIMIZER: parallel.optimizer_state(self.model, self.optimizer)} if whole else {}),
            SCHEDULER: self.scheduler.state_dict(),
            **({SCALER: self.scaler.state_dict()} if self.scaler is not None else {}),
            PROGRESS: asdict(self.state),
            CONFIG: self.cfg.model_dump(mode="json"),
            SPECS: {t.name: t.spec.as_dict() for t in self.tasks},
            TASK_CARDS: {t.name: t.card() for t in self.tasks},
            **({MODEL_SOURCE: self.model_source} if self.model_source else {}),
            DATA: self.data,
            **({WEIGHTS_FROM: self.weights_from} if self.weights_from else {}),
        }

    def load_state_dict(self, saved: dict, path=None) -> None:
        """Continue from a checkpoint's components (as :meth:`state_dict` wrote them; ``path`` names it). Of a
        sharded checkpoint (a folder), a sharded model reads its own shards, any other the consolidated state."""
        if path is not None and checkpoint_shards.is_sharded_checkpoint(path):
            if self.sharded:

                def read_shards(model: nn.Module, _) -> None:
                    checkpoint_shards.load_shards(path, model, self.optimizer)

                load_model_state(self.model, None, path, read_shards)
            elif MODEL not in saved:
                saved = {**saved, **checkpoint_shards.consolidated(path)}
        if MODEL in saved:
            load_model_state(self.model, saved[MODEL], path or self.checkpoints, parallel.load_model)
            parallel.load_optimizer(self.model, self.optimizer, saved[OPTIMIZER])
        self.scheduler.load_state_dict(saved[SCHEDULER])
        if self.scaler is not None and SCALER in saved:
            self.scaler.load_state_dict(saved[SCALER])
        self.state = RunState(**saved[PROGRESS])

    def resume(self, sha1: str | None = None) -> None:
        """Continue from the checkpoint rank 0 chooses (``sha1``: the bytes node 0's launcher chose), which
        every rank receives from rank 0 when the group spans nodes."""
        policy = self.cfg.train.resume
        # resume=never is carried out by the launcher, which archives older checkpoints once per launch: a
        # group restarted after a failure continues from what this launch wrote.
        own = "auto" if policy == "never" else policy
        choose = lambda: resume_source(own, self.checkpoints)  # noqa: E731
        path, saved = shared_checkpoint(self.env, self.checkpoints, choose, sha1, whole=not self.sharded)
        if path is None or saved is None:
            return
        check_same_model(saved, self.cfg.model, {t.name: t.spec.as_dict() for t in self.tasks}, path, "resume from")
        self._check_model_source(path, saved.get(MODEL_SOURCE))
        began = time.perf_counter()
        self.load_state_dict(saved, path)
        self.timings["resume_load_s"] = time.perf_counter() - began
        fixed_steps = self.cfg.train.steps_per_epoch is not None
        continue_on_world_size(self.state, self.env.world_size, self.steps, fixed_steps, self.weighted, path)
        log.info(
            "resumed from %s (epoch %d, step %d of the epoch, global step %d)",
            path,
            self.state.epoch,
            self.state.step_in_epoch,
            self.state.global_step,
        )

    def _check_mapped_sources(self) -> None:
        """A source file mapped in place that was rewritten while training read it: the steps since then read
        other bytes, so no checkpoint may record them as trained on this data (the one before stays)."""
        changed = [c for t in self.tasks for c in t.info.changed_mapped_sources()]
        if changed:
            raise DataError(
                f"data changed while this run trained on it: {'; '.join(changed)}. The steps since the last "
                "checkpoint read other bytes and are not saved. Put the file back as it was and re-run the same "
                "command, or start over on the new data (train.resume=never)"
            )

    def _check_model_source(self, path, saved: dict | None) -> None:
        """Refuse to continue with an edited factory file unless train.accept_changed_model_source says so."""
        now = self.model_source
        if not saved or not now or saved.get("sha256") == now["sha256"]:
            return
        if self.cfg.train.accept_changed_model_source:
            log.warning("resuming from %s with %s edited since (train.accept_changed_model_source)", path, now["file"])
            return
        raise ConfigError(
            f"cannot resume from {path}: {now['file']}, the source of model.name={self.cfg.model.name}, changed "
            f"since the checkpoint was written (SHA-256 {saved.get('sha256', '?')[:12]} then, {now['sha256'][:12]} "
            "now). Put the source back, set train.accept_changed_model_source=true if the change is intended (the "
            "saved weights are loaded into the edited model), or train.resume=never to start over"
        )

    def save(self) -> None:
        """Rank 0 writes; every rank waits, so no rank runs ahead of (or exits before) a checkpoint on disk."""
        self._settle()  # no checkpoint holds a step whose non-finite gradients were not judged
        if self.env.is_main:
            self._check_mapped_sources()
        began = time.perf_counter()
        if self.shard_checkpoints:
            folder, step = self.checkpoints, self.state.global_step
            self._save_shards(folder / checkpoint_name(step, sharded=True))
            if self.env.is_main:
                prune(folder, self.cfg.train.keep_checkpoints)
                log.info("checkpoint saved: %s (every rank's shards)", folder / checkpoint_name(step, sharded=True))
        else:
            state = self._gathered_state()
            if self.env.is_main:
                save_checkpoint(self.checkpoints, self.state.global_step, state, self.cfg.train.keep_checkpoints)
        dist.barrier()
        self.timings["checkpoint_s"] = time.perf_counter() - began  # in the next metrics record

    def _save_shards(self, final: Path) -> None:
        """Every rank writes its shards into the folder ``final``; rank 0 the other components."""
        components = self.state_dict(whole=False) if self.env.is_main else None
        checkpoint_shards.save_shards(final, self.model, self.optimizer, components, self.env.rank)

    def _gathered_state(self) -> dict | None:
        """The checkpoint's components on rank 0 (None elsewhere); a sharded model's are gathered by every rank."""
        if self.sharded or self.env.is_main:
            state = self.state_dict()
            return state if self.env.is_main else None
        return None

    # -- the loop ------------------------------------------------------------------------------------------

    def fit(
        self,
        sinks: MetricSinks,
        *,
        launched_at: float | None = None,
        live_console: bool = False,
        resume_sha1: str | None = None,
    ) -> None:
        """Train from the newest checkpoint (or the start) to train.epochs or an early stop. ``launched_at``: wall
        time the launcher started torchrun (logged as launch-to-first-step); ``live_console``: rank 0's progress
        bar may redraw in place; ``resume_sha1``: the checkpoint the launcher chose to continue from."""
        self.launched_at = launched_at
        self.resume(resume_sha1)
        cfg, env, s = self.cfg, self.env, self.state
        s.world_size = env.world_size
        if s.done(cfg.train.epochs):
            log.info("training already complete (global step %d)", s.global_step)
            return
        self.model.train()
        total = self.steps * cfg.train.epochs
        bar = Progress(total, s.global_step, "train", enabled=env.is_main, live=live_console)
        try:
            with StopRequest() as stop, bar:
                # Said once a stop request is handled (a checkpoint, exit 75): before, a signal ends the rank.
                log.info(
                    "training from epoch %d step %d: %d step(s) per epoch x %d micro-batch(es), %d rank(s), tasks "
                    "%s (%s), precision %s",
                    s.epoch + 1,
                    s.step_in_epoch,
                    self.steps,
                    self.micro,
                    env.world_size,
                    ", ".join(self.names),
                    "one drawn per rank and step" if self.weighted else "all in every step",
                    self.precision.name,
                )
                while not s.done(cfg.train.epochs):
                    self._epoch(stop, sinks, bar)
        finally:
            self.stop_workers()
            self._report_compile()

    def _report_compile(self) -> None:
        """The compile watch's line, if not logged yet, and rank 0's record for the report."""
        facts = self.watch.close()
        if not self.compile_logged:
            log.info("%s", self.watch.line())
            self.compile_logged = True
        if self.env.is_main and self.compiling:
            write_json_atomic(self.run.report / run_files.COMPILE, asdict(facts))
        elif self.env.is_main:  # an earlier launch's record must not describe this one
            (self.run.report / run_files.COMPILE).unlink(missing_ok=True)

    def stop_workers(self) -> None:
        """Shut the DataLoader workers down now, whatever holds on to this trainer. They ignore SIGTERM (a stop
        is the rank's to handle), so workers still alive at interpreter exit would hang it: multiprocessing's
        exit handler terminates them with SIGTERM and waits for them forever."""
        for loader in self.loaders.values():
            iterator = getattr(loader, "_iterator", None)  # a persistent workers' iterator
            if iterator is not None:
                iterator._shutdown_workers()
                loader._iterator = None
        for sampler in self.samplers.values():
            sampler.close()  # a streamed task's prefetch thread and its pins on the node's shard cache

    def _epoch(self, stop: StopRequest, sinks: MetricSinks, bar: Progress) -> None:
        cfg, s = self.cfg, self.state
        micro_steps = self.steps * self.micro
        draws = task_draws(cfg.run.seed, self.draw_group, s.epoch, micro_steps, self.draw_p) if self.weighted else None
        streams = EpochStreams(self.loaders, self.samplers, s.epoch, s.step_in_epoch * self.micro, micro_steps, draws)
        window = LossWindow(len(self.names), self.env.device)
        self.data_wait.take()
        while s.step_in_epoch < self.steps:
            if stop.agreed():
                self._stop_for_signal(stop)
            # Once warm, one whole step (with its bookkeeping) is traced: the operations outside compiled graphs.
            try:
                with self.watch.measured() if self.watch.wants_measure() else contextlib.nullcontext():
                    window.add(*self.train_step(streams))
            except StoreUnavailable as e:
                self._stop_for_store(e)
            self.first_step_done = self.first_step_done or time.time()
            s.step_in_epoch += 1
            s.global_step += 1
            bar.update(1)
            last_of_epoch = s.step_in_epoch == self.steps
            if last_of_epoch:
                s.epoch, s.step_in_epoch = s.epoch + 1, 0
            if s.global_step % cfg.train.log_every == 0 or last_of_epoch:
                self._log(window, sinks, bar)
            paused = time.perf_counter()
            val_due = cfg.train.val_every is None and last_of_epoch
            if val_due or (cfg.train.val_every is not None and s.global_step % cfg.train.val_every == 0):
                self._validate(sinks)
            every = cfg.train.checkpoint_every
            if last_of_epoch or s.early_stopped or (every is not None and s.global_step % every == 0):
                self.save()
            window.exclude(time.perf_counter() - paused)  # steady-state step time leaves out evaluation and saving
            if s.early_stopped or last_of_epoch:
                return

    def train_step(self, streams: EpochStreams) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """One optimizer step over ``accumulate_steps`` micro-batches; returns (loss sums, counts, samples,
        skipped: a device bool, true when the update was skipped for non-finite gradients)."""
        cfg, env, s = self.cfg, self.env, self.state
        sums, skipped, counts, samples = None, None, [0] * len(self.names), 0
        for m in range(self.micro):
            position = s.step_in_epoch * self.micro + m
            seed_step(step_seed(cfg.run.seed, env.rank, s.epoch, position), env.device)
            if self.graphed:  # a new step: the graphs' previous outputs (already summed) may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            with self.data_wait.fetching():
                batches = streams.batches_at(position)
            # Drawn after the step's seed, so that a resumed run draws the same.
            free, grad = draw_steps(cfg.train) if self.unroll else (0, 1)
            last = m == self.micro - 1
            part, done = self._micro_step(batches, free, grad, last)
            sums = part if sums is None else sums + part
            skipped = done if done is not None else skipped
            for name in batches:
                counts[self.names.index(name)] += 1
            samples += sum(len(b["x"]) for b in batches.values())
        if self.whole_step is None:
            skipped = self._optimizer_step(sums)
        else:
            self.nonfinite.record(self.state.global_step + 1, skipped, sums)
            self.scheduler.step()
            self.whole_step.set_lr()
        return sums, self._counts(counts), samples, skipped

    def _micro_step(self, batches: dict, free: int, grad: int, last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch's loss sums (names' order) and, from the whole step's last, whether it skipped."""
        device = self.env.device
        batches = {n: {k: v.to(device, non_blocking=True) for k, v in b.items()} for n, b in batches.items()}
        if self.whole_step is not None:
            kind = (free, grad, tuple(batches), last)
            try:
                with self._watched(kind):
                    return self.whole_step.run(batches, free, grad, last)
            except compile_errors() as e:
                self._whole_step_failed(e)
        # Gradients are all-reduced only on the last micro-batch; the others accumulate locally.
        with contextlib.nullcontext() if last else parallel.no_sync(self.ddp), self._watched((free, grad, last)):
            losses = self._forward_backward(batches, free, grad)
        sums = torch.zeros(len(self.names), device=device)
        for name, loss in losses.items():
            sums[self.names.index(name)] += loss.detach()
        return sums, None

    def _watched(self, kind) -> contextlib.AbstractContextManager:
        """A step counted by the compile watch (graphs compiled, recompiles, seconds)."""
        return contextlib.nullcontext() if self.watch.facts.mode == "eager" else self.watch.step(kind)

    def _counts(self, counts: list[int]) -> torch.Tensor:
        """The tasks' micro-batch counts of a step as a device tensor, made once per pattern: a tensor built from a
        list each step would wait for the GPU (a copy from pageable memory)."""
        key = tuple(counts)
        if key not in self._count_tensors:
            self._count_tensors[key] = torch.tensor(key, dtype=torch.float32, device=self.env.device)
        return self._count_tensors[key]

    def _forward_backward(self, batches: dict[str, dict[str, torch.Tensor]], free: int, grad: int) -> dict:
        inputs = {n: b["x"] for n, b in batches.items()}
        latents = {n: b["z"] for n, b in batches.items() if "z" in b}
        targets = {n: b["y"] for n, b in batches.items()}
        try:
            with self.precision.autocast():
                preds = self._predictions(inputs, latents, free, grad)
            if self.unroll:
                targets = {
                    n: unrolled_targets(y, free, grad) if n in self.rolled_out else y for n, y in targets.items()
                }
            losses = {n: task_loss(preds[n], targets[n]) for n in batches}
            loss = sum(self.weights[n] * v for n, v in losses.items()) / self.micro
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        except RuntimeError as e:
            if "Expected to have finished reduction" in str(e):
                raise self._reduction_error(batches) from None
            if self.compiling and self.cfg.compile.strict and isinstance(e, compile_errors()):
                raise ConfigError(
                    f"torch.compile failed ({type(e).__name__}: {str(e)[:500]}); set compile.strict=false to run "
                    "what fails eagerly, or compile.enabled=false"
                ) from None
            raise
        return losses

    def _reduction_error(self, batches: dict) -> ConfigError:
        """DDP's "Expected to have finished reduction" names no parameter; find the ones this step's tasks skip."""
        names = sorted(set.intersection(*(set(self.unused_by_task[n]) for n in batches)))
        return ConfigError(
            f"DDP found parameters without a gradient at step {self.state.global_step} on rank {self.env.rank} "
            f"(tasks this step: {', '.join(batches)}; unused on the probe batches: {', '.join(names[:20]) or 'none'}"
            f"): the model (model.name={self.cfg.model.name}) skips some of its parameters on some steps. Set "
            "train.find_unused_parameters=true (DDP then looks for them at every step, at some cost), or make its "
            "forward use every parameter at every step"
        )

    def _optimizer_step(self, sums: torch.Tensor) -> torch.Tensor:
        """Clip, then update unless the gradients are non-finite; returns that flag (a device bool)."""
        cfg = self.cfg.train
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        norm = parallel.grad_norm(
            nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], clip)
        )
        # The gradients were all-reduced, so every rank computes the same norm and takes the same decision. It
        # stays on the device (train.engine.nonfinite): the update is skipped there and judged at the next boundary.
        bad = ~torch.isfinite(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips by the scaler's own check, on the device for a fused AdamW
            self.scaler.update()
        elif skip_on_device(self.optimizer):
            self.optimizer.found_inf = bad.float()
            self.optimizer.step()
        elif not bool(bad):  # a model with complex parameters: no fused AdamW, the host decides
            self.optimizer.step()
        self.nonfinite.record(self.state.global_step + 1, bad, sums)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return bad

    def _settle(self) -> None:
        """Judge the steps since the last boundary (may raise: training diverged)."""
        self.nonfinite.settle()

    # -- validation, logging, stopping ---------------------------------------------------------------------

    def _validate(self, sinks: MetricSinks) -> None:
        if not self.val_tasks:
            return
        self._settle()  # best.pt is a checkpoint too
        s, cfg = self.state, self.cfg.train
        with parallel.gathered(self.ddp):  # shards of the val split differ: no collective inside the forwards
            val, score = validation_scores(
                self.model, self.val_tasks, self.env, cfg.eval_batch_size, self.weights, cfg.val_metric
            )
        improved = score < s.best_val - cfg.early_stop_min_delta
        if improved:
            s.best_val, s.bad_validations = score, 0
        else:
            s.bad_validations += 1
        stop = bool(cfg.early_stop_patience and s.bad_validations >= cfg.early_stop_patience)
        # Rank 0 decides and tells the others: a last-bit difference in a reduced loss can never split them.
        decision = torch.tensor([float(improved), float(stop)], device=self.env.device)
        broadcast_from_main(decision)
        improved, stop = bool(decision[0]), bool(decision[1])
        sinks.write({"step": s.global_step, "epoch": self._epoch_float(), **val})
        log.info(
            "validation at step %d: %s (%s %.4g%s)",
            s.global_step,
            ", ".join(f"{k} {v:.4g}" for k, v in val.items()),
            cfg.val_metric,
            score,
            ", best" if improved else f", {s.bad_validations} without improvement",
        )
        if improved and self.shard_checkpoints:
            self._save_shards(self.checkpoints / BEST_SHARDED)
            if self.env.is_main:  # one best: the one just written
                (self.checkpoints / BEST).unlink(missing_ok=True)
        elif improved:
            state = self._gathered_state()
            if self.env.is_main:
                save_best(self.checkpoints, state)
        if stop and not s.early_stopped:
            log.info("early stop at step %d: %d validations without improvement", s.global_step, s.bad_validations)
            s.early_stopped = True

    def _epoch_float(self) -> float:
        return self.state.epoch + self.state.step_in_epoch / self.steps

    def _log(self, window: LossWindow, sinks: MetricSinks, bar: Progress) -> None:
        self._settle()
        mean, throughput = window.take()
        s = self.state
        # A task without a loss in the window (not drawn, or only skipped steps) is null, never 0 or NaN.
        losses = {
            n: v if isinstance(v, float) and math.isfinite(v) else None for n, v in zip(self.names, mean, strict=True)
        }
        trained = [self.weights[n] * v for n, v in losses.items() if v is not None]
        record = {
            "step": s.global_step,
            "epoch": self._epoch_float(),
            "loss": sum(trained) if trained else None,
            **{f"loss/{n}": v for n, v in losses.items()},
            "lr": self.scheduler.get_last_lr()[0],
            **throughput,
            "data_wait": self.data_wait.take(),
            **system_figures(self.env.device),
        }
        if not self.first_step_logged and self.launched_at is not None:
            # From the launcher starting torchrun to this process's first finished step: process start-up,
            # imports, rendezvous, model setup, the first batches (and compilation).
            record["launch_to_first_step_s"] = self.first_step_done - self.launched_at
            log.info("first step done %.1f s after launch", record["launch_to_first_step_s"])
        if not self.first_step_logged:
            # What this rank holds of weights, gradients and optimizer state (its shards, under fsdp/hsdp).
            record["model_state_mib"] = parallel.local_state_bytes(self.model, self.optimizer) / (1 << 20)
        record.update(self.timings)
        self.timings.clear()
        self.first_step_logged = True
        if not self.compile_logged and (self.watch.facts.ops_outside_graphs is not None or not self.compiling):
            log.info("%s", self.watch.line())  # once warm: what compiled, and what a step still runs eagerly
            self.compile_logged = True
        sinks.write(record)
        said = lambda v, digits: f"{v:.{digits}g}" if isinstance(v, float) else str(v)  # noqa: E731
        loss = said(record["loss"], 4) if record["loss"] is not None else SKIPPED
        bar.update(0, loss=loss)
        skipped = record.get("skipped_steps")
        log.info(
            "epoch %.2f step %d loss %s (%s) %.0f samples/s, data wait %.0f%%%s",
            record["epoch"],
            s.global_step,
            loss,
            ", ".join(f"{n} {said(v, 3)}" for n, v in zip(self.names, mean, strict=True)),
            record["samples_per_s"],
            100 * record["data_wait"],
            f", {skipped} step(s) skipped" if skipped else "",
        )

    def _stop_for_store(self, error: StoreUnavailable) -> None:
        """The shard store stopped answering: every rank waited for the same shards of the same step, so all are
        here before that step's update. The run stops like a preemption, with a checkpoint of the step before."""
        s = self.state
        log.error("%s", error)
        self.save()
        if self.env.is_main:
            where = {"global_step": s.global_step, "epoch": s.epoch, "step_in_epoch": s.step_in_epoch}
            self.run.mark_preempted({**where, "signal": None, "reason": str(error).split("; the run stopped")[0]})
        dist.barrier()
        raise error

    def _stop_for_signal(self, stop: StopRequest) -> None:
        """Every rank is here at the same step: rank 0 checkpoints, marks the run as preempted, all exit 75."""
        s = self.state
        what = stop.received.name if stop.received is not None else "a stop request on another rank"
        log.warning("%s: stopping at global step %d and saving a checkpoint", what, s.global_step)
        self.save()
        if self.env.is_main:
            self.run.mark_preempted(
                {"global_step": s.global_step, "epoch": s.epoch, "step_in_epoch": s.step_in_epoch, "signal": what}
            )
        dist.barrier()
        raise Preempted(f"stopped by {what} at step {s.global_step} with a checkpoint; re-run to resume")
