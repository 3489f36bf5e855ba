"""A trained surrogate in your own script: load a run, roll out new initial conditions, compare with the truth.

    python examples/use_surrogate.py runs/tiny            # after: make train CONFIG=configs/tiny.yaml
    python examples/use_surrogate.py runs/tiny --device cuda

The run folder is all it needs (no config file, no cache, no data): the checkpoint carries the model's
settings and each task's normalisation statistics. Inputs and outputs are in physical units, channels last.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import h5py
import numpy as np

from train import Surrogate
from train.data.acquire.generate import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a run folder, a checkpoint file or b2://bucket/prefix/<run>")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    model = Surrogate.load(args.run, device=args.device)
    for name, task in model.tasks.items():
        print(f"{name}: {task.pde} on a {task.spec.grid} grid, inputs {task.input_shape()}")

    # New initial conditions: a fresh advection dataset of another seed, at the run's own settings.
    task = next((t for t in model.tasks.values() if t.pde == "advection1d"), None)
    if task is None:
        print("this run has no advection1d task; see predict() and rollout() in train/use/surrogate.py")
        return
    s = task.settings
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "new.hdf5"
        generate(task.pde, path, n_samples=16, resolution=s["resolution"], coefficient=s["coefficient"], seed=1234)
        with h5py.File(path) as f:  # PDEBench's layout: tensor [sample, t, x]
            truth = f["tensor"][:, :: s["temporal_stride"], :: s["spatial_stride"]][..., None].astype(np.float32)
    k = task.spec.initial_step
    frames = model.rollout(task.name, truth[:, :k], steps=truth.shape[1] - k)  # (16, t - k, x, 1)
    error = np.sqrt(((frames - truth[:, k:]) ** 2).mean(axis=(1, 2, 3)) / (truth[:, k:] ** 2).mean(axis=(1, 2, 3)))
    print(f"{task.name}: {frames.shape[1]} frames rolled out for {len(frames)} new trajectories; "
          f"nRMSE per trajectory {[round(float(e), 3) for e in error]}")  # fmt: skip


if __name__ == "__main__":
    main()
