"""Experiment trackers (W&B, and any other one module adds), fed from the launcher: metrics.jsonl's scalars as
rank 0 writes them, the report's plots at the end, and the run's true outcome.

Why the launcher: it is the one process that knows how a launch ended. A rank killed by the kernel reports
nothing; a rank's failure ends its peers by signal; a stop request ends in exit 75 with a checkpoint. The
launcher sees all of these, so the tracker's run is marked finished, preempted (with the step) or failed (with
the exit code and the first line of the error) by what really happened. It also keeps the trackers' processes
and network out of the ranks.

A tracker is one small class (:class:`Tracker`) in its own module and one row of :data:`TRACKERS`. What they
share lives here: the thread that follows metrics.jsonl, and a state file per tracker in the run folder
(``runs/<name>/wandb.json`` for W&B, mirrored to the remote with the run) with the tracker's run id and how far
metrics.jsonl was forwarded. So every later launch of the run, on this machine or another, continues the same
tracked run, and a resumed run sends no step older than the last it sent.
"""

from __future__ import annotations

import importlib
import json
import logging
import numbers
import secrets
import string
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from train import run_files
from train.atomic import write_json_atomic
from train.config import Config
from train.errors import ConfigError, Preempted, StopRequested, TrainError
from train.obs.sinks import POSITION_KEYS, MetricsFollower

log = logging.getLogger(__name__)

FORWARD_EVERY_S = 5.0


@dataclass(frozen=True)
class Outcome:
    """How a launch ended."""

    state: str
    """'finished', 'preempted' or 'failed'."""
    exit_code: int
    error: str | None = None
    """The first line that says what went wrong (failed only)."""


def outcome_of(error: BaseException | None) -> Outcome:
    if error is None:
        return Outcome("finished", 0)
    if isinstance(error, Preempted | StopRequested):
        return Outcome("preempted", error.exit_code)
    if isinstance(error, KeyboardInterrupt):
        return Outcome("failed", 130, "interrupted (Ctrl-C)")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # A rank failure reads "training failed:" (or evaluation, the smoke test) and then one line per rank, the
    # first to blame first.
    first = lines[1] if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    if not isinstance(error, TrainError):
        first = f"{type(error).__name__}: {first}"
    return Outcome("failed", getattr(error, "exit_code", 1), first)


class Tracker(Protocol):
    """One run in a tracking service, started by its module's ``start(cfg, run_root, run_id)``, which raises
    PreflightError when the service cannot be reached (before any rank starts, nothing is lost)."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Record one metrics.jsonl line's scalars at its step."""

    def finish(self, outcome: Outcome, plots: dict[str, Path], step: int, preempted_at_step: int | None) -> None:
        """Attach the report's plots (name -> PNG) at ``step`` and mark the run with ``outcome``."""


@dataclass(frozen=True)
class TrackerKind:
    """A row of :data:`TRACKERS`."""

    setting: Callable[[Config], str | None]
    """The config's setting that turns the tracker on (e.g. 'obs.wandb.mode=offline'), or None when it is off."""
    package: str
    """The package it needs, which the check imports before any stage runs."""
    install: str
    """How to install that package."""
    off: str
    """The setting that turns it off."""
    module: str
    """Its module, whose ``start(cfg, run_root, run_id)`` returns a :class:`Tracker`."""
    state_file: str
    """Its state file in the run folder: the tracked run's id and how far metrics.jsonl was forwarded."""


def _wandb_setting(cfg: Config) -> str | None:
    return None if cfg.obs.wandb.mode == "disabled" else f"obs.wandb.mode={cfg.obs.wandb.mode}"


TRACKERS: dict[str, TrackerKind] = {
    "W&B": TrackerKind(
        _wandb_setting,
        "wandb",
        "pip install 'train[wandb]' (inside this project: pip install -e '.[wandb]')",
        "obs.wandb.mode=disabled",
        "train.obs.wandb_tracker",
        run_files.WANDB_STATE,
    )
}


