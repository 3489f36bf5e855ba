"""Tests of the monitoring figures, the data-wait fraction and the progress bar's two output modes."""

from __future__ import annotations

import logging
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from train.obs.monitor import DataWait, Progress, system_figures

SHM = Path("/dev/shm")


def test_rss_is_positive_and_grows_with_touched_memory():
    before = system_figures(torch.device("cpu"))["rss_mib"]
    assert before > 0
    block = np.ones(200 * (1 << 20), dtype=np.uint8)  # ones, not zeros: every page is written
    after = system_figures(torch.device("cpu"))["rss_mib"]
    assert after - before > 150, (before, after)
    del block


def test_cpu_figures_have_no_gpu_keys():
    assert not {"gpu_mem_mib", "gpu_reserved_mib"} & set(system_figures(torch.device("cpu")))


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_shm_used_grows_with_a_file_in_dev_shm():
    before = system_figures(torch.device("cpu"))["shm_used_mib"]
    path = SHM / f"test_monitor_{uuid.uuid4().hex}"
    try:
        path.write_bytes(b"\1" * (20 << 20))
        after = system_figures(torch.device("cpu"))["shm_used_mib"]
    finally:
        path.unlink(missing_ok=True)
    # Other processes may use /dev/shm meanwhile; the file's 20 MiB dominate a change this short.
    assert after - before > 15, (before, after)


def test_data_wait_is_the_fraction_of_time_spent_fetching():
    wait = DataWait()
    for _ in range(10):
        with wait.fetching():
            time.sleep(0.01)
        time.sleep(0.01)
    assert 0.3 < wait.take() < 0.7


def test_data_wait_starts_a_new_window_on_take():
    wait = DataWait()
    with wait.fetching():
        time.sleep(0.02)
    assert wait.take() > 0.5
    time.sleep(0.02)
    assert wait.take() < 0.5


def test_data_wait_counts_a_fetch_that_raises():
    wait = DataWait()
    with pytest.raises(StopIteration), wait.fetching():
        time.sleep(0.02)
        next(iter([]))
    assert wait.take() > 0.5


def test_line_mode_logs_the_bar_without_carriage_returns(caplog):
    caplog.set_level(logging.INFO, logger="train.progress")
    with Progress(total=150, initial=60, desc="epoch 2", enabled=True, live=False, line_interval_s=0) as bar:
        for _ in range(8):
            bar.update(1, loss=0.125)
    lines = [r.getMessage() for r in caplog.records if r.name == "train.progress"]
    assert len(lines) >= 2
    assert all("epoch 2" in line and "\r" not in line and "\n" not in line for line in lines)
    assert "60/150" in lines[0]
    assert "68/150" in lines[-1] and "loss=0.125" in lines[-1]


def test_line_mode_logs_at_most_once_per_interval(caplog):
    caplog.set_level(logging.INFO, logger="train.progress")
    with Progress(total=100, initial=0, desc="train", enabled=True, live=False, line_interval_s=3600) as bar:
        for _ in range(50):
            bar.update()
    lines = [r.getMessage() for r in caplog.records if r.name == "train.progress"]
    assert len(lines) == 2, lines  # the opening state and the closing one
    assert "0/100" in lines[0] and "50/100" in lines[1]


def test_disabled_progress_is_silent(caplog, capsys):
    caplog.set_level(logging.DEBUG)
    with Progress(total=10, initial=0, desc="train", enabled=False, live=False) as bar:
        bar.update(5, loss=1.0)
    with Progress(total=10, initial=0, desc="train", enabled=False, live=True) as bar:
        bar.update(5, loss=1.0)
    assert caplog.records == []
    assert capsys.readouterr() == ("", "")


def test_live_mode_routes_console_logs_through_tqdm_and_restores_them(capsys):
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    root.addHandler(handler)
    try:
        with Progress(total=4, initial=0, desc="live", enabled=True, live=True) as bar:
            assert handler not in root.handlers
            bar.update(2)
        assert handler in root.handlers
        assert "live" in capsys.readouterr().err
    finally:
        root.removeHandler(handler)


def test_a_window_names_a_task_not_drawn_and_leaves_skipped_steps_out_of_its_loss():
    """A skipped step's loss was summed into the window (its NaN shown as a loss of 0 in the total) and a task no
    rank drew printed as nan, the text of a diverged loss."""
    import torch

    from train.engine.loss import NOT_DRAWN, SKIPPED, LossWindow

    window = LossWindow(3, torch.device("cpu"))
    no, yes = torch.tensor(False), torch.tensor(True)
    window.add(torch.tensor([2.0, 0.0, 4.0]), torch.tensor([1.0, 0.0, 1.0]), 8, no)
    window.add(torch.tensor([float("nan"), 0.0, 7.0]), torch.tensor([1.0, 0.0, 1.0]), 8, yes)
    mean, record = window.take()
    assert mean == [2.0, NOT_DRAWN, 4.0] and record["skipped_steps"] == 1
    window.add(torch.tensor([float("nan"), 0.0, 1.0]), torch.tensor([1.0, 0.0, 1.0]), 8, yes)
    mean, record = window.take()
    assert mean == [SKIPPED, NOT_DRAWN, SKIPPED] and record["skipped_steps"] == 1
    window.add(torch.tensor([1.0, 3.0, 1.0]), torch.tensor([1.0, 1.0, 1.0]), 8, no)
    mean, record = window.take()
    assert mean == [1.0, 3.0, 1.0] and "skipped_steps" not in record
