"""The study behind a sweep: Optuna's journal file in the sweep's folder, and which worker runs which trial.

The journal file (an append-only log, Optuna's storage made for shared file systems) is the one record of the
search: every trial, its parameters, the validation scores it reported, its end. Any number of workers (the
sweep command on this machine, each task of a SLURM array) open it and take trials from it.

Who runs a trial is decided under the study lock, a ``flock`` on a file beside the journal: a worker counts the
trials, takes a trial that was started and is no longer run by anyone (its claim lock is free: the worker that
ran it was killed or preempted), or else asks the sampler for a new one while the budget lasts. The claim lock of
a trial is held for as long as its run goes on, and the kernel drops it when the worker dies, however it dies. So
a trial is never run twice at once, a stopped trial resumes from its own checkpoint (it is the same run folder),
and no trial is counted twice or lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from optuna.trial import TrialState

from train.launch.run_lock import try_flock
from train.run_dir import RunDir
from train.sweep.space import Range, SweepSpec, is_int_range

log = logging.getLogger(__name__)

JOURNAL = "study.journal"
RETRY_OF = "retry_of"
"""The user attribute of a trial that runs a failed trial's parameters again: that trial's number."""
CLAIMS = "claims"
STUDY_LOCK = "study.lock"

SAMPLERS = {
    "grid": lambda spec, seed: optuna.samplers.GridSampler(spec.grid(), seed=spec.seed),
    "random": lambda spec, seed: optuna.samplers.RandomSampler(seed=seed),
    "tpe": lambda spec, seed: optuna.samplers.TPESampler(seed=seed),
}
"""Optuna's samplers by the spec's name. Each ask builds its sampler afresh, seeded by the spec's seed plus the
trials so far: workers in other processes then draw what one process would, never the same point twice."""

PRUNERS = {
    "median": lambda spec: optuna.pruners.MedianPruner(
        n_startup_trials=spec.prune_after_trials, n_warmup_steps=spec.prune_warmup_steps
    ),
    "halving": lambda spec: optuna.pruners.SuccessiveHalvingPruner(min_resource=spec.prune_warmup_steps or "auto"),
    "none": lambda spec: optuna.pruners.NopPruner(),
}

optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep prints its own line per trial


def trial_name(number: int) -> str:
    return f"trial-{number:03d}"


def distributions(spec: SweepSpec) -> dict[str, BaseDistribution]:
    out: dict[str, BaseDistribution] = {}
    for key, dim in spec.space.items():
        if isinstance(dim, Range) and spec.sampler != "grid":
            if is_int_range(dim):
                out[key] = IntDistribution(int(dim.low), int(dim.high), log=dim.log, step=int(dim.step or 1))
            else:
                out[key] = FloatDistribution(float(dim.low), float(dim.high), log=dim.log, step=dim.step)
        else:  # the grid sampler's values are its own; the distribution only has to hold them
            out[key] = CategoricalDistribution(dim if isinstance(dim, list) else spec.grid()[key])
    return out


def _try_flock(path: Path) -> int | None:
    """An open descriptor holding ``path``'s exclusive lock, or None when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if try_flock(fd, fcntl.LOCK_EX):
            return fd
    except OSError:
        os.close(fd)
        raise
    os.close(fd)
    return None


