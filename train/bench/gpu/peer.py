"""A peer on the same GPU and data: neuraloperator 2.0.0's FNO trained by its own ``Trainer``.

The same advection windows as the trainer's (10 frames in as channels, the next frame out, 256 points), held on
the GPU in a dataset of ``{"x", "y"}`` items as neuraloperator's own datasets give them, batched by a DataLoader
(its usual input), the same FNO size (12 modes, width 20, 4 layers), AdamW and its relative L2 loss. The figure
is its samples per second over one timed epoch after a warm-up epoch, at the batch size given, in fp32 and
with its ``mixed_precision`` (fp16 autocast). neuraloperator is a test-only dependency (the dev extra; on a GPU
machine, a wheel carried along).
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset

from train.bench.gpu.perf import TASK, Bench


class _Windows(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def windows(bench: Bench, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` training windows of the trainer's own dataset, channels first, on the device."""
    from train.engine.loaders import task_dataset

    cfg = bench.cfg("peer", [])
    (task,) = bench.run_dir(cfg).load_tasks(cfg)
    dataset = task_dataset(task)
    items = dataset.__getitems__(list(range(min(n, len(dataset)))))
    x = items["x"][..., 0].to(bench.device)  # (n, frames, points): the frames as channels
    y = items["y"].movedim(-1, 1).to(bench.device)  # (n, 1, points)
    return x.contiguous(), y.contiguous()


def peer(bench: Bench, batch: int, mixed_precision: bool, batches: int = 64) -> dict:
    """neuraloperator's Trainer over ``batches`` batches per epoch: samples/s of the second epoch."""
    from neuralop import Trainer
    from neuralop.losses import LpLoss
    from neuralop.models import FNO

    x, y = windows(bench, batch * batches)
    loader = DataLoader(_Windows(x, y), batch_size=batch, shuffle=True, drop_last=True)
    torch.manual_seed(0)
    model = FNO(n_modes=(12,), hidden_channels=20, in_channels=x.shape[1], out_channels=1, n_layers=4)
    model = model.to(bench.device)
    trainer = Trainer(model=model, n_epochs=2, device=str(bench.device), mixed_precision=mixed_precision)
    trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    trainer.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(trainer.optimizer, T_max=2)
    trainer.regularizer = None
    loss = LpLoss(d=1, p=2)
    trainer.train_one_epoch(0, loader, loss)  # warm-up: allocations, cuFFT plans
    sync = torch.cuda.synchronize if bench.device.type == "cuda" else (lambda: None)
    sync()
    began = time.perf_counter()
    trainer.train_one_epoch(1, loader, loss)
    sync()
    seconds = time.perf_counter() - began
    return {
        "peer": "neuraloperator 2.0.0 FNO + Trainer",
        "batch": batch,
        "precision": "fp16 autocast" if mixed_precision else "fp32",
        "samples_per_s": trainer.n_samples / seconds,
        "parameters": sum(p.numel() for p in model.parameters()),
        "task": TASK,
    }
