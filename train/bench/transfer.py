"""Data-efficiency benchmark: does pretraining on a mix of physics buy a model of a new system from few
trajectories? The multi-physics model pretrained on smooth 2D compressible flow, incompressible smoke and 1D
Burgers shocks, then fine-tuned onto two held-out datasets of shocks it never saw: 2D and 1D Riemann problems of
the Euler equations (train.data.acquire.generate_euler).

1. **pretrain**: one model on the mix (``MIX``; the held-out datasets named in ``train.held_out``), and for each
   dataset of the mix a single-task model of the same settings and the same total steps;
2. **downstream**: for each held-out dataset, each training size of ``SIZES`` trajectories (the first of a fixed
   pool of 64, shuffled by the seed: a size's set holds the smaller sizes' sets) and each seed of ``SEEDS``, two
   arms: from scratch and fine-tuned (``train.init_from`` the pretrained run, ``RECIPE``), each at every
   learning rate of ``LRS``; an arm's figure is its test error at the learning rate its validation error chose.
   Validation (16 trajectories) and test (48) are fixed files, the same for every run;
3. the zero-shot error: the pretrained model on the held-out test set before any fine-tuning.

Errors are the headline test nRMSE (over the fields that change; docs/data-formats.md, 'Metrics') of whole
rollouts from the first ``initial_step`` frames. Every run is the trainer itself in this process, as rank 0 of a
group of one (the launcher's data and cache stages, run folder and init_from record as a launch makes them).

Targets, over both held-out datasets and the seeds: fine-tuned on the smallest size reaches scratch's error on the
largest (4x data efficiency at 8 and 32); at equal data fine-tuned is at most 0.7x scratch, the difference larger
than twice the seeds' standard deviation; the mix within 1.2x of the single-dataset models on at least half of
its datasets.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import statistics
import time
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import yaml

from train.bench import machine_figures, save_result
from train.checkpoint import MODEL, checkpoint_for_evaluation, load_checkpoint, load_model_state
from train.config import Config, load_config
from train.data.acquire import generate
from train.data.acquire.sources import stage_data
from train.distributed.env import DistEnv, init_distributed
from train.engine.evaluate import evaluate_split
from train.engine.init_from import load_initial_weights
from train.engine.loaders import initial_model
from train.engine.trainer import Trainer
from train.obs.report import headline
from train.pipeline import stage_cache
from train.remote.fetch import resolve_initial_weights
from train.run_dir import RunDir

log = logging.getLogger(__name__)

MODEL_SETTINGS = {"d_model": 64, "n_heads": 4, "n_layers": 3, "mlp_ratio": 2, "field_width": 16, "output": "increment"}
GPU_MODEL = {"d_model": 256, "n_heads": 8, "n_layers": 6, "mlp_ratio": 2, "field_width": 32, "output": "increment"}
"""The GPU protocol's trunk (about 5M parameters): ``make gpu-check GPU_CHECKS=transfer``."""
GPU = {"model": GPU_MODEL, "pretrain": {"epochs": 8, "steps_per_epoch": 500, "warmup_steps": 200, "lr": 5e-4}}
"""The GPU protocol: the same data, runs and seeds, the larger trunk pretrained longer at a lower rate."""
INITIAL_STEP = 4
MIX = {
    "euler2d": {
        "pde": "euler2d",
        "source": "generate",
        "n_samples": 128,
        "resolution": 32,
        "coefficient": 0.0,
        "initial_step": 4,
        "patch_size": 4,
        "batch_size": 4,
    },
    "euler1d": {
        "pde": "euler1d",
        "source": "generate",
        "n_samples": 256,
        "resolution": 128,
        "coefficient": 0.0,
        "initial_step": 4,
        "patch_size": 8,
        "batch_size": 16,
    },
    "smoke": {
        "pde": "pdearena_ns",
        "source": "generate",
        "n_samples": 96,
        "resolution": 32,
        "initial_step": 4,
        "patch_size": 4,
        "batch_size": 4,
        "fields": ["smoke_density", "velocity_x", "velocity_y"],
    },
    "burgers": {
        "pde": "burgers1d",
        "source": "generate",
        "n_samples": 256,
        "resolution": 128,
        "coefficient": 0.01,
        "temporal_stride": 10,
        "initial_step": 4,
        "patch_size": 8,
        "batch_size": 16,
        "fields": ["velocity_x"],
    },
}
"""The pretraining mix: about 1,024 tokens per micro-batch each (batch x 4 frames x patches). The Euler data
starts smooth only (the coefficient is the chance of a Riemann state): shocks are the held-out physics."""
HELD_OUT = {
    "riemann2d": {"pde": "euler2d", "resolution": 32, "patch_size": 4, "batch_size": 4},
    "riemann1d": {"pde": "euler1d", "resolution": 128, "patch_size": 8, "batch_size": 16},
}
POOL = {"train": (64, 101), "val": (16, 102), "test": (48, 103)}
"""Each held-out dataset's files: split -> (trajectories, generator seed); every one a Riemann problem."""
SIZES = (8, 32)
SEEDS = (0, 1, 2)
LRS = (1e-3, 3e-3)
"""The learning rates each arm tries, on the first seed's validation split (per dataset, size and arm); the other
seeds train at the rate it chose."""
PRETRAIN = {"epochs": 4, "steps_per_epoch": 400, "warmup_steps": 100, "lr": 1e-3}
DOWNSTREAM = {
    "epochs": 5,
    "steps_per_epoch": 40,
    "warmup_steps": 20,
    "objective": "pushforward",
    "early_stop_patience": 2,
}
"""Each downstream run: at most 200 steps by pushforward (robust rollouts), validated every 40, stopped after two
validations without improvement; scored at its best validation (best.pt)."""
RECIPE: dict = {}
"""The fine-tuned arm's recipe: every weight of the pretrained model at the arm's learning rate (what the variants
below lost to)."""
VARIANTS = {"trunk 0.1x": {"lr_groups": {"trunk": 0.1}}, "output rows zeroed": {"init_reset": {"field_out": "zero"}}}
"""Fine-tuning recipes tried against RECIPE on the smallest size, first seed, at the rate the fine-tuned arm chose."""
QUICK = {
    "mix": {"burgers": {"n_samples": 32}, "euler2d": {"n_samples": 16, "resolution": 16}},
    "held_out": ("riemann1d",),
    "pool": {"train": (8, 101), "val": (4, 102), "test": (8, 103)},
    "sizes": (2, 8),
    "seeds": (0, 1),
    "lrs": (1e-3,),
    "pretrain": {"epochs": 1, "steps_per_epoch": 8, "warmup_steps": 2},
    "downstream": {"epochs": 1, "steps_per_epoch": 4, "warmup_steps": 1},
    "model": {"d_model": 32, "n_heads": 2, "n_layers": 1, "mlp_ratio": 2, "field_width": 8, "output": "increment"},
}


class Sink:
    """A metrics sink that keeps the trainer's records (the benchmark reads none but keeps the run quiet)."""

    def __init__(self):
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def write_subset(pool: Path, path: Path, rows: np.ndarray) -> None:
    """A PDEBench file holding the trajectories ``rows`` of ``pool`` (every per-sample array sliced, coordinates
    and attributes copied), written under a temporary name first."""
    tmp = path.with_name(path.name + ".partial")
    with h5py.File(pool, "r") as src, h5py.File(tmp, "w") as dst:
        n = src["density"].shape[0]
        for key, data in src.items():
            dst[key] = data[np.sort(rows)] if data.ndim > 1 and data.shape[0] == n else data[()]
    os.replace(tmp, path)


class Harness:
    """The benchmark's runs: configs, data, the trainer and evaluation, in one process group of one."""

    def __init__(self, root: Path, model: dict, device: str = "cpu"):
        self.root, self.model = root, model
        self.owns_group = not dist.is_initialized()
        self.environ = dict(os.environ)  # put back on close: later benchmarks launch ranks of their own
        if self.owns_group:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                LOCAL_WORLD_SIZE="1",
            )
        self.device = torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.env = init_distributed(DistEnv(0, 0, 1, 1, backend, self.device), 300)
        self.walls: dict[str, float] = {}

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(self.environ)

    def config(self, name: str, tasks: dict, train: dict, seed: int = 0) -> Config:
        tree = {
            "tasks": tasks,
            "model": {"name": "multiphysics", "multiphysics": self.model},
            "train": {
                "task_sampling": "weighted",
                "log_every": 1000,
                "eval_batch_size": 16,
                "precision": "fp32" if self.device.type == "cpu" else "auto",
                "resume": "never",
                **train,
            },
            "compile": {"enabled": False},
            "run": {"name": name, "seed": seed, **{f"{d}_dir": str(self.root / d) for d in ("data", "cache", "runs")}},
        }
        path = self.root / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        return load_config(path)

    def prepare(self, cfg: Config) -> RunDir:
        """The launcher's stages before the ranks: data, caches, the run folder and its inputs."""
        sources = stage_data(cfg)
        folders = stage_cache(cfg, sources)
        run = RunDir.of(cfg)
        shutil.rmtree(run.root, ignore_errors=True)
        run.prepare(cfg)
        run.write_inputs(folders, {n: f.provenance for n, f in sources.items()}, resolve_initial_weights(cfg))
        return run

    def fit(self, cfg: Config) -> dict[str, dict[str, dict]]:
        """Train a run, then score its best checkpoint: split -> task -> scores (val and test)."""
        began = time.perf_counter()
        run = self.prepare(cfg)
        tasks = run.load_tasks(cfg)
        Trainer(cfg, self.env, tasks, run).fit(Sink())
        gc.collect()  # the trainer's reducer freed while the group lives (train/worker.py)
        model = initial_model(cfg, tasks, self.env.device)
        path = checkpoint_for_evaluation(run.checkpoints)
        load_model_state(model, load_checkpoint(path)[MODEL], path)
        scores = {s: evaluate_split(model, tasks, self.env, s, cfg.train.eval_batch_size) for s in ("val", "test")}
        self.walls[cfg.run.name] = time.perf_counter() - began
        log.info("%s: %.0f s", cfg.run.name, self.walls[cfg.run.name])
        return scores

    def zero_shot(self, cfg: Config) -> dict[str, dict]:
        """The init_from source's weights on ``cfg``'s tasks, untrained: the test scores."""
        run = self.prepare(cfg)
        tasks = run.load_tasks(cfg)
        model = initial_model(cfg, tasks, self.env.device)
        load_initial_weights(model, cfg, run.weights_from())
        return evaluate_split(model, tasks, self.env, "test", cfg.train.eval_batch_size)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_out_files(root: Path, name: str, spec: dict, pool: dict, sizes, seeds) -> Path:
    """The held-out dataset's folder: its val and test files and a train file per (size, seed), generated once
    (later runs of the benchmark find them)."""
    folder = root / "held_out" / name
    folder.mkdir(parents=True, exist_ok=True)
    for split, (n, seed) in pool.items():
        path = folder / f"pool_{split}.h5"
        want = {"n_samples": n, "resolution": spec["resolution"], "coefficient": 1.0, "seed": seed}
        if generate.generator_params(path) != {**want, "pde": spec["pde"], "version": generate.VERSION}:
            generate.generate(spec["pde"], path, **want)
        if split != "train":
            target = folder / f"{name}_{split}.h5"
            if not target.exists():
                os.link(path, target)
    for seed in seeds:
        order = np.random.default_rng(seed).permutation(pool["train"][0])
        for size in sizes:
            path = folder / f"n{size}-s{seed}" / f"{name}_train.h5"
            path.parent.mkdir(exist_ok=True)
            write_subset(folder / "pool_train.h5", path, order[:size])
    return folder


def _task(name: str, spec: dict, folder: Path, size: int, seed: int) -> dict:
    task = {k: v for k, v in spec.items() if k != "resolution"}
    return {
        **task,
        "source": str(folder),
        # this run's train file first; the shared val and test files in the folder itself
        "templates": [f"n{size}-s{seed}/{{task}}_{{split}}.h5", "{task}_{split}.h5"],
        "initial_step": INITIAL_STEP,
    }


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def downstream_runs(bench: Harness, name: str, folder: Path, source: str, schedule: dict, sizes, seeds, lrs) -> dict:
    """One held-out dataset: the zero-shot error, both arms at every size and seed, and the recipe variants."""
    spec = HELD_OUT[name]
    tasks = lambda size, seed: {name: _task(name, spec, folder, size, seed)}  # noqa: E731
    starts = {"scratch": {}, "fine-tuned": {"init_from": source, **RECIPE}}

    def score(arm: str, size: int, seed: int, lr: float, extra: dict | None = None, tag: str = "") -> tuple:
        train = {**schedule, "lr": lr, **starts[arm], **(extra or {})}
        cfg = bench.config(f"{name}-{arm}{tag}-n{size}-s{seed}-lr{lr:g}", tasks(size, seed), train, seed)
        scores = bench.fit(cfg)
        return headline(scores["val"][name]), headline(scores["test"][name])

    zero = bench.zero_shot(
        bench.config(f"{name}-zero-shot", tasks(sizes[0], seeds[0]), {**schedule, "init_from": source})
    )[name]
    arms: dict[str, dict] = {arm: {} for arm in starts}
    for size in sizes:
        for arm in starts:
            tried = {lr: score(arm, size, seeds[0], lr) for lr in lrs}
            lr = min(tried, key=lambda x: tried[x][0])
            runs = [
                {"seed": seeds[0], "lr": lr, "test": tried[lr][1], "tried": {f"{k:g}": v for k, v in tried.items()}}
            ]
            runs += [{"seed": seed, "lr": lr, "test": score(arm, size, seed, lr)[1]} for seed in seeds[1:]]
            arms[arm][size] = runs
    chosen = arms["fine-tuned"][sizes[0]][0]
    variants = {"every weight at one rate (the arm)": chosen["test"]}
    for label, extra in VARIANTS.items():
        variants[label] = score("fine-tuned", sizes[0], seeds[0], chosen["lr"], extra, f"-{label.split()[0]}")[1]
    return {
        "pde": spec["pde"],
        "zero_shot": headline(zero),
        "baseline": headline(zero, True),
        "arms": arms,
        "variants": variants,
    }


