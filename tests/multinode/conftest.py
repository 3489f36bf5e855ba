"""Fixtures of the two-box tier: two network namespaces, each a "box" with its own address, hostname and run,
data and cache folders. Without network namespaces (not root, no iproute2) every test skips and says why; CI
sets TRAIN_REQUIRE_NETNS=1, which turns the skips into failures."""

from __future__ import annotations

import os

import pytest

from tests import helpers
from tests.multinode import hosts


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/multinode" in str(item.fspath):
            item.add_marker(pytest.mark.multinode)


@pytest.fixture(scope="session")
def boxes() -> list[hosts.Box]:
    problem = hosts.problem()
    if problem is not None:
        helpers.unavailable(problem, "TRAIN_REQUIRE_NETNS")
    made = hosts.make_boxes(os.getpid() % 100000)
    yield made
    hosts.remove_boxes(made)
