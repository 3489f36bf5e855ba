"""Putting the model together for training: precision, the unused-parameter check, then torch.compile (DDP or
FSDP2 in between, with several processes: train.engine.parallel).

Order matters (docs/configs.md, 'Training'): model.to(device) -> DDP -> torch.compile. Compiling the DDP wrapper lets
dynamo split the graph at DDP's bucket boundaries (its DDPOptimizer), so gradient all-reduces still overlap
with the backward pass.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from train.config import CompileConfig
from train.distributed.env import DistEnv
from train.errors import ConfigError

log = logging.getLogger(__name__)

# Modes whose CUDA graphs would replay without DDP's gradient hooks, and what each becomes under DDP. With one
# process there is no DDP (train.engine.parallel.wrap), so they are honoured there.
_GRAPH_FREE = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


@dataclass(frozen=True)
class Precision:
    """Autocast dtype (None: fp32) and whether fp16's gradient scaler is needed."""

    dtype: torch.dtype | None
    device_type: str

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaler(self) -> torch.amp.GradScaler | None:
        # bf16 has fp32's exponent range: only fp16 gradients underflow without loss scaling.
        return torch.amp.GradScaler(self.device_type) if self.dtype == torch.float16 else None


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """train.precision -> Precision. auto: bf16 on GPUs with bf16 support, fp16 on older GPUs, fp32 on CPU."""
    if requested == "auto" and device.type != "cuda":
        requested = "fp32"
    elif requested == "auto":
        requested = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]
    return Precision(dtype, device.type)


def unused_parameters(model: nn.Module, run: Callable[[nn.Module], torch.Tensor]) -> list[str]:
    """Names of trainable parameters that get no gradient from ``run(model)`` (a forward returning a loss).

    Leaves every gradient as it was before (None).
    """
    model.zero_grad(set_to_none=True)
    run(model).backward()
    names = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    return names


def check_no_dead_parameters(model: nn.Module, run_all_tasks: Callable[[nn.Module], torch.Tensor]) -> None:
    """A parameter that no task's forward reaches would make DDP fail at the second step with "Expected to have
    finished reduction in the prior iteration"; name it now instead."""
    dead = unused_parameters(model, run_all_tasks)
    if dead:
        raise ConfigError(
            f"the model has {len(dead)} trainable parameter(s) that no task's forward pass uses: "
            f"{', '.join(dead[:20])}{' ...' if len(dead) > 20 else ''}. DDP would stop with 'Expected to have "
            "finished reduction'. Remove them from the model or freeze them (requires_grad_(False))."
        )


def compile_enabled(cfg: CompileConfig, device: torch.device) -> bool:
    return cfg.enabled if cfg.enabled != "auto" else device.type == "cuda"


def compile_off_reason(cfg: CompileConfig, device: torch.device) -> str:
    """Why torch.compile is off, for the compile report."""
    if cfg.enabled == "auto":
        return f"compile.enabled=auto compiles on CUDA only; this run is on {device.type}"
    return "compile.enabled=false"


def break_place(error: BaseException) -> str:
    """Where and why dynamo could not trace a function whole: ``file:line: reason`` from its exception (the
    innermost frame of the user code it names)."""
    import re

    text = str(error)
    frames = re.findall(r'File "([^"]+)", line (\d+)', text)
    where = f"{frames[-1][0]}:{frames[-1][1]}" if frames else "an unknown place"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{where}: {lines[0][:300] if lines else type(error).__name__}"


def compile_model(ddp: nn.Module, cfg: CompileConfig, env: DistEnv, backend: str | Callable = "inductor") -> nn.Module:
    """torch.compile the DDP-wrapped model (lazily: graphs are built at the first step), or return it as is.

    Without compile.strict a frame that fails to compile runs eagerly (dynamo's suppress_errors) and the
    trainer warns after the first step; with it, the failure stops the run.
    """
    if not compile_enabled(cfg, env.device):
        return ddp
    import torch._dynamo

    mode = graph_mode(cfg, env)
    if mode != cfg.mode:
        log.warning(
            "compile.mode=%s captures CUDA graphs, whose replay skips DDP's gradient synchronisation; using "
            "'%s' under DDP (with one process it is honoured)",
            cfg.mode,
            mode,
        )
    torch._dynamo.config.suppress_errors = not cfg.strict
    wrapped = "DDP model" if env.world_size > 1 else "model (one process, no DDP)"
    log.info("torch.compile(mode=%s) of the %s%s", mode, wrapped, ", strict" if cfg.strict else "")
    if backend == "inductor":
        return torch.compile(ddp, mode=mode)
    return torch.compile(ddp, backend=backend)


def graph_mode(cfg: CompileConfig, env: DistEnv) -> str:
    """compile.mode as it runs: a CUDA-graph mode is honoured for one process (no DDP), replaced under DDP."""
    return _GRAPH_FREE.get(cfg.mode, cfg.mode) if env.world_size > 1 else cfg.mode


def captures_graphs(cfg: CompileConfig, env: DistEnv) -> bool:
    """Whether the compiled step replays CUDA graphs: each step must then be marked (their outputs are reused)."""
    return compile_enabled(cfg, env.device) and env.device.type == "cuda" and graph_mode(cfg, env) in _GRAPH_FREE


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the compiler failed" rather than "the model is wrong"."""
    from torch._dynamo.exc import TorchDynamoException

    found: list[type[BaseException]] = [TorchDynamoException]
    with contextlib.suppress(ImportError):
        from torch._inductor.exc import InductorError

        found.append(InductorError)
    return tuple(found)