def run(
    out: Path,
    workdir: Path,
    quick: bool = False,
    model: dict | None = None,
    device: str = "cpu",
    pretrain: dict | None = None,
) -> dict:
    """The benchmark (``quick``: tiny data and few steps, one held-out dataset, 2 seeds); ``model`` and
    ``pretrain`` replace the multi-physics settings and the pretraining schedule (the GPU protocol's)."""
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    root = workdir / "transfer"
    shutil.rmtree(root / "runs", ignore_errors=True)
    mix = {n: dict(t) for n, t in MIX.items()}
    pool, sizes, seeds, lrs = POOL, SIZES, SEEDS, LRS
    pretrain, downstream, held_names = {**PRETRAIN, **(pretrain or {})}, dict(DOWNSTREAM), tuple(HELD_OUT)
    model = dict(model or MODEL_SETTINGS)
    if quick:
        for n, change in QUICK["mix"].items():
            mix[n].update(change)
        mix = {n: t for n, t in mix.items() if n in QUICK["mix"]}
        pool, sizes, seeds, lrs = QUICK["pool"], QUICK["sizes"], QUICK["seeds"], QUICK["lrs"]
        pretrain.update(QUICK["pretrain"])
        downstream.update(QUICK["downstream"])
        held_names, model = QUICK["held_out"], dict(QUICK["model"])
    bench = Harness(root, model, device)
    try:
        steps = pretrain["epochs"] * pretrain["steps_per_epoch"]
        pre_cfg = bench.config("pretrain", mix, {**pretrain, "held_out": list(held_names)})
        pretrained = bench.fit(pre_cfg)["test"]
        parameters = sum(
            p.numel()
            for p in initial_model(pre_cfg, RunDir.of(pre_cfg).load_tasks(pre_cfg), bench.env.device).parameters()
        )
        alone = {n: bench.fit(bench.config(f"alone-{n}", {n: t}, pretrain))["test"][n] for n, t in mix.items()}
        source = str(RunDir.of(pre_cfg).root)
        held = {}
        for name in held_names:
            folder = held_out_files(root, name, HELD_OUT[name], pool, sizes, seeds)
            held[name] = downstream_runs(bench, name, folder, source, downstream, sizes, seeds, lrs)
    finally:
        bench.close()
    result = _result(pretrained, alone, held, sizes, steps, parameters, model, bench.walls, load_before)
    result["downstream"] = downstream
    result["wall_s"]["total"] = time.perf_counter() - began
    save_result(out, "transfer", result, _markdown(result, sizes, seeds, lrs))
    return result


