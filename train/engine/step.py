"""The whole training step as one compiled function: forward (the rollout), loss, gradients, their all-reduce,
clipping, the non-finite skip and the AdamW update, traced by torch.compile into one graph per rollout length.

Compiling the model alone leaves most of a step eager: the rollout loop, the loss, the backward, clipping and
the optimizer each launch their own kernels from Python, and a small model's step then waits for the host (an
H200 ran gpu.yaml's step in 18-21 ms whatever the batch, launching ~270 kernels). Here the step is a function of
tensors only:

- gradients come from ``torch.autograd.grad`` (a parameter a step does not reach gets zeros, so ranks that drew
  different tasks need no unused-parameter search);
- with several ranks they are all-reduced in the graph, as one flat buffer divided by the world size and summed
  (a functional collective: what DDP computes, without its hooks, which a compiled step would skip);
- clipping and the non-finite check are tensor math: a step whose gradient norm is not finite leaves weights,
  moments and step counts as they were (what the fused AdamW does when told ``found_inf``), decided on the
  device, judged on the host later (train.engine.nonfinite);
- AdamW is written out per parameter on the optimizer's own state tensors (``exp_avg``, ``exp_avg_sq``,
  ``step``), so checkpoints hold the optimizer's usual state dict; the learning rate is a device tensor per
  parameter group that the schedule writes after each step (a Python float would be frozen into a CUDA graph).

Nothing in the step reads a device value on the host. With one process on a GPU, ``compile.mode=reduce-overhead``
replays it as a CUDA graph (its state tensors marked static). Micro-batches (train.accumulate_steps) run one
compiled function each that adds its gradients into buffers, and one more that reduces and applies them.
Where a step cannot be compiled whole (FSDP2's hooks, fp16's loss scaler, batch-norm statistics broadcast by DDP),
:func:`whole_step_unavailable` says why and the trainer compiles the model alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from train.config import Config
from train.distributed.env import DistEnv
from train.engine.loss import task_loss
from train.engine.objective import unrolled_targets

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64
"""Graphs dynamo may keep per compiled function: one per rollout length and set of tasks drawn, more than its
default of 8 for a long pushforward under weighted sampling (past the limit it would run the step eagerly)."""


def whole_step_unavailable(cfg: Config, env: DistEnv, model: nn.Module, precision) -> str | None:
    """Why this run's step cannot be compiled whole (the model is then compiled alone), or None when it can."""
    if env.world_size > 1 and cfg.dist.parallel != "ddp":
        return (
            f"dist.parallel={cfg.dist.parallel}: FSDP2 gathers and reduces each unit's shards from hooks around its "
            "forward and backward, which a compiled step does not run"
        )
    if precision.dtype == torch.float16:
        return "train.precision=fp16: its loss scaler adjusts the scale on the host between steps"
    if env.world_size > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return "batch normalisation under DDP: its running statistics are rank 0's, broadcast by DDP at each forward"
    return None


def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state for every parameter that has none yet, as the fused optimizer makes it (step a float32
    0-d tensor on the parameter's device), so that a checkpoint holds what an eager run's would."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != p.device:  # a checkpoint of a non-fused optimizer keeps steps on the CPU
                state["step"] = state["step"].to(p.device, torch.float32)


def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    lr: torch.Tensor,
    hyper: tuple[float, float, float, float],
    skip: torch.Tensor,
) -> None:
    """AdamW (decoupled weight decay) on ``params`` in place, unless ``skip`` (a device bool): then parameters,
    moments and step counts stay as they were. ``state``: each parameter's (step, exp_avg, exp_avg_sq);
    ``hyper``: (beta1, beta2, eps, weight decay)."""
    beta1, beta2, eps, decay = hyper
    keep = (~skip).float()
    for p, g, (step, m, v) in zip(params, grads, state, strict=True):
        g = torch.where(skip, torch.zeros_like(g), g)  # NaN * 0 is NaN: a skipped gradient must not reach the moments
        step.add_(keep)
        t = torch.clamp(step, min=1.0)  # a first step that is skipped divides by nothing below
        bias1, bias2 = 1 - beta1**t, 1 - beta2**t
        if decay:
            p.mul_(1 - keep * lr * decay)
        m.lerp_(g, keep * (1 - beta1))
        v.lerp_(g * g, keep * (1 - beta2))
        denom = v.sqrt() / bias2.sqrt() + eps
        p.sub_((keep * lr / bias1) * m / denom)


