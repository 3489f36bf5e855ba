"""Run inside a private mount namespace where one folder is a small tmpfs (see tests/integration/test_full_disk.py).

Its argument is a JSON list of steps, run in order:
``["train", ARG, ...]``: ``python -m train ARG ...`` as a child process;
``["fill", FOLDER, KEEP]``: a ballast file in FOLDER that leaves KEEP bytes free there (a disk filled by others);
``["empty", FOLDER]``: remove the ballast again.
After each step it lists every file under the tmpfs with its size and SHA1, because the tmpfs vanishes with the
namespace; it prints one JSON line: a result per step.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BALLAST = ".ballast"


def listing(root: Path) -> dict[str, list]:
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != BALLAST:
            files[str(path.relative_to(root))] = [path.stat().st_size, hashlib.sha1(path.read_bytes()).hexdigest()]
    return files


def fill(folder: Path, keep: int) -> None:
    """Write zeros until only ``keep`` bytes are left: real blocks, as another process filling the disk would."""
    with open(folder / BALLAST, "wb") as f:
        while (free := shutil.disk_usage(folder).free) > keep:
            f.write(b"\0" * min(free - keep, 1 << 20))
            f.flush()
            os.fsync(f.fileno())


def main(mount: Path, steps: list[list]) -> list[dict]:
    results = []
    for step in steps:
        result: dict = {"step": step[0]}
        if step[0] == "train":
            proc = subprocess.run([sys.executable, "-m", "train", *step[1:]], capture_output=True, text=True)
            result.update(returncode=proc.returncode, stderr=proc.stderr[-8000:])
        elif step[0] == "fill":
            fill(Path(step[1]), int(step[2]))
        elif step[0] == "empty":
            (Path(step[1]) / BALLAST).unlink()
        result.update(free=shutil.disk_usage(mount).free, files=listing(mount))
        results.append(result)
    return results


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), json.loads(sys.argv[2]))))
