"""Several nodes agree on one launch: node 0's plan and outcome read back exactly, anything else refused (exit 5);
ranks numbered node by node; the address a node advertises."""

from __future__ import annotations

import json

import pytest

from train.distributed.env import node_ordered_rank
from train.errors import ConfigError, DistributedError
from train.launch.address import advertised_address, interface_of, is_public, network_environ, route_source
from train.launch.plan import OUTCOME_KEY, PLAN_KEY, CheckpointRef, LaunchPlan, Outcome

WHERE = "10.0.0.1:29400"
SHA1 = "a" * 40


def test_a_plan_and_an_outcome_read_back_as_written():
    plan = LaunchPlan.new(["fit", "evaluate"], CheckpointRef("step_00000040.pt", 40, SHA1))
    assert LaunchPlan.from_json(plan.to_json(), WHERE) == plan
    assert LaunchPlan.from_json(LaunchPlan.new([], None).to_json(), WHERE).stages == ()
    assert Outcome.from_json(Outcome(75, "stopped").to_json(), WHERE) == Outcome(75, "stopped")


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("not json", PLAN_KEY),
        ('["fit"]', PLAN_KEY),
        ({"stages": ["fit"], "resume": None}, PLAN_KEY),
        ({"stages": ["fit", "rm -rf"], "resume": None, "token": "0" * 32}, f"{PLAN_KEY}.stages"),
        ({"stages": "fit", "resume": None, "token": "0" * 32}, f"{PLAN_KEY}.stages"),
        ({"stages": ["fit"], "resume": {"name": "../x.pt", "step": 1, "sha1": SHA1}, "token": "0" * 32},
         f"{PLAN_KEY}.resume"),
        ({"stages": ["fit"], "resume": {"name": "step_00000040.pt", "step": 41, "sha1": SHA1}, "token": "0" * 32},
         f"{PLAN_KEY}.resume"),
        ({"stages": ["fit"], "resume": None, "token": "short"}, f"{PLAN_KEY}.token"),
        ({"stages": ["fit"], "resume": None, "token": "0" * 32, "extra": 1}, PLAN_KEY),
    ],
)  # fmt: skip
def test_a_plan_no_launcher_writes_ends_the_launch_naming_the_key(value, key):
    text = value if isinstance(value, str) else json.dumps(value)
    with pytest.raises(DistributedError) as e:
        LaunchPlan.from_json(text, WHERE)
    assert e.value.exit_code == 5
    assert f"holds a value under {key} that no launcher of this package writes" in str(e.value)
    assert WHERE in str(e.value) and "docs/launching.md" in str(e.value)


@pytest.mark.parametrize("value", [{"code": "0", "message": ""}, {"code": 300, "message": ""}, {"code": True,
                                   "message": ""}, {"code": 0}, {"code": 0, "message": 1}])  # fmt: skip
def test_an_outcome_no_launcher_writes_is_refused(value):
    with pytest.raises(DistributedError, match=OUTCOME_KEY):
        Outcome.from_json(json.dumps(value), WHERE)


def test_ranks_are_numbered_node_by_node_whatever_order_torchrun_met_the_nodes_in(monkeypatch):
    monkeypatch.delenv("TRAIN_NODE_RANK", raising=False)
    assert node_ordered_rank(3, 1, 4, 2) == 3  # one node, tests: torchrun's own number
    monkeypatch.setenv("TRAIN_NODE_RANK", "0")
    monkeypatch.setenv("TRAIN_NNODES", "2")
    # torchrun put node 0's agent second (its address sorted after node 1's): its ranks were 2 and 3
    assert [node_ordered_rank(r, r - 2, 4, 2) for r in (2, 3)] == [0, 1]
    monkeypatch.setenv("TRAIN_NODE_RANK", "1")
    assert [node_ordered_rank(r, r, 4, 2) for r in (0, 1)] == [2, 3]
    with pytest.raises(ConfigError, match="start the same number of ranks on every node"):
        node_ordered_rank(0, 0, 3, 2)


def test_the_advertised_address_is_the_route_to_the_endpoint_or_advertise_addr():
    assert route_source("127.0.0.1", 29400) == "127.0.0.1"
    assert advertised_address({}, "127.0.0.1", 29400) == "127.0.0.1"
    assert advertised_address({"ADVERTISE_ADDR": "127.0.0.1"}, "10.0.0.1", 29400) == "127.0.0.1"
    with pytest.raises(ConfigError, match="ADVERTISE_ADDR='box1' must be an IP address"):
        advertised_address({"ADVERTISE_ADDR": "box1"}, "127.0.0.1", 29400)
    with pytest.raises(ConfigError, match=r"ADVERTISE_ADDR=192\.0\.2\.7 is not an address of this node"):
        advertised_address({"ADVERTISE_ADDR": "192.0.2.7"}, "127.0.0.1", 29400)
    with pytest.raises(ConfigError, match="does not resolve on this node"):
        route_source("no-such-host.invalid", 29400)


def test_gloo_and_nccl_use_the_interface_of_the_advertised_address():
    assert interface_of("127.0.0.1") == "lo"
    assert network_environ("127.0.0.1") == {}  # one machine: nothing to choose
    assert is_public("8.8.8.8") and not is_public("10.1.2.3") and not is_public("127.0.0.1")
    assert not is_public("192.168.0.4") and not is_public("fd00::1") and not is_public("box0")
