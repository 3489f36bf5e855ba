"""The run folder: the one contract between the launcher, which writes it, and the ranks, which read it.

```
runs/<name>/
  config.yaml             the resolved config (the launcher refuses a folder that holds a different run)
  inputs.json             each task's cache folders, found or built by the launcher, and where its data came
                          from: each split's origin ('data') and the data stage's warnings ('data_warnings')
  launch-node<k>.json     node k's launch record: when torchrun started, whether the console is a terminal,
                          the launcher's pid and the lock its ranks hold
  .launch-node<k>.lock    held by node k's launcher for the whole launch
  .ranks-node<k>.lock     held (shared) by node k's ranks and their DataLoader workers
  .node0-token            the launch plan's token, written by node 0: another node that finds the same token in
                          its run folder shares node 0's (one file system), else its own is node-local
  checkpoints/            step_NNNNNNNN.pt, best.pt, archive-<time>/
  logs/                   rank<r>.log, torchrun/ (every rank's stdout, stderr and error file)
  metrics.jsonl  tensorboard/  report/  flight_recorder/ (DEBUG=1)
  preempted.json          written by rank 0 when a stop request was honoured with a checkpoint
  smoke.json              the smoke test's results (in runs/smoke)
```
Beyond torchrun's own variables (RANK, WORLD_SIZE, ...) and the environment it inherits, the ranks learn
everything from here: their command line names this folder and their node's launch record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from train import run_files
from train.atomic import write_json_atomic, write_text_atomic
from train.checkpoint import training_done
from train.config import Config, load_config, to_yaml, training_differences
from train.data.acquire.sources import Provenance
from train.data.cache.info import MANIFEST as CACHE_MANIFEST
from train.data.cache.info import CacheInfo, changed_mapped_sources
from train.data.dataset import LatentInfo
from train.errors import ConfigError, DataError
from train.model.specs import TaskData, task_spec


@dataclass(frozen=True)
class LaunchRecord:
    """What one node's launcher tells its ranks about this launch."""

    started_at: float
    """Wall time at which torchrun was started (for the launch-to-first-step figure)."""
    live_console: bool
    """The launcher's stderr is a terminal (and DEBUG is off): rank 0 may redraw a progress bar in place."""
    launcher_pid: int
    """The ranks' parent: they ask the kernel to kill them when it dies."""
    ranks_lock: str
    """The lock file the ranks hold (shared) while alive; the next launch waits for it."""
    resume_sha1: str | None = None
    """The SHA1 of the checkpoint node 0's launcher chose for training to continue from (None: none chosen)."""

    @classmethod
    def read(cls, path: Path) -> LaunchRecord:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"launch record {path} cannot be read ({e}); start ranks through python -m train") from e