@dataclass
class Claim:
    """A trial this worker runs, and the lock that says so (closed by :meth:`release`)."""

    number: int
    trial_id: int
    params: dict
    resumed: bool
    """The trial was started before (by a worker that is gone): its run folder continues."""
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SweepStudy:
    """The study of the sweep folder ``root``."""

    def __init__(self, root: Path, name: str, spec: SweepSpec):
        self.root, self.name, self.spec = root, name, spec
        (root / CLAIMS).mkdir(parents=True, exist_ok=True)
        journal = str(root / JOURNAL)
        self.storage = JournalStorage(JournalFileBackend(journal, lock_obj=JournalFileOpenLock(journal)))
        self.distributions = distributions(spec)
        self.study = self._open(seed=spec.seed)

    def _open(self, seed: int) -> optuna.Study:
        return optuna.create_study(
            study_name=self.name,
            storage=self.storage,
            sampler=SAMPLERS[self.spec.sampler](self.spec, seed),
            pruner=PRUNERS[self.spec.pruner](self.spec),
            direction="minimize",
            load_if_exists=True,
        )

    @property
    def budget(self) -> int:
        return self.spec.trials if self.spec.trials is not None else self.spec.grid_size()

    def trials(self) -> list[optuna.trial.FrozenTrial]:
        return self.storage.get_all_trials(self.study._study_id, deepcopy=False)

    @staticmethod
    def retried(trials: list[optuna.trial.FrozenTrial]) -> set[int]:
        """The numbers of the failed trials that were queued to run again (``--retry-failed``)."""
        return {t.user_attrs[RETRY_OF] for t in trials if RETRY_OF in t.user_attrs}

    def counted(self, trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
        """The trials the budget counts: a failed trial run again counts once, as its retry."""
        retried = self.retried(trials)
        return [t for t in trials if t.number not in retried and t.state != TrialState.WAITING]

    def position(self, number: int) -> str:
        """Where trial ``number`` stands in the budget, for the log: "3 of 8", or "a retry of trial-001, 2 of 2"
        (a failed trial run again counts once, as its retry: its number may exceed the budget)."""
        trials = self.trials()
        counted = sorted(t.number for t in self.counted(trials) if t.number <= number)
        place = len(counted) + (number not in counted)  # a trial just asked for may not be listed as running yet
        retry = next((t.user_attrs[RETRY_OF] for t in trials if t.number == number and RETRY_OF in t.user_attrs), None)
        again = f"a retry of {trial_name(retry)}, " if retry is not None else ""
        return f"{again}{place} of {self.budget}"

    def retry_failed(self) -> list[int]:
        """Each failed trial queued to run again with its parameters, as a new trial of its own (the failed one's
        folder and log are kept); returns the failed trials' numbers."""
        with self._locked():
            trials = self.trials()
            failed = [t for t in trials if t.state == TrialState.FAIL and t.number not in self.retried(trials)]
            for t in failed:
                self.study.enqueue_trial(dict(t.params), user_attrs={RETRY_OF: t.number}, skip_if_exists=False)
        return [t.number for t in failed]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / CLAIMS / STUDY_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def claim_next(self) -> Claim | None:
        """The next trial for this worker: a stopped one first (it resumes), else a new one while the budget
        lasts; None when every trial is finished or run by a live worker."""
        with self._locked():
            trials = self.trials()
            for t in sorted(trials, key=lambda t: t.number):
                if t.state != TrialState.RUNNING:
                    continue
                fd = _try_flock(self.claim_path(t.number))
                if fd is None:  # a live worker runs it
                    continue
                if self._launch_still_ends(t.number):
                    os.close(fd)
                    continue
                return Claim(t.number, t._trial_id, dict(t.params), True, fd)
            waiting = any(t.state == TrialState.WAITING for t in trials)  # a failed trial's retry
            if not waiting and len(self.counted(trials)) >= self.budget:
                return None
            self.study = self._open(seed=self.spec.seed + len(trials))
            trial = self.study.ask(self.distributions)
            fd = _try_flock(self.claim_path(trial.number))
            assert fd is not None, "a trial just asked for is claimed by nobody else: asks hold the study lock"
            return Claim(trial.number, trial._trial_id, dict(trial.params), False, fd)

    def _launch_still_ends(self, number: int) -> bool:
        """The trial's last launch still holds its run folder: a worker killed outright leaves its trials to stop
        on their own (they checkpoint first), and the trial is taken once they have. Asked only by the holder of
        the trial's claim, so that the probe never meets a new launch of the trial."""
        lock = RunDir(self.root / trial_name(number)).lock_paths(0)[0]
        if not lock.exists():
            return False
        fd = _try_flock(lock)
        if fd is None:
            return True
        os.close(fd)
        return False

    def stopping_elsewhere(self) -> bool:
        """A trial nobody runs is still ending its last launch: wait for it rather than leave it behind."""
        with self._locked():
            for t in self.trials():
                if t.state != TrialState.RUNNING:
                    continue
                fd = _try_flock(self.claim_path(t.number))
                if fd is None:
                    continue
                try:
                    if self._launch_still_ends(t.number):
                        return True
                finally:
                    os.close(fd)
        return False

    def claim_path(self, number: int) -> Path:
        return self.root / CLAIMS / f"{trial_name(number)}.lock"

    def is_claimed(self, number: int) -> bool:
        """A live worker runs this trial (its claim lock is held). Under the study lock: a probe must not make a
        worker that claims at the same moment think the trial taken."""
        with self._locked():
            fd = _try_flock(self.claim_path(number))
            if fd is None:
                return True
            os.close(fd)
            return False

    def live_trial(self, claim: Claim) -> optuna.Trial:
        """The trial as Optuna's pruner sees it, to report scores to and ask whether to prune."""
        return optuna.Trial(self.study, claim.trial_id)

    def set_attrs(self, claim: Claim, **attrs) -> None:
        for key, value in attrs.items():
            self.storage.set_trial_user_attr(claim.trial_id, key, value)

    def attrs(self, claim: Claim) -> dict:
        return self.storage.get_trial(claim.trial_id).user_attrs

    def finish(self, claim: Claim, state: TrialState, value: float | None = None) -> None:
        # Told through a study without the grid sampler, whose after_trial calls Study.stop(), which Optuna
        # allows only inside its own optimize loop; the samplers need nothing from a trial's end.
        teller = optuna.load_study(study_name=self.name, storage=self.storage, sampler=optuna.samplers.RandomSampler())
        with self._locked():
            teller.tell(claim.number, value if state == TrialState.COMPLETE else None, state=state)

    def is_done(self) -> bool:
        trials = self.trials()
        return len(self.counted(trials)) >= self.budget and all(t.state.is_finished() for t in trials)
