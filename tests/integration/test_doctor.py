"""``python -m train doctor`` on this machine and on simulated SLURM allocations; the automatic preflight."""

from __future__ import annotations

import pytest

from tests.helpers import folders, run_cli, startup_s

pytestmark = pytest.mark.integration

EIGHT_TASKS_ONE_GPU = {  # --gres=gpu:h200:1 with --ntasks-per-node=8: eight launchers for one GPU
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "8",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_GPUS_ON_NODE": "1",
    "SLURM_JOB_NODELIST": "gpu17",
}


def test_doctor_passes_here_and_prints_the_table(tmp_path):
    proc = run_cli("doctor", "--config", "configs/tiny.yaml", *folders(tmp_path), timeout=60 * startup_s())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("libraries", "container", "nproc vs GPUs", "rendezvous", "/dev/shm", "disk", "data", "memlock"):
        assert name in proc.stdout


def test_doctor_fails_with_exit_4_on_eight_tasks_for_one_gpu(tmp_path):
    args = ["doctor", "--config", "configs/tiny.yaml", *folders(tmp_path)]
    proc = run_cli(*args, env=EIGHT_TASKS_ONE_GPU, timeout=60 * startup_s())
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "FAIL  SLURM" in proc.stdout and "8 tasks per node" in proc.stdout
    assert "--ntasks-per-node=1" in proc.stdout
    assert "preflight failed (SLURM)" in proc.stderr


def test_every_launch_runs_the_doctor_first_unless_skipped(tmp_path):
    args = ["run", "--config", "configs/tiny.yaml", *folders(tmp_path)]
    proc = run_cli(*args, env=EIGHT_TASKS_ONE_GPU, timeout=60 * startup_s())
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert not (tmp_path / "data").exists(), "nothing may run after a failed preflight"
    skipped = run_cli(
        "data", "--config", "configs/tiny.yaml", *folders(tmp_path), env={**EIGHT_TASKS_ONE_GPU, "SKIP_DOCTOR": "1"},
        timeout=60 * startup_s(),
    )  # fmt: skip
    assert skipped.returncode == 0, skipped.stderr[-3000:]


def test_a_busy_rendezvous_port_fails_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        env = {"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": f"127.0.0.1:{holder.getsockname()[1]}"}
        proc = run_cli("smoke", "--config", "configs/tiny.yaml", *folders(tmp_path), env=env, timeout=60 * startup_s())
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "already in use" in proc.stderr
