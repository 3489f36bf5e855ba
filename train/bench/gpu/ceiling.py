"""The ceiling a training loop on one GPU is measured against: the default FNOs' training step with the data
already on the device, each batch's windows gathered there by index, no loader, no host work between steps.

Per task (the default advection model at PDEBench's published size, 10,000 trajectories x 201 frames x 1024
points, 10 frames in; the Darcy model at 128 x 128), batch size and mode: ``fp32`` and ``bf16`` (autocast)
eager; ``graph``, the whole step (gather, forward, backward, AdamW) captured once in a CUDA graph and replayed;
``compile_bf16``, the model under torch.compile. The data is random: the figures are the arithmetic and memory
traffic of the step, not of any loading. ``make gpu-check GPU_CHECKS=ceiling`` runs it; on a CPU it runs at toy
sizes (tests keep it working).
"""

from __future__ import annotations

import time

import torch

from train.config import FNOConfig
from train.model.fno import FNO
from train.model.specs import TaskSpec

PLAN = [
    *[("advection1d", b, m) for b in (64, 256, 1024, 4096, 16384) for m in ("fp32", "bf16")],
    *[("darcy2d", b, m) for b in (16, 64, 256, 1024) for m in ("fp32", "bf16")],
    ("advection1d", 256, "graph"),
    ("advection1d", 1024, "graph"),
    ("advection1d", 4096, "graph"),
    ("darcy2d", 64, "graph"),
    ("advection1d", 1024, "compile_bf16"),
    ("advection1d", 4096, "compile_bf16"),
]
TOY = [("advection1d", 8, "fp32"), ("advection1d", 8, "bf16")]
"""What a CPU runs (at toy sizes), so that the code stays working where no GPU is."""


def _task(name: str, device: torch.device, toy: bool) -> tuple[TaskSpec, torch.Tensor]:
    """The task's spec and its random data on ``device``: advection [n, 201, x], Darcy [n, 2 (a, u), x, y]."""
    if name == "advection1d":
        grid, n = ((64,), 40) if toy else ((1024,), 10000)
        return TaskSpec(grid, 1, 1, 8, 10, True), torch.randn(n, 201 if not toy else 21, *grid, device=device)
    grid, n = ((16, 16), 16) if toy else ((128, 128), 10000)
    return TaskSpec(grid, 1, 1, 8, 1, False), torch.randn(n, 2, *grid, device=device)


def _gather(spec: TaskSpec, data: torch.Tensor, index: torch.Tensor, start: torch.Tensor):
    """A batch of (inputs, targets) windows gathered on the device."""
    if spec.autoregressive:
        frames = start[:, None] + torch.arange(spec.initial_step + 1, device=data.device)
        windows = data[index[:, None], frames]
        return windows[:, :-1, :, None], windows[:, -1, :, None]
    pairs = data[index]
    return pairs[:, 0, ..., None], pairs[:, 1, ..., None]


def measure(task: str, batch: int, mode: str, device: torch.device, steps: int = 40, warmup: int = 10) -> dict:
    """Step time and samples per second of one (task, batch, mode)."""
    torch.manual_seed(0)
    spec, data = _task(task, device, device.type == "cpu")
    model = FNO(spec, FNOConfig(modes=12, width=20)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=mode == "graph", foreach=True)
    forward = torch.compile(model) if mode.startswith("compile") else model
    bf16 = mode in ("bf16", "compile_bf16")
    g = torch.Generator(device=device).manual_seed(0)
    last = max(1, data.shape[1] - spec.initial_step) if spec.autoregressive else 1
    index = torch.randint(0, data.shape[0], (steps + warmup + 3, batch), device=device, generator=g)
    start = torch.randint(0, last, (steps + warmup + 3, batch), device=device, generator=g)

    def step(i: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x, y = _gather(spec, data, i, s)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            prediction = forward(x)
        loss = torch.nn.functional.mse_loss(prediction.float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=mode != "graph")
        return loss.detach()

    run = lambda k: step(index[k], start[k])  # noqa: E731
    if mode == "graph":
        fixed_index, fixed_start = index[0].clone(), start[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up on a side stream, as CUDA graph capture asks
                step(fixed_index, fixed_start)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fixed_loss = step(fixed_index, fixed_start)

        def run(k: int) -> torch.Tensor:
            fixed_index.copy_(index[k])
            fixed_start.copy_(start[k])
            graph.replay()
            return fixed_loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    began = time.perf_counter()
    for k in range(warmup):
        run(k)
    sync()
    warm_s = time.perf_counter() - began
    began = time.perf_counter()
    for k in range(warmup, warmup + steps):
        loss = run(k)
    sync()
    step_s = (time.perf_counter() - began) / steps
    row = {
        "task": task,
        "batch": batch,
        "mode": mode,
        "step_ms": round(step_s * 1e3, 3),
        "samples_per_s": round(batch / step_s),
        "warmup_s": round(warm_s, 1),
        "loss": float(loss),
    }
    if device.type == "cuda":
        row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        del model, optimizer, data
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


def ceiling(device: torch.device, budget_s: float = 150.0) -> list[dict]:
    """Every row of the plan (its toy version on a CPU) within ``budget_s``; a row left out says so."""
    rows, began = [], time.monotonic()
    for task, batch, mode in PLAN if device.type == "cuda" else TOY:
        if time.monotonic() - began > budget_s:
            rows.append({"task": task, "batch": batch, "mode": mode, "skipped": f"over the {budget_s:.0f} s budget"})
            continue
        try:
            rows.append(measure(task, batch, mode, device))
        except Exception as e:  # one row's failure (out of memory, a compile error) is that row's
            rows.append({"task": task, "batch": batch, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows
