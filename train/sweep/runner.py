"""A sweep worker: takes trials from the study and runs them, ``parallel`` at once on this machine (or one at a
time in a SLURM array task), until no trial is left to take.

The loop owns every decision a trial's end calls for: its score told to the study, a pruning decision from the
scores it reports on the way, a failure recorded with its exit code and error. Signals never interrupt it mid-
write: a stop (SIGTERM, SIGUSR1, SIGHUP) is taken at the top of the loop, passed to the trials (which
checkpoint and exit 75), and the worker exits 75 with those trials left to resume.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator

from optuna.trial import TrialState

from train.errors import DistributedError, PreflightError, StopRequested, TrainError
from train.launch.stop import stop_signals_deferred
from train.sweep.study import Claim, SweepStudy, trial_name
from train.sweep.trials import Slot, TrialRun, trial_config

log = logging.getLogger(__name__)

POLL_S = 1.0
PRUNED = "pruned"


def machine_failure(code: int) -> bool:
    """An exit code that says this machine failed the trial, not its parameters: the environment (a full disk,
    the doctor, a run folder in use: 4), the distributed runtime (5), or a signal from outside (128+N: the OOM
    killer, a SIGBUS). Such a trial is not counted as failed: the sweep stops with its code and the trial
    resumes from its checkpoint once the sweep is re-run."""
    return code in (PreflightError.exit_code, DistributedError.exit_code) or code > 128


class SweepStopped(TrainError):
    """A trial ended for a reason of this machine's (:func:`machine_failure`): the sweep ends with its code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.exit_code = code


