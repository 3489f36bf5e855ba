"""What a launch continues from must be what it says: the data the run's checkpoints were trained on, and the
record of where their initial weights came from.

Each checkpoint records the checksums of the source files it was trained on (train.checkpoint.DATA) and, for a
fine-tuned run, the checkpoint its first launch started from (WEIGHTS_FROM). Before the ranks start, the
launcher compares the first with the files the data stage found: a file rewritten or replaced since is named with
both checksums and the launch stops (exit 3), unless train.accept_changed_data says to go on or
train.resume=never starts over. The second is carried on unchanged: a relaunch neither re-reads the source (which
may be gone) nor records a different file under the run's name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from train.checkpoint import DATA, WEIGHTS_FROM, best_checkpoint, latest_checkpoint, list_checkpoints, small_components
from train.config import Config
from train.data.cache.info import CacheInfo
from train.errors import ConfigError, DataError
from train.remote.fetch import resolve_initial_weights
from train.run_dir import RunDir

log = logging.getLogger(__name__)


def _recorded(path: Path) -> dict:
    """A checkpoint's small components, read through a memory map (no tensor is read); {} when unreadable
    (the launch plan sets such a file aside)."""
    try:
        state = small_components(path)
    except Exception:  # any unreadable file is the launch plan's to report
        return {}
    return {key: state[key] for key in (DATA, WEIGHTS_FROM) if isinstance(state, dict) and key in state}


def _differences(then: dict[str, str], now: dict[str, str]) -> list[str]:
    """Each source file whose content differs, with both checksums (matched by path, else by position)."""
    if sorted(then.values()) == sorted(now.values()):
        return []
    same_paths = [p for p in then if p in now and then[p] != now[p]]
    if same_paths:
        return [f"{p} (xxh3_128 {then[p]} then, {now[p]} now)" for p in same_paths]
    gone, new = [p for p in then if then[p] not in now.values()], [p for p in now if now[p] not in then.values()]
    return [f"{', '.join(gone) or 'the same files'} then, {', '.join(new) or 'fewer files'} now"]


def check_same_data(cfg: Config, run: RunDir, infos: Mapping[str, CacheInfo]) -> None:
    """Refuse (DataError, exit 3) to continue or score a checkpoint trained on other source files than the ones
    this launch found, naming the file and both checksums."""
    if cfg.train.resume == "never":
        return  # the launch archives the checkpoints and starts over on what it found
    found = [latest_checkpoint(run.checkpoints), best_checkpoint(run.checkpoints)]
    for path in [p for p in found if p is not None]:
        recorded = _recorded(path).get(DATA) or {}
        problems = [
            f"task {task}: {d}"
            for task, then in recorded.items()
            if task in infos
            for d in _differences(then, infos[task].source_checksums())
        ]
        if not problems:
            continue
        what = "; ".join(problems)
        if cfg.train.accept_changed_data:
            log.warning(
                "%s was trained on other data (%s); continuing on the new data (train.accept_changed_data)", path, what
            )
            return
        raise DataError(
            f"{path} was trained on other data than this launch found: {what}. Continuing would train and score it "
            "on the changed files without a word. Put the original files back, start over on the new data with "
            "train.resume=never (the checkpoints are archived), or set train.accept_changed_data=true to continue"
        )


def initial_weights(cfg: Config, run: RunDir, command: str, b2_api=None) -> dict | None:
    """The record of train.init_from's source for inputs.json: resolved on a run's first start; after that, the
    first launch's record, kept (from inputs.json, or from the newest checkpoint on a new machine)."""
    earlier = _earlier_record(run)
    if command not in ("run", "fit") or (earlier is not None and list_checkpoints(run.checkpoints)):
        return earlier
    if not list_checkpoints(run.checkpoints):
        return resolve_initial_weights(cfg, b2_api)
    try:  # checkpoints of its own but no record of the source (a checkpoint written before they carried one)
        return resolve_initial_weights(cfg, b2_api)
    except ConfigError as e:
        log.warning("train.init_from: %s; the run resumes from its own checkpoints, which do not need it", e)
        return None


def _earlier_record(run: RunDir) -> dict | None:
    try:
        record = run.weights_from()
    except (OSError, ValueError):
        record = None
    newest = latest_checkpoint(run.checkpoints)
    if record is None and newest is not None:
        record = _recorded(newest).get(WEIGHTS_FROM)
    return record
