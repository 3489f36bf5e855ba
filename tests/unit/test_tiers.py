"""make test's queue of tiers (tests/tiers.py): every test file in exactly one tier, and the exit code."""

from __future__ import annotations

from collections import Counter

from tests.helpers import REPO
from tests.tiers import (
    AT_ONCE_ENV,
    INTEGRATION,
    NO_TESTS,
    OUT_OF_CORE,
    PARTS,
    Tier,
    exit_code,
    queue,
    run_tier,
    table,
    workers,
)


def test_every_integration_file_is_in_one_part_and_the_parts_name_real_files():
    named = [file for files in PARTS.values() for file in files]
    assert [f for f, n in Counter(named).items() if n > 1] == []
    assert [f for f in named if not (REPO / INTEGRATION / f).is_file()] == []
    tiers = queue()
    rest = next(t for t in tiers if t.name == "integration-5")
    files = {p.name for p in (REPO / INTEGRATION).glob("test_*.py")}
    in_rest = files - set(named) - {OUT_OF_CORE.rsplit("/", 1)[1]}
    assert {p.rsplit("/", 1)[1] for p in rest.ignore} | in_rest == files
    assert [t.marks for t in tiers if t.paths == [INTEGRATION] or t.name.startswith("integration")].count("waits") == 1
    assert {t.name for t in tiers} >= {"unit", "distributed", "slurm", "multinode", "container", "out-of-core"}
    # the waits tier has a lane of its own; the container tier comes after the long ones (Docker's provisioning
    # runs until then)
    assert [t.name for t in tiers if t.waits] == ["waits"]
    order = [t.name for t in tiers]
    long_ones = ["slurm", "unit", *(t.name for t in tiers if t.name.startswith("integration-"))]
    assert all(order.index("container") > order.index(name) for name in long_ones), order


def test_the_exit_code_is_the_first_failing_tiers_and_5_only_when_no_tier_ran_a_test():
    def tiers(*codes):
        return [Tier(str(i), [], code=c) for i, c in enumerate(codes)]

    assert exit_code(tiers(0, NO_TESTS, 0)) == 0
    assert exit_code(tiers(0, 1, 2)) == 1
    assert exit_code(tiers(NO_TESTS, 2)) == 2
    assert exit_code(tiers(NO_TESTS, NO_TESTS)) == NO_TESTS


def test_a_tier_at_a_time_per_two_cores_and_never_fewer_than_two(monkeypatch):
    monkeypatch.delenv(AT_ONCE_ENV, raising=False)
    assert [workers(cores) for cores in (1, 2, 4, 5, 6, 8, 16)] == [2, 2, 2, 2, 3, 4, 8]
    monkeypatch.setenv(AT_ONCE_ENV, "1")
    assert workers(16) == 1


def test_a_tier_reports_its_code_summary_and_the_cpu_time_of_the_processes_it_started(tmp_path):
    busy = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    (tmp_path / "test_busy.py").write_text(
        "import subprocess, sys\n\n"
        f"def test_busy():\n    subprocess.run([sys.executable, '-c', {busy!r}], check=True)\n\n"
        "def test_fails():\n    assert False\n"
    )
    tier = Tier("busy", [str(tmp_path / "test_busy.py")])
    run_tier(tier, ["-p", "no:cacheprovider"], tmp_path)
    assert tier.code == 1 and tier.summary.startswith("1 failed, 1 passed")
    assert tier.cpu_seconds >= 0.6  # the grandchild's busy loop counts
    assert "busy" in table([tier], 1.0) and "CPU s" in table([tier], 1.0)