def check_tracking(cfg: Config) -> None:
    """A tracker that is on needs its package: say so before any stage runs."""
    for kind in TRACKERS.values():
        setting = kind.setting(cfg)
        if setting is None:
            continue
        try:
            importlib.import_module(kind.package)
        except ImportError:
            raise ConfigError(
                f"{setting} needs the {kind.package} package, which is not installed: {kind.install}, or set {kind.off}"
            ) from None


def read_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s): this launch starts a new tracked run", path, e)
        return {}
    return state if isinstance(state, dict) else {}


def _scalars(record: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in record.items()
        if key not in POSITION_KEYS and isinstance(value, numbers.Real) and not isinstance(value, bool)
    }


class Forwarding:
    """One launch's link from metrics.jsonl to one tracker: a thread forwards new lines; :meth:`finish` ends it."""

    def __init__(self, name: str, kind: TrackerKind, cfg: Config, run_root: Path):
        self.name, self.root, self.state_path = name, run_root, run_root / kind.state_file
        state = read_state(self.state_path)
        self.id = state.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self.metrics = MetricsFollower(run_root / run_files.METRICS, int(state.get("offset", 0)))
        self.step = int(state.get("step", -1))
        self._save_state()  # before the tracker starts: a launch killed right after still continues the same run
        self.tracker: Tracker = importlib.import_module(kind.module).start(cfg, run_root, self.id)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-forward", daemon=True)
        self._thread.start()

    def _save_state(self) -> None:
        write_json_atomic(self.state_path, {"id": self.id, "offset": self.metrics.offset, "step": self.step})

    def _loop(self) -> None:
        while not self._stop.wait(FORWARD_EVERY_S):
            try:
                self.forward()
            except Exception:  # tracking trouble must never end the training
                log.exception("%s: forwarding metrics failed; the run goes on", self.name)

    def forward(self) -> None:
        """Send every whole line metrics.jsonl gained since the last call."""
        with self._lock:
            offset = self.metrics.offset
            for record in self.metrics.new_records():
                if not isinstance(record.get("step"), int):
                    continue
                scalars = _scalars(record)
                # A resumed run redoes the steps after its checkpoint: the tracker keeps the first of each step.
                if scalars and record["step"] >= self.step:
                    self.tracker.log(scalars, record["step"])
                    self.step = record["step"]
            if self.metrics.offset != offset:
                self._save_state()

    def finish(self, outcome: Outcome, report: Path, preempted_at_step: int | None = None) -> None:
        """Forward what is left, attach the plots in ``report`` and mark the run with ``outcome``."""
        self._stop.set()
        self._thread.join()
        try:
            self.forward()
            plots = {f"report/{png.stem}": png for png in sorted(Path(report).glob("*.png"))}
            at = self.step if preempted_at_step is None else preempted_at_step
            self.tracker.finish(outcome, plots, max(self.step, 0), at)
            log.info("%s: run %s marked %s (exit code %d)", self.name, self.id, outcome.state, outcome.exit_code)
        except Exception as e:
            log.warning(
                "%s: could not close run %s (%s: %s); metrics.jsonl holds everything",
                self.name,
                self.id,
                type(e).__name__,
                e,
            )


class Tracking:
    """The launch's trackers, finished together."""

    def __init__(self, forwardings: list[Forwarding]):
        self.forwardings = forwardings

    def finish(self, outcome: Outcome, report: Path, preempted_at_step: int | None = None) -> None:
        for forwarding in self.forwardings:
            forwarding.finish(outcome, report, preempted_at_step)


def open_tracker(cfg: Config, run_root: Path) -> Tracking | None:
    """The trackers that are on for the run folder ``run_root`` in this launch, or None when none is."""
    check_tracking(cfg)
    forwardings: list[Forwarding] = []
    try:
        for name, kind in TRACKERS.items():
            if kind.setting(cfg) is not None:
                forwardings.append(Forwarding(name, kind, cfg, run_root))
    except BaseException:
        Tracking(forwardings).finish(Outcome("failed", 1, "another tracker could not start"), run_root)
        raise
    return Tracking(forwardings) if forwardings else None
