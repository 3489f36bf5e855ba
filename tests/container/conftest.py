"""Fixtures of the container tests: a real Docker engine, the image built from a local base, compose files.

Without an engine (or without the local base image, which no registry can provide here) every test skips and
says why; CI provisions both with scripts/ci/provision-docker.sh, in the background while the other tiers run
(these tests run last and wait for it).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import REPO

BASE_IMAGE = os.environ.get("TRAIN_BASE_IMAGE", "train-base:cpu-torch2.13.0")
IMAGE = os.environ.get("TRAIN_TEST_IMAGE", "train:test")
PROVISION = REPO / "scripts" / "ci" / "provision-docker.sh"
# .ci/run provisions Docker in the background and writes the script's exit code to this file when it ends (its
# output beside it, in <file>.log).
PROVISIONING = os.environ.get("TRAIN_DOCKER_PROVISIONING")
PROVISIONING_TIMEOUT_S = 3600


def unavailable(reason: str):
    helpers.unavailable(reason, "TRAIN_REQUIRE_DOCKER")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/container" in str(item.fspath):
            item.add_marker(pytest.mark.container)


@pytest.fixture(scope="session")
def provisioned() -> None:
    """Where Docker is being provisioned in the background (CI), its end: the tests need the engine and base."""
    if not PROVISIONING:
        return
    status = Path(PROVISIONING)
    deadline = time.monotonic() + PROVISIONING_TIMEOUT_S
    while not status.exists():
        assert time.monotonic() < deadline, f"Docker's provisioning wrote no {status} in {PROVISIONING_TIMEOUT_S} s"
        time.sleep(2)
    code = status.read_text().strip()
    if code != "0":
        log = Path(f"{status}.log")
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
        pytest.fail(f"provisioning Docker failed (exit {code}; {log}):\n{tail}")


@pytest.fixture(scope="session")
def compose_v2(provisioned) -> None:
    """The compose binary (v2): needed to validate and run compose.yaml, with or without an engine."""
    found = shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True)
    if not found or found.returncode or b"v2." not in found.stdout:
        unavailable("Docker Compose v2 (`docker compose`) is missing; run scripts/ci/provision-docker.sh")


@pytest.fixture(scope="session")
def client(compose_v2):
    try:
        import docker

        engine = docker.from_env(timeout=600)
        engine.ping()
    except Exception as e:  # no socket, no daemon, no permission: all mean "no engine here"
        unavailable(f"no Docker engine reachable ({type(e).__name__}: {e}); run scripts/ci/provision-docker.sh")
    return engine


@pytest.fixture(scope="session")
def image(client) -> str:
    """The project's image, built with compose from the local CPU base and wheels/ (the offline path)."""
    import docker

    try:
        client.images.get(BASE_IMAGE)
    except docker.errors.ImageNotFound:
        unavailable(f"base image {BASE_IMAGE} missing; build it with scripts/ci/provision-docker.sh")
    wheels = REPO / "wheels"
    if not any(wheels.glob("*.whl")):
        subprocess.run(["bash", str(PROVISION), "wheels", str(wheels)], check=True)
    proc = compose("build", "train-cpu", env={"BASE_IMAGE": BASE_IMAGE})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return IMAGE


@functools.cache
def compose_files() -> list[str]:
    """compose.yaml, plus compose.ci.yaml where the container runtime refuses an unlimited memlock (CI's)."""
    probe = subprocess.run(
        ["docker", "run", "--rm", "--ulimit", "memlock=-1:-1", BASE_IMAGE, "true"], capture_output=True, text=True
    )
    if probe.returncode == 0:
        return ["compose.yaml"]
    print(f"this runtime refuses memlock=-1 ({probe.stderr.strip()[-200:]}): adding compose.ci.yaml")
    return ["compose.yaml", "compose.ci.yaml"]


def compose(*args: str, env: dict | None = None, timeout: float = 1200) -> subprocess.CompletedProcess:
    """``docker compose -f ... ARGS`` in the repository, with the test image's name."""
    files = [a for f in compose_files() for a in ("-f", f)]
    return subprocess.run(
        ["docker", "compose", *files, "--profile", "cpu", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TRAIN_IMAGE": IMAGE, **(env or {})},
    )


@pytest.fixture
def mounts(tmp_path) -> dict[str, str]:
    """Host folders for /data, /cache and /runs, owned by the container's uid 1000 as on a user's machine."""
    folders = {}
    for name in ("data", "cache", "runs"):
        path = tmp_path / name
        path.mkdir()
        try:
            os.chown(path, 1000, 1000)
        except PermissionError:  # not root: let uid 1000 in another way
            path.chmod(0o777)
        folders[f"{name.upper()}_DIR"] = str(path)
    return folders
