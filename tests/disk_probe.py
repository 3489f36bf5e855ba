"""Run inside a private mount namespace where one folder is a small tmpfs (see tests/integration/test_full_disk.py).

Its argument is a JSON list of steps, run in order:
``["train", ARG, ...]``: ``python -m train ARG ...`` as a child process;
``["fill", FOLDER, KEEP]``: a ballast file in FOLDER that leaves KEEP bytes free there (a disk filled by others);
``["empty", FOLDER]``: remove the ballast again;
``["outage", FOLDER, METRICS, STEP, SECONDS, TIMEOUT, ARG, ...]``: ``python -m train ARG ...`` started, FOLDER
filled (nothing left free) once METRICS logs STEP, emptied SECONDS later; the result holds the command's exit
code, or None when it had not ended TIMEOUT seconds after the disk was free again (then it is killed).
After each step it lists every file under the tmpfs with its size and SHA1, because the tmpfs vanishes with the
namespace; it prints one JSON line: a result per step.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

BALLAST = ".ballast"


def listing(root: Path) -> dict[str, list]:
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != BALLAST:
            files[str(path.relative_to(root))] = [path.stat().st_size, hashlib.sha1(path.read_bytes()).hexdigest()]
    return files


def fill(folder: Path, keep: int) -> None:
    """Write zeros until only ``keep`` bytes are left: real blocks, as another process filling the disk would.
    Filling it whole (``keep=0``) beside a run that writes too, the run may take the last blocks between a look
    at the free space and the write: the write then finds the disk full, which is what was asked."""
    with open(folder / BALLAST, "wb", buffering=0) as f:
        try:
            while (free := shutil.disk_usage(folder).free) > keep:
                f.write(b"\0" * min(free - keep, 1 << 20))
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno != errno.ENOSPC or keep:
                raise


def logged_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return -1
    steps = [json.loads(line).get("step", -1) for line in lines[:-1] if line.startswith("{")]
    return max(steps, default=-1)


def outage(folder: Path, metrics: Path, at: int, seconds: float, timeout: float, args: list[str]) -> dict:
    """A disk full for ``seconds`` while the command trains, as when another job writes a big file and removes it."""
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    while proc.poll() is None and logged_step(metrics) < at:
        time.sleep(0.01)
    full_at = logged_step(metrics)
    fill(folder, 0)
    time.sleep(seconds)
    (folder / BALLAST).unlink()
    try:
        _, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        code = None
    return {"returncode": code, "stderr": err[-8000:], "full_at_step": full_at}


def main(mount: Path, steps: list[list]) -> list[dict]:
    results = []
    for step in steps:
        result: dict = {"step": step[0]}
        if step[0] == "train":
            proc = subprocess.run([sys.executable, "-m", "train", *step[1:]], capture_output=True, text=True)
            result.update(returncode=proc.returncode, stderr=proc.stderr[-8000:], stdout=proc.stdout[-8000:])
        elif step[0] == "fill":
            fill(Path(step[1]), int(step[2]))
        elif step[0] == "empty":
            (Path(step[1]) / BALLAST).unlink()
        elif step[0] == "outage":
            result.update(outage(Path(step[1]), Path(step[2]), int(step[3]), float(step[4]), float(step[5]), step[6:]))
        result.update(free=shutil.disk_usage(mount).free, files=listing(mount))
        results.append(result)
    return results


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), json.loads(sys.argv[2]))))
