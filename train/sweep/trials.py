"""One trial as an ordinary run: its config written in full, ``python -m train run`` on its share of the machine,
and the validation scores it writes to metrics.jsonl read back as they come.

A trial is a separate launcher process, so it gets everything a run guarantees (the run lock, exact resume after
a kill or preemption, the report, the remote mirror) and nothing of the sweep can break it. It dies with the
sweep: a sweep killed outright sends its trials SIGTERM, on which they checkpoint and exit 75.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from train import run_files
from train.atomic import write_text_atomic
from train.config import Config, to_yaml, validate
from train.distributed.lifeline import set_parent_death_signal
from train.errors import ConfigError
from train.obs.sinks import MetricsFollower
from train.sweep.space import with_params
from train.sweep.study import Claim, trial_name

log = logging.getLogger(__name__)

CONFIGS = "configs"
LOGS = "logs"


@dataclass(frozen=True)
class Slot:
    """A share of this machine for one trial at a time: its cores and GPUs (None: the whole machine's)."""

    cpus: tuple[int, ...] | None = None
    gpus: tuple[str, ...] | None = None


def divide_machine(parallel: int, cfg: Config) -> list[Slot]:
    """``parallel`` slots with disjoint cores and GPUs; a ConfigError when the machine has too few for that."""
    if parallel == 1:
        return [Slot()]
    cpus = sorted(os.sched_getaffinity(0))
    gpus = _visible_gpus()
    if gpus:
        if len(gpus) < parallel:
            raise ConfigError(
                f"parallel={parallel} trials at once, but {len(gpus)} GPU(s) are visible: each trial needs one of "
                "its own. Lower parallel in the search space"
            )
        per_gpu = len(gpus) // parallel
        gpu_sets = [tuple(gpus[i * per_gpu : (i + 1) * per_gpu]) for i in range(parallel)]
    else:
        gpu_sets = [None] * parallel
    if len(cpus) < parallel:
        raise ConfigError(
            f"parallel={parallel} trials at once, but this process may use {len(cpus)} core(s): each trial needs one "
            "of its own. Lower parallel in the search space"
        )
    per = len(cpus) // parallel
    if not gpus and isinstance(cfg.dist.nproc, int) and cfg.dist.nproc > per:
        raise ConfigError(
            f"dist.nproc={cfg.dist.nproc} CPU ranks per trial, but with parallel={parallel} each trial gets {per} "
            f"of the {len(cpus)} cores: lower dist.nproc (or set it to auto) or parallel"
        )
    return [Slot(tuple(cpus[i * per : (i + 1) * per]), gpu_sets[i]) for i in range(parallel)]


def _visible_gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()][: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def trial_config(base: dict, params: dict, sweep_root: Path, number: int) -> Config:
    """The trial's full config: the base with its parameters, in its own folder under the sweep's."""
    tree = with_params(base, params)
    run = tree.setdefault("run", {})
    run["runs_dir"], run["name"] = str(sweep_root), trial_name(number)
    if run.get("remote"):  # the sweep's trials beside each other on the remote, apart from other sweeps'
        run["remote"] = f"{run['remote'].rstrip('/')}/{sweep_root.name}"
    wandb = tree.setdefault("obs", {}).setdefault("wandb", {})
    wandb["group"] = wandb.get("group") or sweep_root.name
    return validate(tree, f"{sweep_root.name} {trial_name(number)}")


def _in_child(cpus: tuple[int, ...] | None) -> None:
    # The trial stops (checkpoint, exit 75) when the sweep dies, even by SIGKILL; it never trains on unseen.
    set_parent_death_signal(signal.SIGTERM)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


class TrialRun:
    """The launch of one claimed trial on one slot."""

    def __init__(self, claim: Claim, cfg: Config, slot: Slot, metric: str, reported: set[int]):
        self.claim, self.cfg, self.slot, self.metric = claim, cfg, slot, metric
        self.root = Path(cfg.run.runs_dir) / cfg.run.name
        self.sweep_root = Path(cfg.run.runs_dir)
        self.name = trial_name(claim.number)
        self.reported = set(reported)
        self.scores: list[tuple[int, float]] = []
        self.last_step = 0
        self._metrics = MetricsFollower(self.root / run_files.METRICS)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.stop_sent: str | None = None

    @property
    def log_path(self) -> Path:
        return self.sweep_root / LOGS / f"{self.name}.log"

    def start(self) -> None:
        config = self.sweep_root / CONFIGS / f"{self.name}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(config, to_yaml(self.cfg))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if self.slot.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.slot.gpus)
        if self.slot.cpus is not None:
            env.pop("OMP_NUM_THREADS", None)  # the launcher divides the slot's cores between its ranks
        command = [sys.executable, "-m", "train", "run", "--config", str(config)]
        if self.slot.cpus is not None and not self.slot.gpus and self.cfg.dist.nproc == "auto":
            command += ["--nproc", str(min(self.cfg.dist.cpu_nproc, len(self.slot.cpus)))]
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=lambda: _in_child(self.slot.cpus),
                start_new_session=True,
            )
        self.started = time.monotonic()

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def stop(self, why: str) -> None:
        """Ask the run to stop: it checkpoints and exits 75."""
        if self.stop_sent is not None:
            return
        self.stop_sent = why
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def new_scores(self) -> list[tuple[int, float]]:
        """Validation scores written since the last call, as (step, value), each step once."""
        fresh = []
        for record in self._metrics.new_records():
            step = record.get("step")
            if not isinstance(step, int):
                continue
            self.last_step = max(self.last_step, step)
            value = record.get(self.metric)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.scores.append((step, float(value)))
                if step not in self.reported and math.isfinite(value):
                    self.reported.add(step)
                    fresh.append((step, float(value)))
        return fresh

    def best(self) -> float | None:
        finite = [v for _, v in self.scores if math.isfinite(v)]
        return min(finite) if finite else None

    def error_line(self) -> str:
        """The launcher's own error message, from the end of the trial's log, with its cause: a line that ends in
        a colon ("error: training failed:") is followed by the lines that say what failed."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-200:]
        except OSError:
            return ""
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith(("error:", "stopped:")):
                text = lines[i].strip()
                cause = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith(" ") else ""
                return f"{text} {cause}" if text.endswith(":") and cause else text
        return lines[-1].strip() if lines else ""