def _result(pretrained, alone, held, sizes, steps, parameters, model, walls, load_before) -> dict:
    small, large = sizes[0], sizes[-1]
    table, efficient, better = {}, [], []
    for name, h in held.items():
        figures = {
            arm: {size: mean_std([r["test"] for r in runs]) for size, runs in by_size.items()}
            for arm, by_size in h["arms"].items()
        }
        scratch_best = min(m for m, _ in figures["scratch"].values())
        reach = next((s for s in sizes if figures["fine-tuned"][s][0] <= scratch_best), None)
        table[name] = {"figures": figures, "samples_to_reach_scratch_best": reach}
        efficient.append(figures["fine-tuned"][small][0] <= figures["scratch"][large][0])
        for size in sizes:
            (f, fs), (s, ss) = figures["fine-tuned"][size], figures["scratch"][size]
            better.append(f <= 0.7 * s and s - f > 2 * max(fs, ss))
    ratios = {n: headline(pretrained[n]) / headline(alone[n]) for n in alone}
    within = sum(r <= 1.2 for r in ratios.values())
    return {
        "model": model,
        "parameters": parameters,
        "pretrain_steps": steps,
        "mix": {
            n: {
                "pretrained": headline(pretrained[n]),
                "alone": headline(alone[n]),
                "ratio": ratios[n],
                "baseline": headline(pretrained[n], True),
            }
            for n in alone
        },
        "held_out": {n: {**h, **table[n]} for n, h in held.items()},
        "wall_s": dict(walls),
        "machine": machine_figures(load_before),
        "targets": {
            f"fine-tuned on {small} reaches scratch on {large} on every held-out dataset": all(efficient),
            "fine-tuned at most 0.7x scratch at equal data, beyond twice the seeds' std": all(better),
            "the mix within 1.2x of single-dataset models on at least half its datasets": within * 2 >= len(ratios),
        },
    }


def _markdown(result: dict, sizes, seeds, lrs) -> str:
    lines = [
        "# Pretraining that pays: data efficiency on held-out physics",
        "",
        f"The multi-physics model ({result['parameters']:,} parameters) pretrained {result['pretrain_steps']} steps on "
        f"{', '.join(result['mix'])} (the Euler data smooth only); then on each held-out dataset of Riemann problems, "
        f"fine-tuned from it against trained from scratch, {len(seeds)} seeds, each arm at its best learning rate of "
        f"{', '.join(f'{x:g}' for x in lrs)} on the first seed's validation; at most "
        f"{result['downstream']['epochs'] * result['downstream']['steps_per_epoch']} steps by pushforward, stopped "
        "early, scored at the best validation. Test nRMSE of the changing fields over whole rollouts (17 frames): "
        "mean ± std over the seeds.",
        "",
        "| held out | trajectories | from scratch | fine-tuned | fine-tuned / scratch |",
        "|---|---|---|---|---|",
    ]
    for name, h in result["held_out"].items():
        for size in sizes:
            (f, fs), (s, ss) = h["figures"]["fine-tuned"][size], h["figures"]["scratch"][size]
            lines.append(f"| {name} ({h['pde']}) | {size} | {s:.4g} ± {ss:.2g} | {f:.4g} ± {fs:.2g} | {f / s:.2f} |")
    lines += [
        "",
        "| held out | zero-shot (pretrained, untrained on it) | repeat the last frame | trajectories "
        "fine-tuning needs to reach scratch's best |",
        "|---|---|---|---|",
    ]
    for name, h in result["held_out"].items():
        reach = h["samples_to_reach_scratch_best"]
        said = f"{reach} (scratch's best: {sizes[-1]})" if reach else f"more than {sizes[-1]}"
        lines.append(f"| {name} | {h['zero_shot']:.4g} | {h['baseline']:.4g} | {said} |")
    lines += [
        "",
        f"Fine-tuning recipes on {sizes[0]} trajectories (first seed, the fine-tuned arm's learning rate):",
        "",
        "| held out | " + " | ".join(next(iter(result["held_out"].values()))["variants"]) + " |",
        "|---|" + "---|" * len(next(iter(result["held_out"].values()))["variants"]),
    ]
    for name, h in result["held_out"].items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.4g}" for v in h["variants"].values()) + " |")
    lines += [
        "",
        f"The mix against single-dataset models of the same settings, {result['pretrain_steps']} steps each:",
        "",
        "| dataset | mix | alone | mix / alone | repeat the last frame |",
        "|---|---|---|---|---|",
    ]
    for name, m in result["mix"].items():
        lines.append(f"| {name} | {m['pretrained']:.4g} | {m['alone']:.4g} | {m['ratio']:.2f} | {m['baseline']:.4g} |")
    targets = [f"- {'met' if ok else '**missed**'}: {t}" for t, ok in result["targets"].items()]
    load = result["machine"]["load_average_1min"]
    lines += [
        "",
        "Targets:",
        *targets,
        "",
        f"{result['machine']['cpus']} CPUs, load average {load['before']:.1f} before, {load['after']:.1f} after; "
        f"{result['wall_s']['total']:.0f} s in all; reproduce with `make bench BENCH_ARGS=transfer`.",
        "",
    ]
    return "\n".join(lines)
