"""BENCHMARKS, the table of ``make bench``: a row per benchmark, with what it measures, its wall time at its
default sizes on a 2-core CPU machine, the targets ``--strict`` holds it to and its own options.

A row names its module rather than importing it: reading the table (``--help``, the docs' check) costs no
torch. The module's ``run(out, workdir, quick=..., **options)`` measures, writes ``<module>.json`` and
``<module>.md`` under ``out`` and returns the figures with their ``targets`` (target -> met). A new benchmark
is its module and its row here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    """A benchmark's own command-line option: ``--name-with-dashes``, passed to ``run`` as ``name``."""

    name: str
    default: Any
    help: str


@dataclass(frozen=True)
class Benchmark:
    """One row: ``python -m train.bench <name>`` (``make bench BENCH_ARGS=<name>``)."""

    name: str
    """The subcommand."""
    module: str
    """``train.bench.<module>``: its ``run`` and the stem of the files it writes."""
    measures: str
    """What it measures, one line (the subcommand's help)."""
    budget: str
    """Its wall time at the default sizes on a 2-core CPU machine."""
    targets: tuple[str, ...]
    """What ``--strict`` fails on when missed, in words (the result's ``targets`` name each one)."""
    options: tuple[Option, ...] = ()
    """Its own options, with their defaults (``all`` runs it with these)."""
    quick: dict[str, Any] = field(default_factory=dict)
    """The options ``--quick`` sets, besides passing ``quick=True``."""
    in_all: bool = True
    """Whether ``all`` (the default command) runs it."""


LOG_EVERY = 10
"""The trainer's logging window in the step-time benchmarks: several in the timed steps, each costing little."""

BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "cache-io",
        "cache_io",
        "data loading: our mmap cache against per-sample h5py and shared memory",
        "about 4 minutes",
        (
            "mmap >= 10x per-sample h5py",
            "mmap within 10% of shared memory or faster",
            "no cache bytes in /dev/shm (peak under the in-flight batch bound)",
            "data memory <= 1.2x cache",
            "build >= 50% of raw read",
        ),
        (
            Option("cache_gb", 1.1, "size the data is scaled to"),
            Option("steps", 400, "timed steps per rank, loaders (a) and (c)"),
            Option("h5py_steps", 40, "timed steps per rank, loader (b)"),
            Option("warmup", 5, "untimed steps per rank first"),
        ),
        quick={"steps": 10, "h5py_steps": 4, "warmup": 1},
    ),
    Benchmark(
        "trainer",
        "trainer_step",
        "our trainer's step time against a bare DDP loop",
        "about 3.5 minutes",
        ("step time ratio <= 1.05",),
        (
            Option("steps", 150, "timed steps per launch"),
            Option("warmup", 20, f"untimed steps first (a multiple of --log-every, {LOG_EVERY})"),
            Option("repeats", 5, "launches of each loop, alternating"),
            Option("log_every", LOG_EVERY, "the trainer's logging window"),
        ),
        quick={"steps": 6, "warmup": 2, "repeats": 1, "log_every": 2},
    ),
    Benchmark(
        "compile",
        "compiled_step",
        "the whole step compiled against the eager step on a small, host-bound FNO (and, with --default-run, "
        "configs/default.yaml from the command to the report both ways)",
        "about 3 minutes (--default-run: about 9 more)",
        ("small FNO: compiled step >= 1.5x the eager step's speed",),
        (
            Option("steps", 300, "timed steps per launch"),
            Option("warmup", 60, "untimed steps first (compiling among them)"),
            Option("repeats", 3, "launches of each, alternating"),
            Option("default_run", False, "also configs/default.yaml both ways (tens of minutes)"),
        ),
        quick={"steps": 6, "warmup": 4, "repeats": 1},
    ),
    Benchmark(
        "models",
        "models",
        "each built-in model and training objective at the same time budget, on the default data and on generic "
        "arrays (a periodic 1D task): test nRMSE, the rollout's after 1-200 steps, the best named",
        "about 45 minutes (both data sets)",
        ("advection1d best test nRMSE <= 0.05", "darcy2d best test nRMSE <= 0.1"),
        (
            Option("budget_s", 150.0, "seconds of training per entry (about the training time of make train)"),
            Option("data", "both", "the data sets: default, own-data or both"),
        ),
    ),
    Benchmark(
        "remote",
        "remote",
        "the trainer's step time with and without a slow remote mirroring its checkpoints",
        "about 5 minutes",
        ("step time ratio with/without a slow remote <= 1.02",),
        (
            Option("steps", 150, "timed steps per launch"),
            Option("warmup", 20, f"untimed steps first (a multiple of {LOG_EVERY})"),
            Option("repeats", 3, "pairs of launches, alternating"),
            Option("rate_mb_s", 2.0, "upload speed of the remote"),
        ),
        quick={"steps": 20, "warmup": 4, "repeats": 1},
    ),
    Benchmark(
        "stream",
        "stream",
        "training streamed from a 50 MB/s store through a cache a quarter of the data, against local disk; The "
        "Well's files streamed as published",
        "about 7 minutes",
        (
            "streamed samples/s >= 90% of local disk",
            "bytes fetched per epoch <= 1.1x the data",
            "cache never above its limit",
            "time to first step of a 4x larger set within 25%",
            "the Well's files streamed as published: samples/s >= 90% of their repacked shards on local disk",
        ),
        (
            Option("samples", 1024, "trajectories of the data set"),
            Option("shard_mb", 2.0, "MB a shard"),
            Option("rate_mb_s", 50.0, "the store's bandwidth"),
            Option("epochs", 2, "epochs of one pass over the data"),
        ),
        quick={"samples": 256, "shard_mb": 0.5, "epochs": 1},
    ),
    Benchmark(
        "well",
        "well",
        "configs/well.yaml from nothing, timed: one-step VRMSE against repeating the last frame",
        "about 2 minutes",
        ("one-step VRMSE 3x better than repeating the last frame", "the whole run under 300 s"),
    ),
    Benchmark(
        "operators",
        "operators",
        "configs/fno-darcy.yaml, fno-burgers.yaml and pdearena-ns.yaml from nothing: test relative L2 against the "
        "baseline and beside the published FNO errors",
        "about 15 minutes",
        ("each config: test rel. L2 3x better than the baseline",),
    ),
    Benchmark(
        "finetune",
        "finetune",
        "the default advection model fine-tuned on another coefficient against training from scratch",
        "about 4 minutes",
        ("fine-tuning ends at least as low as training from scratch in the fewest steps",),
    ),
    Benchmark(
        "pretrain",
        "pretrain",
        "one multi-physics model on configs/pretrain.yaml's datasets against single-task models, then fine-tuned "
        "onto a held-out dataset against training from scratch",
        "about 25 minutes",
        ("fine-tuning reaches the from-scratch final error in at most a third of its steps",),
    ),
    Benchmark(
        "sweep",
        "sweep",
        "an 8-trial search over the FNO's width, modes and learning rate against the default config",
        "about 13 minutes",
        ("the best trial's validation nRMSE is at most the default's",),
    ),
    Benchmark(
        "parallel",
        "parallel",
        "ddp, fsdp and hsdp on 2 and 4 CPU ranks: model state per rank, step time, checkpoint write and load",
        "about 3.5 minutes",
        ("fsdp model state per rank <= 0.6x ddp's on 2 ranks", "fsdp model state per rank <= 0.35x ddp's on 4 ranks"),
    ),
    Benchmark(
        "transfer",
        "transfer",
        "the multi-physics model pretrained on a mix of physics, then fine-tuned against from scratch on two "
        "held-out shock datasets with 8 and 32 trajectories, 3 seeds, each arm at its best learning rate",
        "about 13 minutes",
        (
            "fine-tuned on 8 reaches scratch on 32 on every held-out dataset",
            "fine-tuned at most 0.7x scratch at equal data, beyond twice the seeds' std",
            "the mix within 1.2x of single-dataset models on at least half its datasets",
        ),
    ),
    Benchmark(
        "scale",
        "scale",
        "PDEBench-size data in a 4 GB memory cgroup: cache builds, footprint and the loader against the raw read",
        "about 10 minutes and 15 GB of disk",
        (
            "no OOM kill under 4 GB",
            "build RSS under 1 GB",
            "in-place build at least 70% of the raw read",
            "copying build at least 45% of the raw read",
            "cache at most 1.05x the data used",
            "no copy when the run reads a dataset whole",
        ),
        (Option("cfd_fraction", 0.1, "share of PDEBench's 10,000-sample (55 GB) 2D CFD file to write"),),
        in_all=False,
    ),
)
"""In the order ``all`` runs them: transfer last, since its runs share the benchmark's process."""

BY_NAME = {row.name: row for row in BENCHMARKS}
