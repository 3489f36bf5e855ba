"""The garbage collector kept off a process's imported objects (train.heap), checked in fresh interpreters: the
collector's state is per process, and the point is what happens while modules are first imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Records each collection from the moment train.heap is imported: its generation and whether torch's dynamo and
# the rank's start were imported by then.
WATCH = """
import gc, json, sys
seen = []
gc.callbacks.append(lambda phase, info: phase == "start" and "train.heap" in sys.modules and seen.append(
    [info["generation"], "torch._dynamo" in sys.modules, "train.rank_start" in sys.modules]))
"""


def _python(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_imports_inside_importing_run_uncollected_then_are_frozen_with_the_collector_back_on():
    result = _python(
        WATCH
        + """
from train.heap import importing
seen.clear()
with importing():
    import torch._dynamo
print(json.dumps({"seen": seen, "frozen": gc.get_freeze_count(), "enabled": gc.isenabled()}))
"""
    )
    # One collection, the full one before freezing, once everything was imported: not one per growth of the heap.
    assert result["seen"] == [[2, True, False]], result["seen"]
    assert result["frozen"] > 100_000 and result["enabled"]


@pytest.mark.parametrize("module", ["train.worker", "train.smoke_worker"])
def test_a_rank_entry_run_as_the_program_imports_everything_before_the_first_collection(module):
    """As torchrun runs it (``python -m``): no collection while its modules (dynamo, which DDP imports, included)
    are imported; run_rank collects once and freezes them before anything else."""
    result = _python(
        WATCH
        + f"""
import runpy
sys.argv = ["{module}"]  # no --run-dir: the rank stops at its arguments, after run_rank froze the imports
try:
    runpy.run_module("{module}", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print(json.dumps({{"seen": seen, "frozen": gc.get_freeze_count(), "enabled": gc.isenabled()}}))
"""
    )
    assert result["seen"], "no collection at all"
    assert result["seen"][0] == [2, True, True], result["seen"][:5]
    assert result["frozen"] > 200_000 and result["enabled"]


def test_importing_a_rank_entry_as_a_module_leaves_the_collector_alone():
    result = _python(
        WATCH + 'import train.worker\nprint(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))'
    )
    assert result == {"enabled": True, "frozen": 0}
