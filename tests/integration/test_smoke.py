"""The smoke test on 2 CPU ranks, and DEBUG=1 runs that must never write a secret anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import folders, run_cli

pytestmark = pytest.mark.integration

SENTINELS = {
    "B2_APPLICATION_KEY_ID": "SENTINELkeyid0f3c9a",
    "B2_APPLICATION_KEY": "SENTINELkey81d2e4b7",
    "WANDB_API_KEY": "SENTINELwandb5e6f",
    "HF_TOKEN": "SENTINELhf9a8b",
    "DB_PASSWORD": "SENTINELpw1c2d",
    "DB_PASSWD": "SENTINELpasswd3e4f",
    "GH_PAT": "SENTINELpat7a6b",
    "DATABASE_URL": "SENTINELurl2b3c",
}
# The environment holds some sentinels inside longer values; the searches still look for the sentinel alone.
SECRET_ENVIRON = {
    **SENTINELS,
    "DATABASE_URL": f"postgres://user:{SENTINELS['DATABASE_URL']}@host/db",
    "BACKUP_ARGS": f"--fast --key {SENTINELS['B2_APPLICATION_KEY']}",
}


def test_smoke_is_green_on_two_cpu_ranks(tmp_path):
    proc = run_cli("smoke", "--config", "configs/tiny.yaml", "--nproc", "2", *folders(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "runs" / "smoke" / "smoke.json").read_text())
    assert result["world_size"] == 2
    checks = {c["check"]: c for c in result["checks"]}
    expected = {"all_reduce", "broadcast", "all_gather", "barrier", "DDP vs one process", "checkpoint round trip"}
    assert expected | {"torch.compile step"} == set(checks)
    assert all(c["ok"] for c in checks.values()), checks
    assert "sum of rank+1 = 3" in checks["all_reduce"]["detail"]
    assert "graph(s) compiled; gradients equal eager" in checks["torch.compile step"]["detail"]
    assert "PASS  DDP vs one process" in proc.stdout


def test_smoke_can_leave_out_the_compile_step(tmp_path):
    proc = run_cli("smoke", "--config", "configs/tiny.yaml", "--skip-compile", *folders(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "runs" / "smoke" / "smoke.json").read_text())
    assert "torch.compile step" not in {c["check"] for c in result["checks"]}


def every_file(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_debug_run_logs_every_rank_and_the_environment_without_any_secret(tmp_path):
    env = {"DEBUG": "1", **SECRET_ENVIRON}
    proc = run_cli("run", "--config", "configs/tiny.yaml", "--nproc", "2", *folders(tmp_path), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "tiny"
    # DEBUG=1 did what it says: every rank on the console, the environment dumped, the flight recorder's folder.
    assert "[rank1]" in proc.stderr and "[rank0]" in proc.stderr
    rank1 = (run_dir / "logs" / "rank1.log").read_text()
    assert "B2_APPLICATION_KEY': '<redacted>'" in rank1 and "'NCCL_DEBUG': 'INFO'" in rank1
    # Redaction is targeted: only the password leaves the URL, only the key leaves the innocent variable.
    assert "'DATABASE_URL': 'postgres://user:<redacted>@host/db'" in rank1
    assert "'BACKUP_ARGS': '--fast --key <redacted>'" in rank1
    assert (run_dir / "flight_recorder").is_dir()
    files = every_file(tmp_path)
    assert len(files) > 20
    for path in files:
        data = path.read_bytes()
        for name, secret in SENTINELS.items():
            assert secret.encode() not in data, f"{name}'s value was written to {path}"
    for secret in SENTINELS.values():
        assert secret not in proc.stdout + proc.stderr


def test_a_failing_check_is_reported_on_every_rank_and_exits_non_zero(tmp_path):
    # A file where the checkpoint folder should be: saving fails on rank 0, loading on rank 1.
    blocker = tmp_path / "runs" / "smoke" / "checkpoints"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a folder")
    proc = run_cli("smoke", "--config", "configs/tiny.yaml", "--skip-compile", *folders(tmp_path), timeout=300)
    assert proc.returncode == 5, proc.stderr[-4000:]
    assert "FAIL  checkpoint round trip" in proc.stdout and "PASS  DDP vs one process" in proc.stdout
    assert "smoke test failed: checkpoint round trip" in proc.stderr
    result = json.loads((tmp_path / "runs" / "smoke" / "smoke.json").read_text())
    assert [c["check"] for c in result["checks"] if not c["ok"]] == ["checkpoint round trip"]
