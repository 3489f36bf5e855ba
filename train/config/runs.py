"""The ``run`` section: the run's name, its folders, its seed and its remote copy."""

from __future__ import annotations

import re

import pydantic
from pydantic import Field

from train.config.section import Section


class RunConfig(Section):
    name: str | None = None
    """Run folder name under runs_dir; default: the config file's stem."""

    @pydantic.field_validator("name")
    @classmethod
    def _one_folder(cls, name: str | None) -> str | None:
        if name is not None and (name.strip() in ("", ".", "..") or any(c in name for c in "/\\\0")):
            raise ValueError(
                f"{name!r} is not a folder name: a run is one folder under run.runs_dir, whose name holds no '/' "
                "and is neither '.' nor '..' (run.runs_dir says where run folders go)"
            )
        return name

    runs_dir: str = "runs"
    """Where run folders (config, metrics, logs, checkpoints, report) go."""
    data_dir: str = "data"
    """Where generated or downloaded HDF5 files go (data/<task>/...)."""
    cache_dir: str = "cache"
    """Where memory-mapped training caches go (cache/<task>/<hash>/...)."""
    seed: int = 0
    """Seed of model initialisation, sampling order and dropout."""
    remote: str | None = None
    """Where the run is mirrored so that it outlives this machine: 'b2://bucket/prefix' (the B2 credentials of
    data downloads) or a folder on a shared file system. The run's folder <remote>/<run name>/ receives every
    kept checkpoint and best.pt (each SHA1-verified, then named by checkpoints/latest.json), the config,
    metrics.jsonl and, when the launch ends, the report and logs. A launch without a local checkpoint resumes
    from the remote's newest verified one. Default: no remote."""
    remote_wait_s: int = Field(120, ge=0)
    """Seconds the launcher waits, when the ranks have stopped (a finished run, a stop request or a failure),
    for the newest checkpoint, the report and the logs to reach the remote, before it exits anyway."""
    remote_lease_s: float = Field(60.0, ge=1.0)
    """Seconds a launch's lease on the remote (``<remote>/<run name>/lease.json``) lasts without renewal; the
    launch renews it three times as often. A second launch of the run (another box) that finds a lease renewed
    within this time stops with exit 4; one left by a launch that died is taken over after this long."""

    @pydantic.field_validator("remote")
    @classmethod
    def _check_remote(cls, remote: str | None) -> str | None:
        if remote is None:
            return None
        if remote.startswith("b2://"):
            bucket, _, prefix = remote.removeprefix("b2://").partition("/")
            if not bucket or {".", ".."} & set(prefix.strip("/").split("/")) or "\\" in prefix:
                raise ValueError(f"run.remote={remote!r}: expected b2://bucket or b2://bucket/prefix")
        elif "://" in remote or not remote.strip():
            raise ValueError(f"run.remote={remote!r}: use b2://bucket/prefix or a folder path")
        elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", remote):
            raise ValueError(
                f"run.remote={remote!r} looks like a mistyped URL (b2:// has two slashes); a folder named "
                f"{remote.split(':')[0]}: is refused. Use b2://bucket/prefix, or ./{remote} for such a folder"
            )
        return remote
