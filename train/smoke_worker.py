"""The rank side of the smoke test (``python -m train smoke``; the launcher side is train.launch.smoke).

Each rank runs: collectives with known results, 5 DDP steps whose gradients are checked against one process
computing the whole batch, a checkpoint save/load round trip and a torch.compile step. Rank 0 prints a table
and writes runs/smoke/smoke.json; any failure exits non-zero.
"""

from __future__ import annotations

from train.heap import pause_while_importing

pause_while_importing(__name__)  # resumed by run_rank once the modules below are imported

import argparse
import copy
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# DDP's constructor imports dynamo (and sympy), a second for every rank: here, with the collector paused.
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from train.atomic import write_json_atomic
from train.checkpoint import MODEL, OPTIMIZER, checkpoint_name, save_checkpoint
from train.distributed.env import DistEnv
from train.distributed.error_file import record
from train.distributed.shared_checkpoint import shared_checkpoint
from train.errors import DistributedError
from train.rank_start import Rank, run_rank
from train.run_dir import RunDir

log = logging.getLogger(__name__)

STEPS = 5
PER_RANK = 4  # samples per rank per step
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


class SmokeFailure(Exception):
    """A check ran but gave the wrong answer."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise SmokeFailure(message)


class TinyModel(nn.Module):
    """A model class of our own, as the trainer's is: torch.compile(DDP(...)) compiles the wrapped module's
    forward as its own frame, and skips frames of torch's own classes (an nn.Sequential would run eagerly)."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(8, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.hidden(x)))


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyModel()


def check_all_reduce(env: DistEnv) -> str:
    t = torch.tensor([env.rank + 1.0], device=env.device)
    dist.all_reduce(t)
    want = env.world_size * (env.world_size + 1) / 2
    expect(t.item() == want, f"sum of rank+1 over {env.world_size} ranks is {t.item()}, expected {want}")
    return f"sum of rank+1 = {want:g}"


def check_broadcast(env: DistEnv) -> str:
    want = torch.arange(4.0) * 7
    t = (want.clone() if env.is_main else torch.zeros(4)).to(env.device)
    dist.broadcast(t, src=0)
    expect(torch.equal(t.cpu(), want), f"received {t.tolist()}, rank 0 sent {want.tolist()}")
    return "rank 0's tensor on every rank"


def check_all_gather(env: DistEnv) -> str:
    mine = torch.tensor([float(env.rank), float(env.rank) ** 2], device=env.device)
    gathered = [torch.zeros(2, device=env.device) for _ in range(env.world_size)]
    dist.all_gather(gathered, mine)
    got = [g.cpu().tolist() for g in gathered]
    want = [[float(r), float(r) ** 2] for r in range(env.world_size)]
    expect(got == want, f"gathered {got}, expected {want}")
    return f"{env.world_size} ranks' tensors in rank order"


def check_barrier(env: DistEnv) -> str:
    start = time.perf_counter()
    dist.barrier(device_ids=[env.local_rank]) if env.backend == "nccl" else dist.barrier()
    return f"all ranks met ({(time.perf_counter() - start) * 1000:.1f} ms)"


def _batches(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    n = world_size * PER_RANK
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)) for _ in range(STEPS)]


