"""The data loading benchmark runs end to end (``--quick``: tiny data, so its figures are not the targets')."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration


def test_quick_benchmark_writes_every_figure(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "train.bench", "--quick", "--out", str(tmp_path), "--workdir", str(tmp_path / "w")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "cache_io.json").read_text())
    assert set(result["loaders"]) == {"mmap", "h5py", "shared"}
    for name, figures in result["loaders"].items():
        assert figures["samples_per_s"] > 0 and math.isfinite(figures["samples_per_s"]), name
        assert figures["samples_timed"] == 2 * (10 if name != "h5py" else 4) * (32 + 16), name
        assert figures["processes"] == 2 + 2 * 2 * 2  # ranks, and 2 workers per task loader on each
        assert figures["shm_peak_bytes"] >= 0
    # the seed's design holds the cache in /dev/shm once per rank; ours holds none of it there
    assert result["loaders"]["shared"]["shm_peak_bytes"] >= 2 * result["cache_bytes"]
    assert result["build"]["build_MBps"] > 0 and result["build"]["raw_read_MBps"] > 0
    assert len(result["targets"]) == 5 and all(isinstance(v, bool) for v in result["targets"].values())
    table = (tmp_path / "cache_io.md").read_text()
    assert "(a) mmap cache" in table and "build >= 50% of raw read" in table
    assert table in proc.stdout
