"""What a user of one GPU compares, measured with the trainer itself (``make gpu-check GPU_CHECKS=perf``):

- ``sweep``: samples/s and GPU busy of configs/gpu.yaml's advection FNO across batch sizes (32 to 4,096), its
  data gathered on the device or read through the loader, eager, compiled (``default``) or graphed
  (``reduce-overhead``, CUDA graphs: one process, no DDP);
- ``against_bare``: the trainer against a bare loop holding the same data on the device (same model, batches,
  optimizer, loss, clipping and precision), alternated in this process: the ratio of their step times;
- ``no_sync``: 50 steady steps of the trainer under ``torch.cuda.set_sync_debug_mode("error")``: any operation
  that makes the host wait for the GPU inside a step raises;
- ``launches_per_step``: the GPU launches of one steady step from a profiler trace (graph replays, kernel
  launches, copies) and its kernel-level operations outside compiled graphs.

Each trainer run is the real :class:`~train.engine.trainer.Trainer` of one process (a process group of one),
its figures the metrics records it writes; the data is gpu.yaml's advection task at PDEBench's published size.
On a CPU the same code runs at toy sizes (tests keep it working).
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import yaml

from train.config import Config, load_config
from train.distributed.env import DistEnv, init_distributed
from train.run_dir import RunDir

REPO = Path(__file__).resolve().parents[3]
TASK = "advection1d"
BATCHES = (32, 128, 512, 1024, 4096)
TOY_BATCHES = (4, 8)
COMPILED = (("compiled", "default"), ("graphed", "reduce-overhead"))


def advection_config(out: Path, toy: bool) -> Path:
    """configs/gpu.yaml with its advection task alone (Darcy's 10,000 solves would take longer than the check);
    at toy size on a CPU."""
    config = yaml.safe_load((REPO / "configs" / "gpu.yaml").read_text())
    task = config["tasks"][TASK]
    if toy:
        task.update(n_samples=24, resolution=64, spatial_stride=1)
    config["tasks"] = {TASK: task}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "advection.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class GpuUtilisation:
    """nvidia-smi's utilisation.gpu sampled every 200 ms while a run trains."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.times: list[float] = []  # time.monotonic() of each sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                )
                self.samples.append(float(out.stdout.split()[0]))
                self.times.append(time.monotonic())
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return

    def __enter__(self) -> GpuUtilisation:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self) -> float | None:
        """Mean utilisation over the samples after the first nonzero one (start-up and compiling excluded)."""
        started = next((i for i, v in enumerate(self.samples) if v > 0), None)
        return None if started is None else sum(self.samples[started:]) / len(self.samples[started:])

    def busy_between(self, start: float, stop: float) -> float | None:
        """Mean utilisation of the samples taken between two ``time.monotonic()`` times."""
        inside = [v for t, v in zip(self.times, self.samples, strict=True) if start <= t <= stop]
        return sum(inside) / len(inside) if inside else None


class Records:
    """A metrics sink that keeps each record with the wall time it was written at."""

    def __init__(self) -> None:
        self.records: list[tuple[float, dict]] = []

    def write(self, record: dict) -> None:
        self.records.append((time.monotonic(), record))

    def close(self) -> None:
        pass

    def steady(self) -> list[tuple[float, dict]]:
        """The training windows after the first (which holds compiling and the first batches)."""
        return [(t, r) for t, r in self.records if "samples_per_s" in r][1:]


