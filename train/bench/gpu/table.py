"""CHECKS, the table of ``make gpu-check``: a row per check, with what it measures, its time on an H200 and
its targets; ``default`` rows run when none is named, in the table's order (the measurements first: on a machine
lent for minutes, what only a GPU can measure comes before the checks an earlier GPU already passed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuCheck:
    """One row: ``make gpu-check GPU_CHECKS=<name>``."""

    name: str
    """The check's name on the command line and of its record, ``runs/gpu-check/<name>.json``."""
    check: str
    """Its function in checks.py (``check_<name>``)."""
    measures: str
    """What it measures or checks, one line."""
    budget: str
    """Its time on one H200 (data generation aside)."""
    targets: tuple[str, ...] = ()
    """Targets its record reports beside ``passed`` (which fails the command)."""
    default: bool = True
    """Whether it runs when no check is named."""


CHECKS: tuple[GpuCheck, ...] = (
    GpuCheck(
        "perf",
        "check_perf",
        "configs/gpu.yaml's advection task: GPU launches of one graphed step; samples/s and GPU busy across batch "
        "sizes, data on the device or through the loader, eager, compiled or graphed; the trainer against a bare "
        "loop; neuraloperator's own Trainer on the same data",
        "about 3 minutes (GPU_CHECK_SWEEP_S bounds the sweep)",
        (
            "at most 1 graph launch + 10 other launches per steady step",
            "samples/s >= 10 x 2863",
            "trainer/bare <= 1.05",
            "more samples/s than the peer at equal batch",
        ),
    ),
    GpuCheck(
        "no_sync",
        "check_no_sync",
        '50 steady trainer steps under torch.cuda.set_sync_debug_mode("error")',
        "about 20 s",
    ),
    GpuCheck(
        "accuracy",
        "check_accuracy",
        "the advection task trained for GPU_CHECK_TRAIN_S seconds (180): test nRMSE beside PDEBench's FNO, "
        "validation nRMSE against training time, GPU busy and data wait",
        "about 4 minutes",
        ("test nRMSE <= 1e-2 within 5 minutes", "GPU busy >= 80%", "data wait <= 2%"),
    ),
    GpuCheck(
        "fsdp",
        "check_fsdp",
        "the FNO sharded by FSDP2 against the plain model: fp32 losses step by step, bf16 compiled",
        "about 13 s",
    ),
    GpuCheck(
        "smoke", "check_smoke", "the smoke test: collectives on NCCL, DDP steps, checkpoint, torch.compile", "1 min"
    ),
    GpuCheck(
        "fno_bf16", "check_fno_bf16", "the FNO's spectral layers under bf16 autocast against fp32", "a few seconds"
    ),
    GpuCheck(
        "resume",
        "check_resume",
        "a run SIGKILLed after a checkpoint and resumed ends bitwise equal to an uninterrupted one",
        "about 2 minutes",
    ),
    GpuCheck(
        "fno_compile",
        "check_fno_compile",
        "the default FNO compiled and eager, bf16: final losses close, graphs compiled",
        "about 3 minutes",
        default=False,
    ),
    GpuCheck(
        "unet_syncbn",
        "check_unet_syncbn",
        "the U-Net, batch normalisation synchronous with two GPUs or more",
        "about 1 minute",
        default=False,
    ),
    GpuCheck(
        "speed",
        "check_speed",
        "the default config and the published-size file through the loader (the figures before data on the device)",
        "about 5 minutes",
        default=False,
    ),
    GpuCheck(
        "ceiling",
        "check_ceiling",
        "the FNO's bare step on random data on the device, eager, bf16, graphed and compiled",
        "about 2 minutes",
        default=False,
    ),
    GpuCheck(
        "transfer",
        "check_transfer",
        "the data-efficiency benchmark (make bench BENCH_ARGS=transfer) with a trunk of about 5M parameters",
        "over 15 minutes",
        default=False,
    ),
)

BY_NAME = {row.name: row for row in CHECKS}
DEFAULT = tuple(row.name for row in CHECKS if row.default)
