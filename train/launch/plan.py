"""What a launch does, decided once by the first node's launcher and followed by every other node.

Each node may keep its own run folder (boxes without a shared file system): only node 0's folder, the one
rank 0 writes, says how far the run is. So node 0's launcher alone looks at checkpoints and the report, decides
the stages and the checkpoint the ranks start from, and posts that plan through the rendezvous store; the other
launchers read it and never decide from their own (possibly stale) files. Whatever is read back from the store
is checked against the protocol's own shapes: a value this package never writes ends the launch (exit 5)
naming the key, instead of steering it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from train.checkpoint import checkpoint_digest, checkpoint_step
from train.errors import DistributedError

PLAN_KEY = "train/launch/plan"
OUTCOME_KEY = "train/launch/outcome"
STAGES = ("fit", "evaluate")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_TOKEN = re.compile(r"^[0-9a-f]{32}$")
_MESSAGE_MAX = 4000


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint of node 0's run folder, as the ranks will receive it."""

    name: str
    step: int
    sha1: str

    @classmethod
    def of(cls, path: Path) -> CheckpointRef:
        step = checkpoint_step(path.name)
        assert step is not None, f"{path} is no step checkpoint"
        return cls(path.name, step, checkpoint_digest(path))


@dataclass(frozen=True)
class LaunchPlan:
    stages: tuple[str, ...]
    """The rank stages every node runs (fit, evaluate); empty: nothing to do, every node ends here."""
    resume: CheckpointRef | None
    """The checkpoint training continues from (None: from the start, or training is not a stage)."""
    token: str
    """A random token node 0 also writes into its run folder: a node that finds it in its own run folder
    shares node 0's (one file system); any other node keeps a node-local one."""

    @classmethod
    def new(cls, stages: list[str], resume: CheckpointRef | None) -> LaunchPlan:
        return cls(tuple(stages), resume, secrets.token_hex(16))

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "stages": list(self.stages)})

    @classmethod
    def from_json(cls, text: str, where: str) -> LaunchPlan:
        """Parse what was read under PLAN_KEY at ``where`` (the endpoint), refusing anything else."""
        value = _parsed(text, PLAN_KEY, where)
        _keys(value, {"stages", "resume", "token"}, PLAN_KEY, where)
        stages = value["stages"]
        if not isinstance(stages, list) or not all(s in STAGES for s in stages) or len(set(stages)) != len(stages):
            raise _foreign(f"{PLAN_KEY}.stages", where, f"{stages!r} is no list of {', '.join(STAGES)}")
        resume = value["resume"]
        if resume is not None:
            _keys(resume, {"name", "step", "sha1"}, f"{PLAN_KEY}.resume", where)
            step = checkpoint_step(resume["name"]) if isinstance(resume["name"], str) else None
            ok = step is not None and resume["step"] == step and isinstance(resume["sha1"], str)
            if not ok or not _HEX40.match(resume["sha1"]):
                raise _foreign(f"{PLAN_KEY}.resume", where, f"{resume!r} is no checkpoint reference")
            resume = CheckpointRef(resume["name"], step, resume["sha1"])
        if not isinstance(value["token"], str) or not _TOKEN.match(value["token"]):
            raise _foreign(f"{PLAN_KEY}.token", where, "not 32 hex digits")
        return cls(tuple(stages), resume, value["token"])


@dataclass(frozen=True)
class Outcome:
    """How node 0's launch ended: the exit code every node ends with, and node 0's message."""

    code: int
    message: str

    def to_json(self) -> str:
        return json.dumps({"code": self.code, "message": self.message[:_MESSAGE_MAX]})

    @classmethod
    def from_json(cls, text: str, where: str) -> Outcome:
        value = _parsed(text, OUTCOME_KEY, where)
        _keys(value, {"code", "message"}, OUTCOME_KEY, where)
        code, message = value["code"], value["message"]
        if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code < 256 or not isinstance(message, str):
            raise _foreign(OUTCOME_KEY, where, f"code {code!r} is no exit code or the message is no text")
        return cls(code, message[:_MESSAGE_MAX])


def _parsed(text: str, key: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise _foreign(key, where, "not JSON") from None
    if not isinstance(value, dict):
        raise _foreign(key, where, "not a JSON object")
    return value


def _keys(value: object, expected: set[str], key: str, where: str) -> None:
    if not isinstance(value, dict) or set(value) != expected:
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise _foreign(key, where, f"keys {got}, expected {sorted(expected)}")


def _foreign(key: str, where: str, problem: str) -> DistributedError:
    return DistributedError(
        f"the rendezvous store at {where} holds a value under {key} that no launcher of this package writes "
        f"({problem}); the launch stops rather than follow it. Another program (or another job with the same "
        "RDZV_ENDPOINT and RDZV_ID) is writing to the rendezvous port: keep the ports reachable only from your own "
        "nodes (see docs/launching.md, 'Several machines') and use a port of your own"
    )
