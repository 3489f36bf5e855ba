"""Where ``predict`` and ``export`` may write, checked before a model is loaded or a prediction computed.

A run folder's checkpoints are never an output: an output written over ``checkpoints/best.pt`` or
``step_N.pt`` would be taken by the next launch for a checkpoint (or set aside as an unreadable one, and the run
retrained from an older step). Neither is any other file the run folder lives by (its config, inputs, metrics).
"""

from __future__ import annotations

from pathlib import Path

from train import run_files
from train.checkpoint.shards import is_sharded_checkpoint
from train.disk import unwritable
from train.errors import ConfigError, PreflightError

RUN_FOLDER_FILES = (run_files.CONFIG, run_files.INPUTS, run_files.METRICS, run_files.PREEMPTED, run_files.WANDB_STATE)


def run_folder_owning(path: Path) -> Path | None:
    """The run folder whose own files (its checkpoints folder, config, inputs, metrics) ``path`` would
    overwrite, or None."""
    path = path.resolve()
    for folder in (path, *path.parents):
        if folder.name == run_files.CHECKPOINTS and (folder.parent / run_files.CONFIG).is_file():
            return folder.parent
    if path.name in RUN_FOLDER_FILES and (path.parent / run_files.CONFIG).is_file():
        return path.parent
    return None


def sharded_checkpoint_holding(path: Path) -> Path | None:
    """The sharded checkpoint folder (``*.dcp``) that ``path`` is, or lies in, wherever it is; or None."""
    path = path.resolve()
    return next((f for f in (path, *path.parents) if is_sharded_checkpoint(f)), None)


def check_output(output: Path, option: str, *, folder: bool) -> None:
    """``option`` (--output) names a place this command may write: ConfigError (exit 2) for a run folder's own
    files, a checkpoint's, or the wrong kind of path, PreflightError (exit 4) for a folder this machine cannot
    write to."""
    output = Path(output)
    owner = run_folder_owning(output)
    if owner is not None:
        raise ConfigError(
            f"{option} {output} is inside the run folder {owner}'s own files (checkpoints/, config.yaml, metrics): "
            f"writing there would replace what the run resumes and is scored from. Write elsewhere, e.g. "
            f"{owner / 'export'}/ or a folder of your own"
        )
    checkpoint = sharded_checkpoint_holding(output)
    if checkpoint is not None:
        raise ConfigError(
            f"{option} {output} is {'' if checkpoint == output.resolve() else 'inside '}the sharded checkpoint "
            f"{checkpoint}: writing there would change a checkpoint. Write elsewhere, e.g. a file in a folder of "
            "your own"
        )
    if not folder and output.is_dir():
        raise ConfigError(f"{option} {output} is a folder; give the file to write, e.g. {output / 'predictions.h5'}")
    if folder and output.exists() and not output.is_dir():
        raise ConfigError(f"{option} {output} is a file; give a folder (or a file name ending in the format's suffix)")
    where = output if folder else output.parent
    why = unwritable(where)
    if why is not None:
        raise PreflightError(f"{option} {output}: cannot write in {where} ({why}); choose a writable folder")
