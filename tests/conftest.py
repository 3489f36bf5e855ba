"""Shared fixtures: every test gets its own working folder and leaves the environment as it found it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def python() -> str:
    return sys.executable


def write_yaml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# A busy process: spins until the test session that started it is gone (bounded by its parent's life).
_BUSY = """
import os, sys, time
parent = int(sys.argv[1])
while os.getppid() == parent:
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        pass
"""


def pytest_collection_modifyitems(items):
    """The container tests last: CI provisions Docker while the other tiers run (they wait for it)."""
    items.sort(key=lambda item: "tests/container/" in str(item.fspath))


def pytest_collection_finish(session):
    """Every test module is imported, torch with them: the session's collections skip those objects from now on,
    as each launcher's and rank's do (train.heap)."""
    from train.heap import freeze_imported

    freeze_imported()


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-load",
        type=int,
        default=0,
        metavar="N",
        help="run the tests beside N busy processes, as on a shared machine (make test-load)",
    )


@pytest.fixture(scope="session", autouse=True)
def _cpu_load(request):
    n = request.config.getoption("--cpu-load")
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY, str(os.getpid())]) for _ in range(n)]
    yield
    for proc in busy:
        proc.kill()
        proc.wait()


def pytest_report_header(config):
    n = config.getoption("--cpu-load")
    return f"cpu load: {n} busy process(es) beside the tests on {os.cpu_count()} core(s)" if n else None


@pytest.fixture(scope="session")
def farm(tmp_path_factory):
    """The farm of trained runs (tests/farm.py): the whole ``make test``'s when it set one, else this session's."""
    from tests.farm import Farm
    from tests.tiers import FARM_ENV

    root = os.environ.get(FARM_ENV)
    return Farm(Path(root) if root else tmp_path_factory.mktemp("farm"))


@pytest.fixture(scope="session")
def local_sweep(farm):
    """The shared grid sweep (tests/sweeps.py) on this machine, killed mid-trial and continued, once a session."""
    return farm.sweep()
