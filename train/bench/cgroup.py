"""A memory cgroup around a command: its limit, its peak, and whether the kernel's OOM killer struck inside it.

Both hierarchies are handled: v2 (``/sys/fs/cgroup`` with a ``memory`` controller: ``memory.max``,
``memory.peak``, ``memory.events``) and v1 (``/sys/fs/cgroup/memory``: ``memory.limit_in_bytes``,
``memory.max_usage_in_bytes``, ``memory.oom_control``). Making one needs root. The page cache of the files the
processes read is charged to the cgroup too and reclaimed under the limit, as on a cluster node's job cgroup.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _v2() -> Path | None:
    controllers = ROOT / "cgroup.controllers"
    return ROOT if controllers.is_file() and "memory" in controllers.read_text().split() else None


def _v1() -> Path | None:
    return ROOT / "memory" if (ROOT / "memory" / "memory.limit_in_bytes").is_file() else None


def why_not() -> str | None:
    """None where a memory cgroup can be made here; otherwise why not."""
    if os.geteuid() != 0:
        return "making a memory cgroup needs root"
    base = _v2() or _v1()
    if base is None:
        return f"no memory cgroup controller under {ROOT} (neither v2's cgroup.controllers nor v1's memory/)"
    probe = base / f"train-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot make a cgroup under {base}: {e}"
    return None


class MemoryCgroup:
    """``with MemoryCgroup(limit) as cg: cg.run(argv)``; afterwards ``cg.peak_bytes`` and ``cg.oom_kills``."""

    def __init__(self, limit_bytes: int, name: str = "train-bench"):
        self.limit = limit_bytes
        self.v2 = _v2() is not None
        base = _v2() or _v1()
        assert base is not None, "checked with why_not() first"
        self.path = base / f"{name}-{uuid.uuid4().hex[:8]}"
        self.peak_bytes = 0
        self.oom_kills = 0

    def __enter__(self) -> MemoryCgroup:
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(self.limit))
            (self.path / "memory.swap.max").write_text("0") if (self.path / "memory.swap.max").exists() else None
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        return self

    def _read(self) -> None:
        if self.v2:
            peak = self.path / "memory.peak"
            self.peak_bytes = int(peak.read_text()) if peak.exists() else self.peak_bytes
            events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            self.oom_kills = int(events.get("oom_kill", 0))
        else:
            self.peak_bytes = int((self.path / "memory.max_usage_in_bytes").read_text())
            control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            self.oom_kills = int(control.get("oom_kill", 0))

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside the cgroup: a shell joins it, then execs the command, so every child is inside."""
        procs = self.path / "cgroup.procs"
        shell = f'echo $$ > "{procs}" && exec "$@"'
        return subprocess.Popen(["sh", "-c", shell, "sh", *argv], **kwargs)

    def run(self, argv: list[str], timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the cgroup to its end; output captured as text."""
        proc = self.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        out, err = proc.communicate(timeout=timeout)
        self._read()
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def __exit__(self, *exc) -> None:
        self._read()
        for _ in range(100):  # the last processes may take a moment to leave
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
