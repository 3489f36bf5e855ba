"""Two "boxes" on one machine: network namespaces joined by a veth pair, each with an address, a hostname and
run, data and cache folders of its own. Nothing is shared between them but the link, as between two rented
machines without a shared file system; their hostnames resolve nowhere (/etc/hosts knows neither)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO, startup_s

SUBNET = "10.231.{}.{}"  # addresses of the test's own namespaces, reached only through its veth pair


@dataclass(frozen=True)
class Box:
    index: int
    namespace: str
    address: str
    hostname: str

    def folders(self, root: Path) -> list[str]:
        """--set overrides that put this box's data, caches and runs in a folder only it uses."""
        home = root / self.hostname
        return [
            "--set", f"run.data_dir={home / 'data'}",
            "--set", f"run.cache_dir={home / 'cache'}",
            "--set", f"run.runs_dir={home / 'runs'}",
        ]  # fmt: skip

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this box: its network namespace and a UTS namespace with its own hostname."""
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", script, self.hostname, *argv]

    def popen(self, *args: str, env: dict, log: Path) -> subprocess.Popen:
        """``python -m train ARGS`` on this box, output into ``log``, in a session of its own."""
        return self.shell([sys.executable, "-m", "train", *args], env=env, log=log)

    def shell(self, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
        """``argv`` on this box (``python`` is this interpreter), output into ``log``, in a session of its own."""
        startup_s()  # measured before the launch, not while it runs
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        with open(log, "w") as output:
            return subprocess.Popen(
                self.command(*argv),
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO), "PATH": path, **env},
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def problem() -> str | None:
    """Why two network namespaces cannot be made here, or None when they can."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the {tool} command is not installed (iproute2, util-linux)"
    name = f"trainprobe{os.getpid()}"
    made = _ip("netns", "add", name)
    if made.returncode:
        return f"network namespaces cannot be made here: {made.stderr.strip()}"
    _ip("netns", "delete", name)
    return None


def make_boxes(tag: int) -> list[Box]:
    """Two boxes joined by a veth pair (``tag`` keeps concurrent sessions' names and subnets apart)."""
    net = 16 + tag % 200
    # Node 1's address sorts first as text: torchrun's rendezvous then numbers node 1's agent first, as it does
    # on many real clusters, and the ranks must still put rank 0 on node 0.
    boxes = [Box(i, f"train{tag}box{i}", SUBNET.format(net, 2 - i), f"box{i}-{tag}") for i in (0, 1)]
    remove_boxes(boxes)
    veth = [f"tv{tag % 100000}n{i}" for i in (0, 1)]
    steps = [
        *(("netns", "add", b.namespace) for b in boxes),
        ("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
    ]
    for box, link in zip(boxes, veth, strict=True):
        steps += [
            ("link", "set", link, "netns", box.namespace),
            ("-n", box.namespace, "addr", "add", f"{box.address}/24", "dev", link),
            ("-n", box.namespace, "link", "set", link, "up"),
            ("-n", box.namespace, "link", "set", "lo", "up"),
        ]
    for step in steps:
        done = _ip(*step)
        if done.returncode:
            remove_boxes(boxes)
            raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")
    return boxes


def remove_boxes(boxes: list[Box]) -> None:
    for box in boxes:  # deleting a namespace deletes the veth end inside it, and with it its peer
        _ip("netns", "delete", box.namespace)
