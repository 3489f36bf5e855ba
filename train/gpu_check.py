"""``python -m train.gpu_check`` (``make gpu-check``): what only a GPU can show, in a few minutes on one GPU.

Each check prints one PASS/FAIL line and writes a JSON record under ``runs/gpu-check/``:

- ``smoke``: the smoke test (collectives on NCCL, DDP steps against one process, checkpoint, torch.compile);
- ``fno_bf16``: the FNO's spectral layers under bf16 autocast against fp32 (the FFTs must run in fp32);
- ``fno_compile``: the default FNO trained with bf16 autocast, compiled and eager: final losses close;
- ``unet_syncbn``: the U-Net with batch normalisation made synchronous, trained on two ranks of one GPU;
- ``resume``: a run SIGKILLed after a checkpoint and resumed ends bitwise equal to an uninterrupted one;
- ``speed``: step time, GPU utilisation, data wait and peak GPU memory of the default config and of the scale
  benchmark's published-size advection file (10,000 x 201 x 1024, 8.2 GB, mapped in place);
- ``ceiling``: the default FNOs' step with their data already on the GPU (train.bench.gpu_ceiling), the ceiling
  the trainer's figures are measured against.

Without a CUDA device it says so and exits 0 having run nothing. Exit 1 when a check fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

OUT = Path("runs/gpu-check")
TRAIN = [sys.executable, "-m", "train"]


def _folders(name: str) -> list[str]:
    root = (OUT / name).resolve()
    return [f"--set=run.{d}_dir={root / d}" for d in ("data", "cache", "runs")]


def _run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    print("  $", " ".join(argv), flush=True)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _metrics(name: str, run: str) -> list[dict]:
    path = OUT / name / "runs" / run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-2000:]


class GpuUtilisation:
    """nvidia-smi's utilisation.gpu sampled every 200 ms while a run trains."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True, text=True, timeout=5,
                )  # fmt: skip
                self.samples.append(float(out.stdout.split()[0]))
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


def check_smoke() -> dict:
    proc = _run([*TRAIN, "smoke", "--config", "configs/default.yaml", "--nproc", "1", *_folders("smoke")])
    return {"passed": proc.returncode == 0, "exit": proc.returncode, "tail": _tail(proc)[-600:]}


def check_fno_bf16() -> dict:
    import torch

    from train.config import FNOConfig
    from train.model.fno import FNO
    from train.model.specs import TaskSpec

    torch.manual_seed(0)
    model = FNO(TaskSpec((1024,), 1, 1, 8, 10, True), FNOConfig(modes=12, width=20)).cuda()
    x = torch.randn(32, 10, 1024, 1, device="cuda")
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = model(x)
    error = ((low.float() - ref).norm() / ref.norm()).item()
    return {"passed": error < 2e-2, "relative_error_bf16_vs_fp32": error, "dtype": str(low.dtype)}


BASE = ["--config", "configs/default.yaml", "--nproc", "1", "--set=tasks.darcy2d.n_samples=200"]
SHORT = ["--set=train.epochs=1", "--set=train.steps_per_epoch=200", "--set=train.log_every=10"]


def check_fno_compile() -> dict:
    losses, graphs = {}, 0
    for mode in ("compiled", "eager"):
        flags = [f"--set=compile.enabled={str(mode == 'compiled').lower()}", "--set=train.precision=bf16"]
        proc = _run([*TRAIN, "fit", *BASE, *SHORT, *flags, "--run", mode, *_folders("fno_compile")], timeout=400)
        if proc.returncode != 0:
            return {"passed": False, "mode": mode, "exit": proc.returncode, "tail": _tail(proc)}
        records = [r for r in _metrics("fno_compile", mode) if "loss" in r]
        losses[mode] = sum(r["loss"] for r in records[-5:]) / len(records[-5:])
        if mode == "compiled":  # the trainer's log line: compiling really happened, no silent eager fallback
            found = re.search(r"torch\.compile: (\d+) graph\(s\) compiled", proc.stdout + proc.stderr)
            graphs = int(found.group(1)) if found else 0
    gap = abs(losses["compiled"] - losses["eager"]) / losses["eager"]
    return {"passed": gap < 0.2 and graphs > 0, "final_loss": losses, "relative_gap": gap, "compiled_graphs": graphs}


def check_unet_syncbn() -> dict:
    """Batch normalisation is made synchronous with more than one rank, and NCCL puts one rank per GPU: on a
    one-GPU machine the U-Net trains with plain batch normalisation, and the record says so."""
    import torch

    nproc = min(2, torch.cuda.device_count())
    argv = [*TRAIN, "fit", *BASE, "--nproc", str(nproc), "--set=model.name=unet", *SHORT, "--run", "unet"]
    proc = _run([*argv, "--set=train.steps_per_epoch=40", *_folders("unet_syncbn")], timeout=300)
    losses = [r["loss"] for r in _metrics("unet_syncbn", "unet") if "loss" in r]
    return {
        "passed": proc.returncode == 0 and bool(losses) and all(map(math.isfinite, losses)),
        "ranks": nproc,
        "sync_batchnorm": nproc > 1,
        "loss_first_last": [losses[0], losses[-1]] if losses else None,
        "tail": _tail(proc)[-800:],
    }