def _params_text(params: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


@contextlib.contextmanager
def _ctrl_c_into(arrived: list[int]) -> Iterator[None]:
    """Ctrl-C stops the sweep as SIGTERM does (the trials checkpoint), not wherever Python happens to be."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Worker:
    def __init__(self, study: SweepStudy, base: dict, slots: list[Slot]):
        self.study, self.base, self.slots = study, base, slots
        self.metric = study.spec.metric
        self.running: dict[int, TrialRun] = {}
        self.stopped_outside: str | None = None
        """A trial stopped from outside the sweep (exit 75 unasked): the sweep stops its other trials too."""
        self.machine_failed: SweepStopped | None = None
        """A trial ended by a failure of this machine: the sweep stops its other trials and exits with its code."""

    def run(self, on_trial_end=None) -> None:
        """Run trials until none is left to take; ``on_trial_end()`` after each (the results are rewritten).

        A worker with nothing left to take ends even while other workers' trials run: should one of those be
        stopped, its own worker (a requeued array task, a re-run sweep command) or any later one resumes it."""
        can_claim = True
        with stop_signals_deferred() as arrived, _ctrl_c_into(arrived):
            while True:
                if arrived or self.stopped_outside or self.machine_failed:
                    self._stop_all(arrived)
                if can_claim and len(self.running) < len(self.slots):
                    can_claim = self._fill_slots()
                for index, trial in list(self.running.items()):
                    self._check_pruning(trial)
                    code = trial.poll()
                    if code is not None:
                        del self.running[index]
                        self._conclude(trial, code)
                        can_claim = True
                        if on_trial_end is not None:
                            on_trial_end()
                if not self.running and not can_claim:
                    if not self.study.stopping_elsewhere():
                        return
                    can_claim = True
                time.sleep(POLL_S)

    def _fill_slots(self) -> bool:
        for index, slot in enumerate(self.slots):
            if index in self.running:
                continue
            claim = self.study.claim_next()
            if claim is None:
                return False
            self.running[index] = self._start(claim, slot)
        return True

    def _start(self, claim: Claim, slot: Slot) -> TrialRun:
        cfg = trial_config(self.base, claim.params, self.study.root, claim.number)
        frozen = self.study.storage.get_trial(claim.trial_id)
        trial = TrialRun(claim, cfg, slot, self.metric, set(frozen.intermediate_values))
        trial.start()
        how = "resumes from its checkpoint" if claim.resumed else "started"
        log.info(
            "sweep %s: %s %s (%s): %s -> %s",
            self.study.name,
            trial_name(claim.number),
            how,
            self.study.position(claim.number),
            _params_text(claim.params),
            trial.root,
        )
        return trial

    def _check_pruning(self, trial: TrialRun) -> None:
        fresh = trial.new_scores()
        if not fresh or trial.stop_sent is not None:
            return
        live = self.study.live_trial(trial.claim)
        for step, value in fresh:
            live.report(value, step)
        if live.should_prune():
            step, value = fresh[-1]
            self.study.set_attrs(trial.claim, pruned_at_step=step, pruned_score=value)
            log.info(
                "sweep %s: %s pruned at step %d: %s %.4g is worse than the other trials at that step",
                self.study.name,
                trial_name(trial.claim.number),
                step,
                self.metric,
                value,
            )
            trial.stop(PRUNED)

    def _conclude(self, trial: TrialRun, code: int) -> None:
        trial.new_scores()
        claim, name = trial.claim, trial_name(trial.claim.number)
        seconds = time.monotonic() - trial.started
        attrs = self.study.attrs(claim)
        self.study.set_attrs(
            claim,
            seconds=round(attrs.get("seconds", 0.0) + seconds, 1),
            steps=max(trial.last_step, attrs.get("steps", 0)),
            launches=attrs.get("launches", 0) + 1,
            run=str(trial.root),
        )
        try:
            if trial.stop_sent == PRUNED and code in (0, 75):
                self.study.finish(claim, TrialState.PRUNED)
                return
            if code == 75:
                if trial.stop_sent is None:  # stopped from outside: the sweep stops with it, to resume later
                    self.stopped_outside = name
                log.info(
                    "sweep %s: %s stopped at step %d (checkpoint saved): a later sweep resumes it",
                    self.study.name,
                    name,
                    trial.last_step,
                )
                return
            if machine_failure(code):  # left running, to resume: its parameters are not to blame
                error = trial.error_line()
                self.study.set_attrs(claim, exit_code=code, error=error)
                self.machine_failed = SweepStopped(
                    code,
                    f"{name} ended with exit {code}, a failure of this machine, not of its parameters ({error}); the "
                    "sweep stops with its code. Fix the cause and re-run the same sweep command: the trial resumes "
                    "from its checkpoint, finished trials are kept",
                )
                log.error("sweep %s: %s", self.study.name, self.machine_failed)
                return
            best = trial.best()
            if code == 0 and best is not None:
                self.study.finish(claim, TrialState.COMPLETE, best)
                log.info(
                    "sweep %s: %s finished in %.0f s: %s %.4g%s",
                    self.study.name,
                    name,
                    seconds,
                    self.metric,
                    best,
                    self._best_so_far(),
                )
                return
            error = trial.error_line() if code else f"the run reported no {self.metric} in its metrics.jsonl"
            self.study.set_attrs(claim, exit_code=code, error=error)
            self.study.finish(claim, TrialState.FAIL)
            log.warning(
                "sweep %s: %s failed (exit %d): %s; its log: %s", self.study.name, name, code, error, trial.log_path
            )
        finally:
            claim.release()

    def _best_so_far(self) -> str:
        done = [t for t in self.study.trials() if t.state == TrialState.COMPLETE]
        if not done:
            return ""
        best = min(done, key=lambda t: t.value)
        return f" (best so far: {trial_name(best.number)}, {best.value:.4g})"

    def _stop_all(self, arrived: list[int]) -> None:
        if arrived:
            why = f"the sweep received {signal.Signals(arrived[0]).name}"
        elif self.machine_failed:
            why = "a trial failed for a reason of this machine's"
        else:
            why = f"{self.stopped_outside} was stopped from outside the sweep (exit 75)"
        for trial in self.running.values():
            trial.stop(why)
        for index, trial in list(self.running.items()):
            code = trial.wait()
            del self.running[index]
            self._conclude(trial, code)
        if self.machine_failed and not arrived:
            raise self.machine_failed
        raise StopRequested(
            f"{why}: its running trials saved a checkpoint; re-run the same sweep command to continue (finished "
            "trials are kept, stopped ones resume)"
        )


def check_outcome(study: SweepStudy) -> None:
    """A sweep none of whose trials could train is an error, not a leaderboard of failures: it exits with the
    trials' own code when they share one (2: their config, 3: their data), else 1."""
    trials = study.counted(study.trials())
    if trials and study.is_done() and all(t.state == TrialState.FAIL for t in trials):
        codes = {t.user_attrs.get("exit_code") for t in trials}
        code = codes.pop() if len(codes) == 1 and None not in codes else 1
        raise SweepStopped(
            code,
            f"sweep {study.name}: every trial failed; the first: {trials[0].user_attrs.get('error', '?')} (its log: "
            f"{study.root}/logs/{trial_name(trials[0].number)}.log). Fix the cause, then run them again with "
            "--retry-failed",
        )