class RunDir:
    """The layout of one run folder and the files that pass between launcher and ranks."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    @classmethod
    def of(cls, cfg: Config) -> RunDir:
        """runs_dir/<run name> of a loaded config."""
        assert cfg.run.name, "load_config names every run"
        return cls(Path(cfg.run.runs_dir) / cfg.run.name)

    # -- the layout ----------------------------------------------------------------------------------------

    @property
    def config(self) -> Path:
        return self.root / run_files.CONFIG

    @property
    def inputs(self) -> Path:
        return self.root / run_files.INPUTS

    @property
    def checkpoints(self) -> Path:
        return self.root / run_files.CHECKPOINTS

    @property
    def logs(self) -> Path:
        return self.root / run_files.LOGS

    @property
    def report(self) -> Path:
        return self.root / run_files.REPORT

    @property
    def flight_recorder(self) -> Path:
        return self.root / run_files.FLIGHT_RECORDER

    @property
    def preempted_marker(self) -> Path:
        return self.root / run_files.PREEMPTED

    @property
    def smoke_results(self) -> Path:
        """The smoke test's table, as JSON (its run folder is runs/smoke)."""
        return self.root / run_files.SMOKE

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def launch_record(self, node_rank: int) -> Path:
        return self.root / f"launch-node{node_rank}.json"

    def lock_paths(self, node_rank: int) -> tuple[Path, Path]:
        """(launcher lock, ranks lock) of one node: the nodes of one multi-node job may share the run folder
        on a shared file system, and each node's launcher holds its own."""
        return self.root / f".launch-node{node_rank}.lock", self.root / f".ranks-node{node_rank}.lock"

    # -- written by the launcher ---------------------------------------------------------------------------

    def prepare(self, cfg: Config, *, same_run: bool = True) -> None:
        """Create the folder with the resolved config. ``same_run``: refuse a folder holding a run whose config
        differs in what training depends on."""
        if same_run and self.config.is_file():
            differences = training_differences(load_config(self.config), cfg)
            if differences:
                raise ConfigError(
                    f"{self.root} holds a run with a different config ({', '.join(differences)}); pick another "
                    f"run name (RUN=... or --run) or delete {self.root} to start over"
                )
        write_text_atomic(self.config, to_yaml(cfg))
        self.logs.mkdir(parents=True, exist_ok=True)

    def write_inputs(
        self,
        folders: dict[str, dict[str, str | None]],
        provenance: Mapping[str, Provenance | None] | None = None,
        weights_from: dict | None = None,
    ) -> None:
        """Each task's cache folder and latent cache folder (None without one) and, given the data stage's
        provenance, where each split came from and what the data stage warned about (see load_data); with
        train.init_from, the checkpoint the initial weights come from (``weights_from``, under every task)."""
        inputs: dict[str, dict] = {}
        for name, task_folders in folders.items():
            inputs[name] = dict(task_folders)
            if weights_from is not None:
                inputs[name]["weights_from"] = weights_from
            if provenance and provenance.get(name) is not None:
                # The cache's manifest holds each split's sample range and each source file's checksum.
                manifest = json.loads((Path(task_folders["cache"]) / CACHE_MANIFEST).read_text())
                inputs[name] |= provenance[name].record(manifest)
        write_json_atomic(self.inputs, inputs)

    def write_launch_record(
        self, node_rank: int, ranks_lock: Path, live_console: bool, resume_sha1: str | None = None
    ) -> Path:
        path = self.launch_record(node_rank)
        record = LaunchRecord(time.time(), live_console, os.getpid(), str(ranks_lock), resume_sha1)
        write_json_atomic(path, asdict(record))
        return path

    @property
    def node_token(self) -> Path:
        return self.root / run_files.NODE_TOKEN

    def write_node_token(self, token: str) -> None:
        """Node 0 (or the only node): the launch plan's token, by which other nodes tell whether they share
        this folder."""
        write_text_atomic(self.node_token, token)

    def read_node_token(self) -> str | None:
        try:
            return self.node_token.read_text()
        except OSError:
            return None

    def clear_preempted(self) -> None:
        """Before the ranks start: a marker left from an earlier launch must not turn a failure into a stop."""
        self.preempted_marker.unlink(missing_ok=True)

    def fit_is_done(self, cfg: Config) -> bool:
        return training_done(self.checkpoints, cfg.train.epochs)

    # -- read by the ranks ---------------------------------------------------------------------------------

    def load_config(self) -> Config:
        return load_config(self.config)

    def load_tasks(self, cfg: Config) -> list[TaskData]:
        """The caches the launcher prepared for this run, with each task's model spec."""
        inputs = json.loads(self.inputs.read_text())
        tasks = []
        for name, task in cfg.tasks.items():
            folders = inputs[name]
            info = CacheInfo.load(Path(folders["cache"]))
            latent = LatentInfo.load(Path(folders["latent"])) if folders["latent"] else None
            if info is None or (folders["latent"] and latent is None):
                raise DataError(
                    f"task {name}: a cache in {folders} is missing or incomplete; run 'python -m train cache'"
                )
            outputs = task.well.n_steps_output if task.well is not None else 1
            tasks.append(TaskData(name, info, task_spec(info, task, name), latent, window_outputs=outputs))
        return tasks

    def changed_mapped_sources(self) -> list[str]:
        """The data files this run's caches map in place that changed since (train.data.cache.build)."""
        try:
            inputs = json.loads(self.inputs.read_text())
        except (OSError, ValueError):
            return []
        return [c for task in inputs.values() for c in changed_mapped_sources(Path(task["cache"]))]

    def weights_from(self) -> dict | None:
        """The checkpoint train.init_from resolved to (as the launcher recorded it), or None."""
        inputs = json.loads(self.inputs.read_text())
        return next((v["weights_from"] for v in inputs.values() if "weights_from" in v), None)

    def load_data(self) -> dict[str, dict]:
        """Per task, where its data came from: ``data`` (each split's origin, file and samples) and
        ``data_warnings``; a task whose inputs were written without them (benchmarks, some tests) is left out."""
        inputs = json.loads(self.inputs.read_text())
        return {
            name: {
                "data": v["data"],
                "data_warnings": v.get("data_warnings", []),
                **({"weights_from": v["weights_from"]} if "weights_from" in v else {}),
            }
            for name, v in inputs.items()
            if "data" in v
        }

    def mark_preempted(self, progress: dict) -> None:
        """Rank 0, once a stop request was honoured with a checkpoint: the launcher then exits 75."""
        write_json_atomic(self.preempted_marker, progress)

    @property
    def preempted(self) -> bool:
        return self.preempted_marker.is_file()

    def preempted_reason(self) -> str | None:
        """Why the ranks stopped, where it was no signal (a shard store that stopped answering); None: a signal."""
        try:
            return json.loads(self.preempted_marker.read_text()).get("reason")
        except (OSError, ValueError, AttributeError):
            return None


def rank_arguments(argv: list[str] | None = None) -> tuple[RunDir, LaunchRecord | None, list[str]]:
    """A rank's command line: ``--run-dir`` and, from the launcher, ``--launch-record``; returns the rest."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--launch-record", type=Path)
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    record = LaunchRecord.read(known.launch_record) if known.launch_record else None
    return RunDir(known.run_dir), record, rest