class Bench:
    """One process group of one on ``device``, the prepared data, and runs of the trainer or the bare loop."""

    def __init__(self, out: Path, device: torch.device):
        from train.data.acquire.sources import stage_data
        from train.pipeline import stage_cache

        if device.type == "cuda" and device.index is None:  # NCCL's device_id must name its GPU
            device = torch.device("cuda", torch.cuda.current_device())
        self.out, self.device, self.toy = out, device, device.type != "cuda"
        self.config = advection_config(out, self.toy)
        self.folders_overrides = [f"run.{d}_dir={out / d}" for d in ("data", "cache", "runs")]
        cfg = self.cfg("prepare", [])
        self.folders = stage_cache(cfg, stage_data(cfg))
        self.owns_group = not dist.is_initialized()
        self.env = init_distributed(DistEnv(0, 0, 1, 1, "nccl" if device.type == "cuda" else "gloo", device), 300)

    def close(self) -> None:
        """Leave the process group this bench made (a later Bench in the process makes its own)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def cfg(self, name: str, overrides: list[str]) -> Config:
        return load_config(self.config, [*self.folders_overrides, *overrides], run_name=name)

    def run_dir(self, cfg: Config) -> RunDir:
        run = RunDir.of(cfg)
        shutil.rmtree(run.root, ignore_errors=True)
        run.prepare(cfg)
        run.write_inputs(self.folders)
        return run

    def settings(self, batch: int, steps: int, *, on_device: bool, mode: str | None, objective: str) -> list[str]:
        log_every = max(1, steps // 4)
        compiled = [f"compile.mode={mode}"] if mode else ["compile.enabled=false"]
        return [
            f"tasks.{TASK}.batch_size={batch}",
            "train.epochs=1",
            f"train.steps_per_epoch={steps + log_every}",
            f"train.log_every={log_every}",
            "train.val_every=1000000",
            "train.checkpoint_every=null",
            f"train.data_on_device={str(on_device).lower()}",
            f"train.objective={objective}",
            *compiled,
            *(["train.precision=fp32"] if self.toy else []),
        ]

    def trainer(self, name: str, overrides: list[str], during=None) -> dict:
        """One fit of the trainer; samples/s, step time and data wait of its steady windows, GPU busy then."""
        from train.engine.trainer import Trainer

        cfg = self.cfg(name, overrides)
        run = self.run_dir(cfg)
        records = Records()
        trainer = Trainer(cfg, self.env, run.load_tasks(cfg), run)
        if during is not None:
            during(trainer)
        with GpuUtilisation() if self.device.type == "cuda" else contextlib.nullcontext() as gpu:
            trainer.fit(records)
        steady = records.steady()
        del trainer
        self._free()
        if not steady:
            raise RuntimeError(f"{name}: no steady metrics window (raise the steps)")
        began = steady[0][0] - steady[0][1]["step_time_s"] * cfg.train.log_every
        return {
            "samples_per_s": statistics.median(r["samples_per_s"] for _, r in steady),
            "step_ms": 1e3 * statistics.median(r["step_time_s"] for _, r in steady),
            "data_wait": statistics.fmean(r["data_wait"] for _, r in steady),
            "gpu_busy_pct": gpu.busy_between(began, steady[-1][0]) if gpu is not None else None,
        }

    def bare(self, overrides: list[str], steps: int, strategy: str | None = None, losses: bool = False) -> dict:
        """The bare loop over the same model, batches (the trainer's sampler), optimizer, loss and precision;
        ``strategy``: the model spread by that row of the strategy table (FSDP2 over this process group) before
        compiling, as the trainer does; ``losses``: every step's loss in the result."""
        from train.data.dataset import EqualBatchSampler
        from train.data.device_data import DeviceTask
        from train.engine.loaders import initial_model, task_dataset
        from train.engine.loss import task_loss
        from train.engine.optim import build_optimizer
        from train.engine.setup import compile_model, resolve_precision

        cfg = self.cfg("bare", overrides)
        run = self.run_dir(cfg)
        (task,) = run.load_tasks(cfg)
        model = initial_model(cfg, [task], self.device)
        precision = resolve_precision(cfg.train.precision, self.device)
        if strategy is not None:
            from train.engine.parallel import PARALLEL

            model = PARALLEL[strategy].wrap(model, model, self.env, cfg, False, precision)
        forward = compile_model(model, cfg.compile, self.env)
        optimizer, scheduler = build_optimizer(model.parameters(), cfg.train, 10 * steps)
        data = DeviceTask(task_dataset(task), self.device)
        warmup, batch = cfg.train.log_every, cfg.tasks[TASK].batch_size
        sampler = EqualBatchSampler(len(task_dataset(task)), batch, warmup + steps, 0, 1, cfg.run.seed, 0)
        rows = torch.as_tensor(list(sampler), device=self.device)
        graphed = cfg.compile.enabled is not False and cfg.compile.mode == "reduce-overhead"
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        began, seen = 0.0, []
        for step in range(warmup + steps):
            if step == warmup:
                sync()
                began = time.perf_counter()
            if graphed and self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            b = data.gather(rows[step])
            with precision.autocast():
                prediction = forward({TASK: b["x"]})[TASK]
            loss = task_loss(prediction, b["y"])
            loss.backward()
            if losses:
                seen.append(loss.detach())  # read once after the loop: no sync inside it
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        sync()
        step_s = (time.perf_counter() - began) / steps
        result = {"samples_per_s": batch / step_s, "step_ms": 1e3 * step_s}
        if losses:
            result["losses"] = torch.stack(seen).tolist()
        del model, forward, optimizer, data, seen
        self._free()
        return result

    def _free(self) -> None:
        torch._dynamo.reset()  # the next model is a new one: nothing of this one's graphs is reused
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def sweep(bench: Bench, budget_s: float, batch: int) -> list[dict]:
    """samples/s and GPU busy per batch size, in order of what matters most when the budget runs out: data on the
    device eagerly at every batch size, graphed and compiled at ``batch`` (gpu.yaml's), the loader at every batch
    size, then graphed and compiled at the other large batches."""
    batches = TOY_BATCHES if bench.toy else BATCHES
    plan = [(b, True, None) for b in batches]
    plan += [(batch, True, mode) for mode in COMPILED] if not bench.toy else []
    plan += [(b, False, None) for b in batches]
    plan += [(b, True, mode) for b in batches[-3:] if b != batch for mode in COMPILED] if not bench.toy else []
    rows, began = [], time.monotonic()
    steps = 8 if bench.toy else 200
    for batch, on_device, mode in plan:
        name = mode[0] if mode else "eager"
        row = {"batch": batch, "data": "device" if on_device else "loader", "mode": name}
        if time.monotonic() - began > budget_s:
            rows.append({**row, "skipped": f"over the {budget_s:.0f} s budget"})
            continue
        settings = bench.settings(
            batch, steps, on_device=on_device, mode=mode[1] if mode else None, objective="pushforward"
        )
        try:
            rows.append({**row, **bench.trainer(f"sweep-{name}-{row['data']}-{batch}", settings)})
        except Exception as e:  # one row's failure (out of memory, a compile error) is that row's
            rows.append({**row, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def against_bare(bench: Bench, batch: int, mode: str | None, repeats: int = 2) -> dict:
    """The trainer and the bare loop alternately (one_step: the bare loop has no rollouts), data on the device."""
    steps = 8 if bench.toy else 300
    settings = bench.settings(batch, steps, on_device=True, mode=mode, objective="one_step")
    pairs = []
    for i in range(repeats):
        ours = bench.trainer(f"against-bare-{i}", settings)
        bare = bench.bare(settings, steps)
        pairs.append({"trainer": ours, "bare": bare, "ratio": ours["step_ms"] / bare["step_ms"]})
    return {
        "batch": batch,
        "mode": mode or "eager",
        "ratio": statistics.median(p["ratio"] for p in pairs),
        "repeats": pairs,
    }


def no_sync(bench: Bench, batch: int, mode: str | None, checked: int = 50, warmup: int = 20) -> dict:
    """``checked`` steady steps of the trainer (log_every beyond them) with any host-device sync an error."""
    settings = bench.settings(batch, warmup + checked + 10, on_device=True, mode=mode, objective="pushforward")
    settings += [f"train.log_every={warmup + checked + 10}"]
    seen = {"steps": 0, "checked": 0}

    def arm(trainer) -> None:
        step = trainer.train_step

        def counted(streams):
            if seen["steps"] == warmup and bench.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                return step(streams)
            finally:
                seen["steps"] += 1
                if warmup < seen["steps"] <= warmup + checked:
                    seen["checked"] += 1
                if seen["steps"] == warmup + checked and bench.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)

        trainer.train_step = counted

    try:
        bench.trainer("no-sync", settings, during=arm)
    except RuntimeError as e:
        if bench.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        return {"passed": False, "steps_checked": seen["checked"], "error": str(e)[:1500]}
    return {
        "passed": seen["checked"] == checked,
        "steps_checked": seen["checked"],
        "batch": batch,
        "mode": mode or "eager",
        "checked_on": str(bench.device),
    }


def launches_per_step(bench: Bench, batch: int, mode: str | None, warmup: int = 20) -> dict:
    """The GPU launches of one steady step (graph replays, kernels, copies) and its kernel-level operations
    outside compiled graphs, from a profiler trace of the trainer's step ``warmup + 1``, pushforward, data on the
    device. Target with the whole step graphed: at most 1 graph launch plus 10 other launches."""
    from torch.profiler import ProfilerActivity, profile

    from train.engine.compile_report import launches, ops_outside_graphs

    settings = bench.settings(batch, warmup + 10, on_device=True, mode=mode, objective="pushforward")
    seen: dict = {"steps": 0}

    def arm(trainer) -> None:
        step = trainer.train_step

        def traced(streams):
            seen["steps"] += 1
            if seen["steps"] != warmup + 1:
                return step(streams)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                out = step(streams)
                if bench.device.type == "cuda":
                    torch.cuda.synchronize()
            events = prof.events()
            seen.update(launches(events), ops_outside_graphs=ops_outside_graphs(events))
            return out

        trainer.train_step = traced

    bench.trainer("launches", settings, during=arm)
    counts = {k: seen.get(k) for k in ("graph", "kernel", "copy", "ops_outside_graphs")}
    other = (counts["kernel"] or 0) + (counts["copy"] or 0)
    return {
        "batch": batch,
        "mode": mode or "eager",
        **counts,
        "target_met": bench.device.type == "cuda" and (counts["graph"] or 0) <= 1 and other <= 10,
    }


def best(rows: list[dict], **match) -> dict | None:
    """The row with the most samples/s among those matching ``match``."""
    found = [r for r in rows if "samples_per_s" in r and all(r.get(k) == v for k, v in match.items())]
    return max(found, key=lambda r: r["samples_per_s"], default=None)
