"""A rank's error file: PyTorch's format, written whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from train.distributed.error_file import record, record_error
from train.errors import ConfigError


def test_the_agent_reads_what_a_rank_records(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ConfigError("tasks.adv.patch_size=3 must divide the grid")
    except ConfigError as e:
        record_error(e)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert failure.message["message"] == "ConfigError: tasks.adv.patch_size=3 must divide the grid"
    assert "raise ConfigError" in failure.message["extraInfo"]["py_callstack"]


def test_record_writes_an_unexpected_exception_and_reraises_it(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def rank_main():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError):
        rank_main()
    assert ProcessFailure(0, 1, 1, str(path)).message["message"] == "RuntimeError: Connection closed by peer"


def test_a_write_cut_short_leaves_no_file(tmp_path, monkeypatch):
    """What a rank killed mid-write leaves: never a truncated file the agent would fail to parse."""
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def cut_short(self, text):
        with open(self, "w") as f:
            f.write(text[:10])
        raise KeyboardInterrupt  # stands for the signal that ends the rank while it writes

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(KeyboardInterrupt):
        record_error(ValueError("x"))
    assert not path.exists()
