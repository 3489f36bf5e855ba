"""Weights & Biases tracking of a run, from the launcher: metrics.jsonl's scalars as rank 0 writes them, the
report's plots at the end, and the run's true outcome.

Why the launcher: it is the one process that knows how a launch ended. A rank killed by the kernel reports
nothing; a rank's failure ends its peers by signal; a stop request ends in exit 75 with a checkpoint. The
launcher sees all of these, so the W&B run is marked finished, preempted (with the step) or failed (with the
exit code and the first line of the error) by what really happened. It also keeps W&B's processes and
network out of the ranks.

The W&B run id is kept in ``runs/<name>/wandb.json`` (mirrored to the remote with the run), so every later
launch of the run, on this machine or another, continues the same W&B run; the file also records how far
metrics.jsonl was forwarded, so a resumed run sends W&B no step older than the last it sent.
"""

from __future__ import annotations

import json
import logging
import numbers
import secrets
import string
import threading
from dataclasses import dataclass
from pathlib import Path

from train import run_files
from train.atomic import write_json_atomic
from train.config import Config
from train.errors import ConfigError, Preempted, PreflightError, StopRequested, TrainError
from train.obs.sinks import POSITION_KEYS

log = logging.getLogger(__name__)

STATE = run_files.WANDB_STATE
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


def check_tracking(cfg: Config) -> None:
    """A W&B mode other than disabled needs the wandb package: say so before any stage runs."""
    if cfg.obs.wandb.mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"obs.wandb.mode={cfg.obs.wandb.mode} needs the wandb package, which is not installed: "
            "pip install 'train[wandb]' (inside this project: pip install -e '.[wandb]'), or set "
            "obs.wandb.mode=disabled"
        ) from None


def open_tracker(cfg: Config, run_root: Path) -> WandbRun | None:
    """The W&B run of the run folder ``run_root`` for this launch, or None when tracking is disabled."""
    if cfg.obs.wandb.mode == "disabled":
        return None
    check_tracking(cfg)
    return WandbRun(cfg, run_root)


def read_state(run_root: Path) -> dict:
    try:
        state = json.loads((run_root / STATE).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s): this launch starts a new W&B run", run_root / STATE, e)
        return {}
    return state if isinstance(state, dict) else {}


def _scalars(record: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in record.items()
        if key not in POSITION_KEYS and isinstance(value, numbers.Real) and not isinstance(value, bool)
    }


class WandbRun:
    """One launch's connection to the run's W&B run: a thread forwards metrics.jsonl; :meth:`finish` ends it."""

    def __init__(self, cfg: Config, run_root: Path):
        import wandb

        self.root = run_root
        state = read_state(run_root)
        self.id = state.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self.offset, self.step = int(state.get("offset", 0)), int(state.get("step", -1))
        self._save_state()  # before W&B starts: a launch killed right after still continues the same run
        settings = cfg.obs.wandb
        try:
            self.wb = wandb.init(
                project=settings.project,
                entity=settings.entity,
                id=self.id,
                name=run_root.name,
                resume="allow",
                mode=settings.mode,
                dir=str(run_root),
                config=cfg.model_dump(mode="json"),
                settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False, silent=True),
            )
        except Exception as e:  # before any rank starts: nothing is lost by stopping here
            raise PreflightError(
                f"W&B could not start run {self.id} (obs.wandb.mode={settings.mode}, project {settings.project}): "
                f"{type(e).__name__}: {e}. Check WANDB_API_KEY (or `wandb login`) and the network, or set "
                "obs.wandb.mode=offline (sync later with `wandb sync`) or disabled"
            ) from None
        log.info("W&B: run %s (%s, project %s)%s", self.id, settings.mode, settings.project,
                 f" at {self.wb.url}" if settings.mode == "online" else "")  # fmt: skip
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="wandb-forward", daemon=True)
        self._thread.start()

    def _save_state(self) -> None:
        write_json_atomic(self.root / STATE, {"id": self.id, "offset": self.offset, "step": self.step})

    def _loop(self) -> None:
        while not self._stop.wait(FORWARD_EVERY_S):
            try:
                self.forward()
            except Exception:  # W&B trouble must never end the training
                log.exception("W&B: forwarding metrics failed; the run goes on")

    def forward(self) -> None:
        """Send every whole line metrics.jsonl gained since the last call."""
        with self._lock:
            path = self.root / run_files.METRICS
            try:
                with open(path, "rb") as f:
                    if f.seek(0, 2) < self.offset:  # a shorter file (restored from an older mirror): start over
                        self.offset = 0
                    f.seek(self.offset)
                    data = f.read()
            except FileNotFoundError:
                return
            whole = data[: data.rfind(b"\n") + 1]
            for line in whole.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    continue
                scalars = _scalars(record)
                # A resumed run redoes the steps after its checkpoint: W&B keeps the first of each step.
                if scalars and record["step"] >= self.step:
                    self.wb.log(scalars, step=record["step"])
                    self.step = record["step"]
            if whole:
                self.offset += len(whole)
                self._save_state()

    def finish(self, outcome: Outcome, report: Path, preempted_at_step: int | None = None) -> None:
        """Forward what is left, attach the plots in ``report`` and mark the run with ``outcome``."""
        import wandb

        self._stop.set()
        self._thread.join()
        try:
            self.forward()
            images = {f"report/{png.stem}": wandb.Image(str(png)) for png in sorted(Path(report).glob("*.png"))}
            if images:
                self.wb.log(images, step=max(self.step, 0))
            summary = {"outcome": outcome.state, "exit_code": outcome.exit_code}
            if outcome.error:
                summary["error"] = outcome.error
            if outcome.state == "preempted":
                summary["preempted_at_step"] = self.step if preempted_at_step is None else preempted_at_step
                self.wb.mark_preempting()
            self.wb.summary.update(summary)
            self.wb.finish(exit_code=outcome.exit_code)
            log.info("W&B: run %s marked %s (exit code %d)", self.id, outcome.state, outcome.exit_code)
        except Exception as e:
            log.warning("W&B: could not close run %s (%s: %s); metrics.jsonl holds everything", self.id,
                        type(e).__name__, e)  # fmt: skip
