"""Fixtures of the slurm tests: a real SLURM cluster whose node runs the jobs.

Without one every test skips and says why; CI makes this machine a one-node cluster with
scripts/ci/provision-slurm.sh (and sets TRAIN_REQUIRE_SLURM=1, which turns the skips into failures).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests import helpers
from tests.helpers import REPO

PROVISION = REPO / "scripts" / "ci" / "provision-slurm.sh"
USABLE_STATES = ("idle", "mixed", "allocated", "completing")


def unavailable(reason: str):
    helpers.unavailable(reason, "TRAIN_REQUIRE_SLURM")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/slurm" in str(item.fspath):
            item.add_marker(pytest.mark.slurm)


def sinfo(*fields: str) -> list[list[str]]:
    """One row per node of ``sinfo -N`` with the given format fields (e.g. %T for the state)."""
    proc = subprocess.run(
        ["sinfo", "-N", "-h", "-o", "|".join(fields)], capture_output=True, text=True, timeout=30, check=False
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr.strip() or f"sinfo exited with {proc.returncode}")
    return [line.split("|") for line in proc.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="session", autouse=True)
def cluster() -> list[str]:
    """The names of the nodes that can run jobs now."""
    hint = f"run {PROVISION.relative_to(REPO)} to make this machine a one-node cluster"
    for tool in ("sinfo", "sbatch", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            unavailable(f"no SLURM here ({tool} not found); {hint}")
    try:
        rows = sinfo("%N", "%T")
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        unavailable(f"no SLURM cluster answers sinfo ({e}); {hint}")
    usable = [node for node, state in rows if state.rstrip("*~#!%$@^-").lower() in USABLE_STATES]
    if not usable:
        unavailable(f"no SLURM node can run jobs (sinfo: {rows or 'no nodes'}); {hint}")
    return usable


@pytest.fixture(scope="session")
def gpu_gres(cluster) -> None:
    """A node with a GPU in its generic resources (the provisioned cluster has a fake one)."""
    if not any("gpu" in gres for _, gres in sinfo("%N", "%G")):
        unavailable(f"no SLURM node offers a gpu gres; {PROVISION.relative_to(REPO)} configures a fake one")