def check_resume() -> dict:
    steps = ["--set=train.epochs=2", "--set=train.steps_per_epoch=60", "--set=train.checkpoint_every=20"]
    common = [*TRAIN, "fit", *BASE, *steps, "--set=compile.enabled=false", "--set=train.log_every=1"]
    ref = _run([*common, "--run", "reference", *_folders("resume")])
    if ref.returncode != 0:
        return {"passed": False, "stage": "reference", "tail": _tail(ref)}
    folders = _folders("resume")
    proc = subprocess.Popen([*common, "--run", "killed", *folders], start_new_session=True, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(r.get("step", 0) >= 50 for r in _metrics("resume", "killed")):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = _run([*common, "--run", "killed", *folders])
    if resumed.returncode != 0:
        return {"passed": False, "stage": "resume", "tail": _tail(resumed)}
    import torch

    from train.checkpoint import latest_checkpoint, load_checkpoint

    def weights(run: str) -> dict:
        return load_checkpoint(latest_checkpoint(OUT / "resume" / "runs" / run / "checkpoints"))["model"]

    a, b = weights("reference"), weights("killed")
    different = [k for k in a if not torch.equal(a[k].cpu(), b[k].cpu())]
    return {"passed": not different, "different": different[:10], "compared": len(a)}


def _speed(name: str, argv: list[str]) -> dict:
    with GpuUtilisation() as gpu:
        proc = _run([*TRAIN, "run", *argv, "--run", name, *_folders("speed")], timeout=480)
    records = [r for r in _metrics("speed", name) if "loss" in r][1:]  # the first window holds compiling
    if proc.returncode != 0 or not records:
        return {"passed": False, "exit": proc.returncode, "tail": _tail(proc)}
    return {
        "passed": True,
        "samples_per_s": sum(r["samples_per_s"] for r in records) / len(records),
        "data_wait": sum(r["data_wait"] for r in records) / len(records),
        "peak_gpu_mem_mib": max(r.get("gpu_mem_mib", 0.0) for r in records),
        "gpu_utilisation_pct": gpu.busy(),
        "logged_windows": len(records),
    }


def advection_config(path: Path) -> Path:
    """The default config's advection task alone, at PDEBench's published size: 10,000 x 201 x 1024 float32
    (8.2 GB), unstrided, so its cache maps the file in place."""
    import yaml

    config = yaml.safe_load(Path("configs/default.yaml").read_text())
    task = config["tasks"]["advection1d"]
    task.update(n_samples=10000, resolution=1024, temporal_stride=1, batch_size=64)
    config["tasks"] = {"advection1d": task}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def check_speed() -> dict:
    default = _speed("default", [*BASE, *SHORT, "--set=train.steps_per_epoch=300"])
    config = advection_config(OUT / "speed" / "advection_8gb.yaml")
    scale = _speed(
        "advection_8gb", ["--config", str(config), "--nproc", "1", *SHORT, "--set=train.steps_per_epoch=300"]
    )
    return {"passed": default["passed"] and scale["passed"], "default": default, "advection_8gb": scale}


def check_ceiling() -> dict:
    import torch

    from train.bench.gpu_ceiling import ceiling

    rows = ceiling(torch.device("cuda"))
    measured = [r for r in rows if "samples_per_s" in r and r["task"] == "advection1d"]
    best = max(measured, key=lambda r: r["samples_per_s"], default=None)
    return {"passed": not any("error" in r for r in rows), "best_advection1d": best, "rows": rows}


CHECKS = {
    "smoke": check_smoke,
    "fno_bf16": check_fno_bf16,
    "fno_compile": check_fno_compile,
    "unet_syncbn": check_unet_syncbn,
    "resume": check_resume,
    "speed": check_speed,
    "ceiling": check_ceiling,
}


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing was run")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    names = argv or list(CHECKS)
    device = torch.cuda.get_device_name(0)
    print(f"gpu-check on {device}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    failed = []
    for name in names:
        start = time.perf_counter()
        try:
            record = CHECKS[name]()
        except Exception as e:  # one check's crash is its FAIL line, not the end of the others
            record = {"passed": False, "error": f"{type(e).__name__}: {e}"}
        record.update(check=name, device=device, seconds=round(time.perf_counter() - start, 1))
        (OUT / f"{name}.json").write_text(json.dumps(record, indent=2))
        shown = {k: v for k, v in record.items() if k not in ("tail", "check", "device", "passed")}
        print(f"{'PASS' if record['passed'] else 'FAIL'} {name}: {json.dumps(shown)[:1500]}", flush=True)
        if not record["passed"]:
            failed.append(name)
    print(f"gpu-check: {len(names) - len(failed)}/{len(names)} passed; records in {OUT}/", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