def check_ddp_steps(env: DistEnv, state: dict) -> str:
    """DDP on each rank's shard must match one process on the whole batch, gradient for gradient."""
    reference = tiny_model()
    model = copy.deepcopy(reference).to(env.device)
    ddp = DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    mine = slice(env.rank * PER_RANK, (env.rank + 1) * PER_RANK)
    worst = 0.0
    for step, (x, y) in enumerate(_batches(env.world_size)):
        nn.functional.mse_loss(ddp(x[mine].to(env.device)), y[mine].to(env.device)).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            got = p.grad.detach().cpu()
            worst = max(worst, (got - q.grad).abs().max().item())
            expect(torch.allclose(got, q.grad, **TOLERANCE), f"step {step}: gradient of {name} differs by {worst:.3g}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        expect(torch.allclose(p.detach().cpu(), q, **TOLERANCE), f"after {STEPS} steps, {name} differs")
    state.update(model=model, optimizer=opt)
    return f"{STEPS} steps match one process (max gradient difference {worst:.1e})"


def check_checkpoint(env: DistEnv, state: dict, folder: Path) -> str:
    """Rank 0 saves atomically; every rank loads it (weights_only) and must get its own weights back."""
    model, opt = state["model"], state["optimizer"]
    failed = None
    if env.is_main:
        try:
            save_checkpoint(folder, 0, {MODEL: model.state_dict(), OPTIMIZER: opt.state_dict()}, keep=1)
        except OSError as e:  # reported after the barrier, which every rank must reach to stay in step
            failed = e
    dist.barrier()
    expect(failed is None, f"saving into {folder} failed: {failed}")
    # As training resumes: rank 0 reads the file, and ranks on other nodes (whose folders may not hold it)
    # receive its bytes.
    _, loaded = shared_checkpoint(env, folder, lambda: folder / checkpoint_name(0))
    assert loaded is not None, "rank 0 named a checkpoint"
    for name, tensor in model.state_dict().items():
        expect(torch.equal(loaded[MODEL][name], tensor.cpu()), f"{name} differs after the round trip")
    restored = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    restored.load_state_dict(loaded[OPTIMIZER])
    expect(len(restored.state) == len(opt.state), "the optimizer's momentum buffers were not restored")
    return f"model and optimizer restored from {folder.name}/{checkpoint_name(0)}"


def check_compile(env: DistEnv, state: dict) -> str:
    """One torch.compile (default mode) step of a DDP-wrapped model, compiled as the trainer does (after
    wrapping): a graph must really be compiled, and its gradients must equal one process's eager gradients on
    the whole batch."""
    from torch._dynamo.utils import counters

    reference = copy.deepcopy(state["model"]).cpu()
    module = copy.deepcopy(state["model"])
    ddp = DistributedDataParallel(module, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    compiled = torch.compile(ddp, mode="default")
    x, y = _batches(env.world_size)[0]
    mine = slice(env.rank * PER_RANK, (env.rank + 1) * PER_RANK)
    graphs = counters["stats"]["unique_graphs"]
    nn.functional.mse_loss(compiled(x[mine].to(env.device)), y[mine].to(env.device)).backward()
    captured = counters["stats"]["unique_graphs"] - graphs
    expect(captured > 0, "torch.compile captured no graph: the step ran eagerly")
    nn.functional.mse_loss(reference(x), y).backward()
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        got = p.grad.detach().cpu()
        expect(torch.allclose(got, q.grad, **TOLERANCE), f"compiled gradient of {name} differs from eager")
    return f"{captured} graph(s) compiled; gradients equal eager"


def run_checks(env: DistEnv, run: RunDir, compile_step: bool) -> list[dict]:
    if env.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference runs in exact float32 on the CPU
        torch.backends.cudnn.allow_tf32 = False
    state: dict = {}
    checks: list[tuple[str, Callable[[], str]]] = [
        ("all_reduce", lambda: check_all_reduce(env)),
        ("broadcast", lambda: check_broadcast(env)),
        ("all_gather", lambda: check_all_gather(env)),
        ("barrier", lambda: check_barrier(env)),
        ("DDP vs one process", lambda: check_ddp_steps(env, state)),
        ("checkpoint round trip", lambda: check_checkpoint(env, state, run.checkpoints)),
    ]
    if compile_step:
        checks.append(("torch.compile step", lambda: check_compile(env, state)))
    results = []
    for name, fn in checks:
        start = time.perf_counter()
        try:
            detail, ok = fn(), True
        except (SmokeFailure, KeyError) as e:
            detail, ok = str(e), False
        except Exception as e:  # a broken backend or compiler: report it in the table, do not hide it
            detail, ok = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", False
            log.exception("%s failed", name)
        results.append({"check": name, "ok": ok, "seconds": round(time.perf_counter() - start, 3), "detail": detail})
        log.debug("%s: %s (%s)", name, "pass" if ok else "FAIL", detail)
        if not ok and name in ("DDP vs one process",):
            break  # the later checks use its model
    return results


def summarise(env: DistEnv, per_rank: list[list[dict]]) -> tuple[str, list[dict]]:
    """One row per check: failed if it failed on any rank (that rank's message shown)."""
    rows = []
    for i, first in enumerate(per_rank[0]):
        entries = [(rank, r[i]) for rank, r in enumerate(per_rank) if i < len(r)]
        bad = [(rank, e) for rank, e in entries if not e["ok"]]
        detail = f"rank {bad[0][0]}: {bad[0][1]['detail']}" if bad else first["detail"]
        seconds = max(e["seconds"] for _, e in entries)
        rows.append({"check": first["check"], "ok": not bad, "seconds": seconds, "detail": detail})
    width = max(len(r["check"]) for r in rows)
    lines = [f"smoke test: {env.world_size} rank(s), backend {env.backend}, device {env.device.type}"]
    lines += [
        f"  {'PASS' if r['ok'] else 'FAIL'}  {r['check']:<{width}}  {r['seconds']:6.2f} s  {r['detail']}" for r in rows
    ]
    return "\n".join(lines), rows


def _skip_compile(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-compile", action="store_true")


def _smoke(rank: Rank) -> None:
    env, run = rank.env, rank.run
    results = run_checks(env, run, not rank.args.skip_compile)
    per_rank: list = [None] * env.world_size
    dist.all_gather_object(per_rank, results)
    table, rows = summarise(env, per_rank)
    if env.is_main:
        print(table, flush=True)
        write_json_atomic(run.smoke_results, {"world_size": env.world_size, "checks": rows})
    failed = [r["check"] for r in rows if not r["ok"]]
    if failed:
        raise DistributedError(f"smoke test failed: {', '.join(failed)} (details in {run.logs})")


@record
def main(argv: list[str] | None = None) -> int:
    return run_rank("python -m train.smoke_worker", _skip_compile, _smoke, argv)


if __name__ == "__main__":
    sys.exit(main())
