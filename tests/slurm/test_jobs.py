"""Rendered sbatch files on a real cluster: a run that trains to the end, the one-launcher-per-node layout
whatever the header says, and the hand-written script that the doctor stops."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from tests.helpers import folders
from tests.slurm.jobs import Job, render, submit

# Jobs here train configs/tiny.yaml for seconds; the bound allows a busy 2-core machine.
TIMEOUT = 300

SEED_SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:1
srun "$PYTHON" -m train run --config configs/tiny.yaml {folders}
"""


def test_the_doctor_stops_two_tasks_per_node_within_seconds_with_exit_4(tmp_path, gpu_gres):
    """One launcher per task, each starting a rank per GPU: without the doctor the ranks pile onto one GPU or
    the launchers wait for each other until the time limit."""
    script = tmp_path / "seed.sbatch"
    script.write_text(SEED_SCRIPT.format(folders=" ".join(folders(tmp_path))))
    job = submit(script, tmp_path / "seed.out")
    shown = job.wait_done(TIMEOUT)
    assert (shown["JobState"], shown["ExitCode"]) == ("FAILED", "4:0"), job.context()
    ran = datetime.fromisoformat(shown["EndTime"]) - datetime.fromisoformat(shown["StartTime"])
    assert ran.total_seconds() < 15, f"the doctor took {ran} to stop the job{job.context()}"
    text = job.text()
    assert "FAIL  SLURM" in text and "2 task(s)/node" in text and "--ntasks-per-node=1" in text, job.context()
    assert "launching" not in text, "no rank may start"
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()


@pytest.fixture(scope="module")
def tiny_jobs(tmp_path_factory) -> dict[str, tuple[Job, Path]]:
    """Two runs of configs/tiny.yaml submitted together: as rendered, and with the header edited to
    --ntasks-per-node=2."""
    jobs = {}
    for name in ("rendered", "two_tasks"):
        tmp = tmp_path_factory.mktemp(name)
        script = render(tmp, name)
        if name == "two_tasks":
            text = script.read_text()
            assert "#SBATCH --ntasks-per-node=1\n" in text
            script.write_text(text.replace("#SBATCH --ntasks-per-node=1\n", "#SBATCH --ntasks-per-node=2\n"))
        jobs[name] = (submit(script, tmp / f"{name}.out"), tmp)
    yield jobs
    for job, _ in jobs.values():
        job.cancel()


def test_the_rendered_script_trains_to_the_end(tiny_jobs):
    job, tmp = tiny_jobs["rendered"]
    shown = job.wait_done(TIMEOUT)
    assert (shown["JobState"], shown["ExitCode"], shown["Restarts"]) == ("COMPLETED", "0:0", "0"), job.context()
    assert (tmp / "runs" / "rendered" / "report" / "summary.json").is_file(), job.context()
    # CPU-only rendering: no GPU asked for, and the job's CPUs are the ranks' (dist.cpu_nproc=2, no workers).
    assert "gres/gpu" not in shown.get("TRES", "") and shown["NumCPUs"] == "2", job.context()
    assert "PASS  SLURM" in job.text() and "no GPUs granted" in job.text(), job.context()


def test_one_launcher_starts_per_node_when_the_header_asks_for_two_tasks(tiny_jobs):
    job, tmp = tiny_jobs["two_tasks"]
    shown = job.wait_done(TIMEOUT)
    assert shown["NumTasks"] == "2", f"the edited header should give the job 2 tasks{job.context()}"
    assert (shown["JobState"], shown["ExitCode"]) == ("COMPLETED", "0:0"), job.context()
    text = job.text()
    # Each launcher runs the doctor and launches its ranks once: two launchers would show both twice.
    assert text.count("launching 2 rank(s) on 1 node") == 1, job.context()
    assert text.count("PASS  SLURM") == 1 and "1 task(s)/node" in text, job.context()
    assert (tmp / "runs" / "two_tasks" / "report" / "summary.json").is_file(), job.context()
