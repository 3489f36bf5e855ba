"""What torch.compile did with the training step, measured rather than assumed: the graphs compiled, graph
breaks (file:line and dynamo's reason), frames dynamo skipped (run eagerly), recompiles after warm-up, the
seconds spent compiling, and the kernel-level operations a steady step still dispatches outside compiled
graphs (counted in a profiler trace of one step). The trainer logs it once warm and writes it for the report
(summary.json's ``compile`` block).

A line "N graph(s) compiled" said nothing of how much of the step they held: 1-5 tiny graphs while 99% of the
step ran eagerly read the same as a whole step compiled. The count of operations outside graphs says it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"
_WHERE = re.compile(r"in user code at (\S+:\d+)")

# Aten operations that only make a view, an alias or an empty tensor: no kernel runs for them.
METADATA_OPS = frozenset(
    f"aten::{name}"
    for name in (
        *("view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "alias", "detach", "t", "transpose"),
        *("permute", "expand", "expand_as", "select", "slice", "unsqueeze", "squeeze", "movedim", "unbind", "split"),
        *("split_with_sizes", "chunk", "narrow", "view_as", "lift_fresh", "empty", "empty_like", "empty_strided"),
        *("unflatten", "flatten", "resolve_conj", "resolve_neg", "to", "contiguous", "numpy_T", "result_type"),
        *("_has_compatible_shallow_copy_type", "is_nonzero", "size", "stride", "dim", "set_"),
    )
)
COMPILED_REGIONS = ("Torch-Compiled Region", "CompiledFxGraph", "CompiledFunction")


@dataclass
class CompileFacts:
    """The compile block of summary.json."""

    mode: str
    """How the step ran: 'whole step' (one compiled function), 'model' (the model compiled alone, the rest of the
    step eager) or 'eager'."""
    why: str | None = None
    """Why the step was not compiled whole, where it was not."""
    backend: str = "inductor"
    """The compiler (compile.backend): aot_eager traces the same graphs but generates no code."""
    graphs: int = 0
    """Graphs compiled for training."""
    breaks: list[dict] = field(default_factory=list)
    """Each graph break: {"where": file:line, "reason": dynamo's first line}."""
    frames_skipped: int = 0
    """Frames dynamo gave up on and ran eagerly."""
    recompiles_after_warmup: int = 0
    """Graphs compiled for a step whose kind (rollout length, tasks) had been compiled already."""
    compile_s: float = 0.0
    """Seconds of the steps that compiled (tracing and code generation; the FX graph cache makes a resume's
    short)."""
    ops_outside_graphs: int | None = None
    """Kernel-level operations one steady step dispatches outside compiled graphs (None: not measured yet)."""


class CompileWatch:
    """Collects :class:`CompileFacts` while the trainer runs its steps through :meth:`step`."""

    def __init__(self, mode: str, why: str | None = None, backend: str = "inductor"):
        self.facts = CompileFacts(mode, why, backend)
        self._seen: set = set()
        self._measured = False
        self._handler: logging.Handler | None = None
        self._start = self._counters()
        if mode != "eager":
            self._listen()

    # -- dynamo's own records -----------------------------------------------------------------------------------

    def _listen(self) -> None:
        """Dynamo's graph-break and recompile records, taken from its own loggers (and kept off the console)."""
        import torch._logging

        watch = self

        class Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.name == BREAK_LOGGER:
                    watch.add_break(record.getMessage())

        with contextlib.suppress(Exception):  # an unknown artifact in another torch version: breaks counted only
            torch._logging.set_logs(graph_breaks=True)
        logger = logging.getLogger(BREAK_LOGGER)
        logger.propagate = False
        self._handler = Collect()
        logger.addHandler(self._handler)

    def add_break(self, message: str) -> None:
        """One break from dynamo's record: where (file:line) and why (its reason and the line after it)."""
        where = _WHERE.search(message)
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        at = next((i for i, line in enumerate(lines) if line.startswith("Graph Break Reason:")), None)
        reason = ""
        if at is not None:
            after = lines[at + 1] if at + 1 < len(lines) else ""
            reason = f"{lines[at].removeprefix('Graph Break Reason:').strip()} {after}".strip()
        entry = {"where": where.group(1) if where else "unknown", "reason": reason[:300]}
        if entry not in self.facts.breaks:
            self.facts.breaks.append(entry)

    @staticmethod
    def _counters() -> tuple[int, int, int]:
        from torch._dynamo.utils import counters

        frames = counters["frames"]
        return int(counters["stats"]["unique_graphs"]), int(frames["total"]), int(frames["ok"])

    # -- the steps ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, kind) -> Iterator[None]:
        """Around one training step of ``kind`` (what selects its graph: rollout length, tasks drawn)."""
        before = self._counters()[0]
        began = time.perf_counter()
        yield
        compiled = self._counters()[0] - before
        if compiled:
            self.facts.compile_s += time.perf_counter() - began
            if kind in self._seen:
                self.facts.recompiles_after_warmup += compiled
        self._seen.add(kind)
        graphs, total, ok = self._counters()
        self.facts.graphs = graphs - self._start[0]
        self.facts.frames_skipped = (total - self._start[1]) - (ok - self._start[2])

    def wants_measure(self) -> bool:
        """Whether the next step should be traced for the operations outside graphs: once, after a first step
        (a step that compiles is no steady step: the next one is traced then)."""
        return self.facts.mode != "eager" and not self._measured and bool(self._seen)

    @contextlib.contextmanager
    def measured(self) -> Iterator[None]:
        """Trace one step with the profiler and count the kernel-level operations outside compiled graphs."""
        from torch.profiler import ProfilerActivity, profile

        before = self._counters()[0]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        if self._counters()[0] == before:  # a step that compiled is no steady step: measured at another
            self.facts.ops_outside_graphs = ops_outside_graphs(prof.events())
            self._measured = True

    def close(self) -> CompileFacts:
        if self._handler is not None:
            logging.getLogger(BREAK_LOGGER).removeHandler(self._handler)
            self._handler = None
        return self.facts

    def summary(self) -> dict:
        return asdict(self.facts)

    def line(self) -> str:
        """The log line: what compiled and what still runs eagerly."""
        f = self.facts
        if f.mode == "eager":
            return f"torch.compile: off ({f.why})" if f.why else "torch.compile: off"
        outside = "not measured" if f.ops_outside_graphs is None else str(f.ops_outside_graphs)
        parts = [
            f"torch.compile ({f.mode}{'; ' + f.why if f.why else ''}"
            f"{'' if f.backend == 'inductor' else '; backend ' + f.backend}): {f.graphs} training graph(s) in "
            f"{f.compile_s:.1f} s",
            f"{len(f.breaks)} graph break(s)"
            + (f" (first at {f.breaks[0]['where']}: {f.breaks[0]['reason']})" if f.breaks else ""),
            f"{f.frames_skipped} frame(s) skipped",
            f"{f.recompiles_after_warmup} recompile(s) after warm-up",
            f"{outside} kernel-level operation(s) per step outside compiled graphs",
        ]
        return ", ".join(parts)


def ops_outside_graphs(events) -> int:
    """Kernel-level aten operations of a profiler trace that ran outside compiled graphs: the leaves of the aten
    call tree (an operation that calls no other), less views and other metadata, with no compiled region above."""
    count = 0
    children: dict[int, bool] = {}
    for e in events:
        parent = e.cpu_parent
        if parent is not None and parent.name.startswith("aten::"):
            children[id(parent)] = True
    for e in events:
        if not e.name.startswith("aten::") or e.name in METADATA_OPS or children.get(id(e)):
            continue
        parent, compiled = e.cpu_parent, False
        while parent is not None:
            if any(region in parent.name for region in COMPILED_REGIONS):
                compiled = True
                break
            parent = parent.cpu_parent
        count += not compiled
    return count


LAUNCHES = {
    "graph": ("cudaGraphLaunch",),
    "kernel": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"),
    "copy": ("cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy"),
}
"""The CUDA runtime calls of a profiler trace that launch work on the GPU, by kind."""


def launches(events) -> dict[str, int]:
    """The GPU launches of a profiler trace by kind (graph replays, kernels, copies): what the host issues per
    step, which bounds a small model's step on a fast GPU."""
    counts = dict.fromkeys(LAUNCHES, 0)
    for e in events:
        for kind, names in LAUNCHES.items():
            if e.name.startswith(names):
                counts[kind] += 1
    return counts
