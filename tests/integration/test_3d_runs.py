"""A 3D PDEBench task trained end to end under torchrun: the CFD layout's five fields on a 3D grid, with the
FNO (FNO3d) and the U-Net (UNet3d), through data, cache (in place), training, evaluation and the report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import folders, run_cli
from train.data.acquire.generate_cfd import write_cfd

pytestmark = pytest.mark.integration

CONFIG = """
tasks:
  cfd3d:
    pde: cfd3d
    source: {source}
    initial_step: 2
    batch_size: 2
    test_fraction: 0.2
    val_fraction: 0.1
model:
  name: {model}
  fno: {{modes: 4, width: 8}}
  unet: {{init_features: 4}}
train:
  epochs: 2
  steps_per_epoch: 6
  log_every: 2
"""


@pytest.mark.parametrize("model", ["fno", "unet"])
def test_a_3d_cfd_task_trains_and_is_evaluated(tmp_path, model):
    source = write_cfd(tmp_path / "3D_CFD_Rand_M1.0_Eta1e-08_Zeta1e-08_periodic_Train.hdf5", 20, 6, (16, 12, 8))
    config = tmp_path / "cfd3d.yaml"
    config.write_text(CONFIG.format(source=source, model=model))
    proc = run_cli("run", "--config", str(config), "--nproc", "2", "--run", model, *folders(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / model / "report" / "summary.json").read_text())
    test = summary["cfd3d"]
    assert np.isfinite(test["nrmse"]) and test["n_samples"] == 4
    assert len(test["nrmse_by_step"]) == 4  # frames 2..5 predicted from the first two
    manifest = next((tmp_path / "cache" / "cfd3d").glob("*/manifest.json"))
    assert json.loads(manifest.read_text())["in_place"] is not None  # the five fields mapped, not copied