class WholeStep:
    """The compiled step of one rank. ``forward(inputs, free, grad)``: the model's predictions by task (the
    rollout of :class:`train.engine.objective.Unroll`, or one step); the trainer calls :meth:`run` for each
    micro-batch in order, the last one applying the update."""

    def __init__(
        self,
        model: nn.Module,
        forward: Callable,
        optimizer: torch.optim.Optimizer,
        cfg: Config,
        env: DistEnv,
        names: list[str],
        weights: dict[str, float],
        rolled_out: set[str],
        precision,
        micro: int,
        mode: str,
        backend: str | Callable = "inductor",
    ):
        import torch._dynamo

        torch._dynamo.config.trace_autograd_ops = True  # torch.autograd.grad traced into the graph
        torch._dynamo.config.suppress_errors = False  # a step that cannot compile whole says so (the trainer decides)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
        self.model, self.forward, self.optimizer = model, forward, optimizer
        self.names, self.weights, self.rolled_out = names, weights, rolled_out
        self.precision, self.micro, self.world = precision, micro, env.world_size
        self.clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
        position = {id(p): i for i, p in enumerate(self.params)}
        self.positions = [[position[id(p)] for p in group] for group in self.groups]  # each group's in params
        # Constants of the graph, read once: the compiled step never touches param_groups, whose 'lr' the schedule
        # rewrites every step (dynamo would guard on it and recompile at each new value).
        self.hyper = [(*g["betas"], g["eps"], g["weight_decay"]) for g in optimizer.param_groups]
        self.lrs = [
            torch.tensor(float(g["lr"]), dtype=torch.float32, device=env.device) for g in optimizer.param_groups
        ]
        self.buffers: list[torch.Tensor] | None = None  # micro-batches' summed gradients (accumulation only)
        self.ready = False
        options = {"fullgraph": True, "dynamic": False, "backend": backend}
        if mode != "default" and backend == "inductor":
            options["mode"] = mode
        self.whole = torch.compile(self._whole, **options)
        self.accumulate = torch.compile(self._accumulate, **options)
        self.apply = torch.compile(self._apply, **options)
        if env.world_size > 1:  # what DDP's constructor does: every rank starts from rank 0's weights
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t, 0)

    # -- what the trainer calls ---------------------------------------------------------------------------------

    def set_lr(self) -> None:
        """The schedule's learning rates into the device tensors the step reads (no host sync)."""
        for lr, group in zip(self.lrs, self.optimizer.param_groups, strict=True):
            lr.fill_(float(group["lr"]))

    def run(self, batches: dict, free: int, grad: int, last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One micro-batch: the loss sum of each task (zero for a task not in ``batches``), and on the ``last``
        micro-batch whether the update was skipped (a device bool; None before)."""
        if not self.ready:  # after the trainer resumed: the optimizer's state is what the step updates
            self._prepare()
        inputs, targets, latents = _split(batches)
        if self.micro == 1:
            return self.whole(inputs, targets, latents, free, grad, self._state(), self.lrs)
        sums = self.accumulate(inputs, targets, latents, free, grad, self.buffers)
        return sums, (self.apply(self.buffers, self._state(), self.lrs) if last else None)

    def _prepare(self) -> None:
        _initialise_state(self.optimizer)
        # The update is this step's, not optimizer.step()'s: the schedule must not warn that it runs first.
        self.optimizer._opt_called = True
        if self.micro > 1:
            self.buffers = [torch.zeros_like(p) for p in self.params]
        self.set_lr()
        state = [t for group in self._state() for triple in group for t in triple]
        for t in [*self.lrs, *(self.buffers or ()), *state]:
            torch._dynamo.mark_static_address(t)  # updated in place: a CUDA graph replays on their memory
        self.ready = True

    def _state(self) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        s = self.optimizer.state
        return [[(s[p]["step"], s[p]["exp_avg"], s[p]["exp_avg_sq"]) for p in group] for group in self.groups]

    # -- the compiled functions ---------------------------------------------------------------------------------

    def _whole(self, inputs, targets, latents, free: int, grad: int, state, lrs):
        sums, grads = self._gradients(inputs, targets, latents, free, grad)
        return sums, self._update(grads, state, lrs)

    def _accumulate(self, inputs, targets, latents, free: int, grad: int, buffers):
        sums, grads = self._gradients(inputs, targets, latents, free, grad)
        with torch.no_grad():
            for b, g in zip(buffers, grads, strict=True):
                b.add_(g)
        return sums

    def _apply(self, buffers, state, lrs):
        skipped = self._update(list(buffers), state, lrs)
        with torch.no_grad():
            for b in buffers:
                b.zero_()
        return skipped

    def _gradients(self, inputs, targets, latents, free: int, grad: int):
        with self.precision.autocast():
            preds = self.forward(inputs, latents, free, grad)
        losses = {}
        for n, y in targets.items():
            y = unrolled_targets(y, free, grad) if n in self.rolled_out else y
            losses[n] = task_loss(preds[n], y)
        loss = sum(self.weights[n] * v for n, v in losses.items()) / self.micro
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, self.params, strict=True)]
        zero = torch.zeros((), device=loss.device)
        sums = torch.stack([losses[n].detach().float() if n in losses else zero for n in self.names])
        return sums, grads

    def _update(self, grads: list[torch.Tensor], state, lrs) -> torch.Tensor:
        with torch.no_grad():
            if self.world > 1:
                grads = _all_reduce_mean(grads, self.world)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            skipped = ~torch.isfinite(norm)
            if self.clip is not None:  # torch.nn.utils.clip_grad_norm_'s rule
                scale = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
                grads = [g * scale for g in grads]
            groups = zip(self.groups, self.positions, state, lrs, self.hyper, strict=True)
            for params, positions, group_state, lr, hyper in groups:
                adamw_update(params, [grads[i] for i in positions], group_state, lr, hyper, skipped)
        return skipped


def _split(batches: dict) -> tuple[dict, dict, dict]:
    inputs = {n: b["x"] for n, b in batches.items()}
    targets = {n: b["y"] for n, b in batches.items()}
    latents = {n: b["z"] for n, b in batches.items() if "z" in b}
    return inputs, targets, latents


def _all_reduce_mean(grads: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """The ranks' mean gradient, as DDP computes it (each rank's divided by the world size, then summed), in one
    collective over one flat buffer."""
    import torch.distributed._functional_collectives as fc

    flat = torch.cat([g.reshape(-1) for g in grads]) / world
    flat = fc.wait_tensor(fc.all_reduce(flat, "sum", dist.group.WORLD))
    return [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
