"""Launch the ranks with torchrun (torch.distributed.run, in process) and pass their exit code through.

torchrun itself exits 1 whatever its workers returned; running its ``run()`` here lets us read every
failed rank's exit code and error file, print one summary and exit with the rank's own code.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from train.config import Config
from train.distributed.env import free_port
from train.errors import ConfigError, DataError, DiskFullError, DistributedError, Preempted, PreflightError, TrainError
from train.heap import freeze_imported
from train.launch.address import network_environ
from train.launch.targets import topology_from_environ
from train.launch.topology import Topology, nproc_for, threads_per_rank
from train.obs.log import debug_enabled, redacted_environ
from train.run_dir import RunDir
from train.stop_signals import FORWARDED_SIGNALS, RANK_STOP_SIGNALS

log = logging.getLogger(__name__)

COMPILED_CACHE = "compiled"
"""The folder under run.cache_dir that holds torch.compile's caches (TORCHINDUCTOR_CACHE_DIR, unless set)."""
_CACHE_DIR_GIVEN = "TORCHINDUCTOR_CACHE_DIR" in os.environ  # by the user, before this process imported inductor

# What a signal usually means here, for the failure summary.
SIGNAL_HINTS = {
    signal.SIGBUS: "often /dev/shm exhausted (Docker defaults to 64 MB: run with --shm-size or ipc: host; "
    "`python -m train doctor` says how much this config needs), or a memory-mapped file on a full disk (df -h "
    "the run, cache and data folders)",
    signal.SIGKILL: "killed from outside, often the host's out-of-memory killer (check dmesg)",
    signal.SIGSEGV: "a native crash (library version mismatch or a bug in an extension)",
    signal.SIGABRT: "aborted, e.g. by NCCL's watchdog after a collective timed out (DEBUG=1 dumps its flight recorder)",
    signal.SIGTERM: "terminated by the launcher, the scheduler or a user",
}
TIMEOUT_HINT = (
    "a rank never arrived, or stopped calling collectives (crashed, hung on data or took a different branch); "
    "the other ranks' logs show where they waited"
)


def resolve_nproc(requested: str | int | None, cfg: Config) -> int:
    """Processes for this node: one per visible GPU, or dist.cpu_nproc without GPUs, unless set explicitly."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n, how = nproc_for(cfg.dist.nproc if requested in (None, "") else requested, cfg.dist.cpu_nproc, gpus)
    if n is None:
        raise PreflightError(how)
    if gpus and n > gpus and cfg.dist.backend != "gloo":
        raise PreflightError(
            f"nproc={n} but only {gpus} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): ranks would wait forever for GPUs that do not "
            f"exist. Use NPROC=auto or NPROC={gpus}."
        )
    return n


class WorkerFailure(TrainError):
    """A rank exited non-zero; carries the rank's own exit code to the shell."""

    def __init__(self, code: int, summary: str):
        super().__init__(summary)
        self.exit_code = code


def torchrun_argv(
    topology: Topology,
    nproc: int,
    cfg: Config,
    log_dir: Path,
    module: str,
    args: list[str],
    debug: bool,
    live_console: bool = False,
    address: str | None = None,
) -> list[str]:
    """The torchrun command line: standalone on one node, c10d rendezvous on the first node across several.

    ``live_console``: the launcher's stderr is a terminal; local rank 0 then writes its stderr straight to it
    (its progress bar redraws in place, which a line-by-line tee cannot show) and tees only its stdout.
    ``address``: what this node advertises to the others (the agents' own default is the hostname, which other
    boxes often cannot resolve).
    """
    tee = "3"
    if live_console and not debug:
        tee = ",".join(["0:1", *(f"{i}:3" for i in range(1, nproc))])
    if topology.multi_node:
        where = [
            f"--nnodes={topology.nnodes}",  # c10d hands out ranks in arrival order: no --node-rank
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={topology.endpoint}",
            f"--rdzv-id={topology.run_id}",
            # Node 0's launcher hosts the store for the whole launch (train.launch.node_barrier); no agent may
            # bind it, or a second launcher on the same host could take the port first.
            f"--rdzv-conf=join_timeout={cfg.dist.timeout_s},is_host=false",
            *([f"--local-addr={address}"] if address else []),
        ]
    else:
        where = ["--standalone"]
    return [
        *where,
        f"--nproc-per-node={nproc}",
        f"--max-restarts={cfg.dist.max_restarts}",
        f"--log-dir={log_dir}",
        f"--tee={tee}",  # every rank's stdout/stderr (native crashes, NCCL) into its own file, and to the console
        *([] if debug else ["--local-ranks-filter=0"]),
        *supported(
            f"--signals-to-handle={','.join(FORWARDED_SIGNALS)}", f"--shutdown-timeout={cfg.dist.shutdown_timeout_s}"
        ),
        "--module",
        module,
        *args,
    ]


@functools.cache
def _torchrun_options() -> frozenset[str]:
    from torch.distributed.run import get_args_parser

    return frozenset(o for action in get_args_parser()._actions for o in action.option_strings)


def supported(*flags: str) -> list[str]:
    """The flags this PyTorch's torchrun knows; each one it lacks is left out with a warning (an older PyTorch,
    e.g. a GPU image's own build, refuses the whole command on one unknown flag)."""
    known = _torchrun_options()
    kept = [flag for flag in flags if flag.split("=")[0] in known]
    for flag in flags:
        if flag not in kept:
            log.warning("torchrun of torch %s has no %s: launched without it", torch.__version__, flag.split("=")[0])
    return kept


def debug_variables(run: RunDir) -> dict[str, str]:
    """DEBUG=1: verbose NCCL and c10d, and NCCL's flight recorder dumped into the run folder on a timeout."""
    dump = str(run.flight_recorder / "rank_")
    return {
        "NCCL_DEBUG": "INFO",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "TORCH_CPP_LOG_LEVEL": "INFO",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # the name older releases read
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": dump,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump,
    }


_DETAIL_PROBE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
dist.destroy_process_group()
"""


def detail_debug_works() -> bool:
    """Whether DDP survives TORCH_DISTRIBUTED_DEBUG=DETAIL here: some builds (seen: 2.13 CPU wheels) segfault
    while logging DDP's construction, which would turn DEBUG=1 into a crash of every rank."""
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    probe = subprocess.run([sys.executable, "-c", _DETAIL_PROBE], env=env, capture_output=True, timeout=120)
    return probe.returncode == 0


def _first_error(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = (message or "").strip()
    if not message or message.startswith("To enable traceback"):
        return ""
    return message if len(message) <= 2000 else message[:2000] + " ..."


# Errors a rank raises for a cause it found itself (a bad setting, bad data, an unusable machine): never the
# consequence of another rank's failure, whatever the others died of afterwards. Read from the error file the
# rank recorded, because the agent may SIGTERM a rank still tearing down after such an error.
OWN_CAUSES = {cls.__name__: cls.exit_code for cls in (ConfigError, DataError, PreflightError, DiskFullError)}


def own_cause_code(failure) -> int | None:
    """The exit code of the config, data or preflight error this rank recorded, if it recorded one."""
    return OWN_CAUSES.get(_first_error(failure).split(":", 1)[0])


def describe_failure(rank: int, failure, hints: dict = SIGNAL_HINTS) -> str:
    """One line (or a few) per failed rank: exit code or signal, a hint, and its first recorded error."""
    error, own = _first_error(failure), own_cause_code(failure)
    if failure.exitcode < 0:
        sig = signal.Signals(-failure.exitcode)
        if own is not None:
            return f"rank {rank} failed with code {own}: {error}\n    (then killed by {sig.name} while shutting down)"
        hint = hints.get(sig, "")
        return f"rank {rank} was killed by {sig.name}{': ' + hint if hint else ''}"
    text = f"rank {rank} exited with code {failure.exitcode}{': ' + error if error else ''}"
    if "timed out" in error.lower() or "timeout" in error.lower():
        text += f"\n    hint: {TIMEOUT_HINT}"
    return text


def _blame_order(failure) -> int:
    """Root cause first. A rank that recorded a config, data or preflight error found the problem itself; so
    did a rank killed from outside (SIGKILL, SIGBUS, ...). Their peers' errors ("connection reset by peer") are
    consequences, and so is SIGABRT: gloo's teardown and NCCL's watchdog abort a rank after a peer has gone.
    SIGTERM is what the agent sends to the survivors, so it comes last."""
    if own_cause_code(failure) is not None:
        return 0
    if failure.exitcode < 0:
        return {signal.SIGABRT: 3, signal.SIGTERM: 4}.get(-failure.exitcode, 0)
    return 1 if os.path.isfile(failure.error_file) else 2


def exit_code_of(failure) -> int:
    """The rank's own code (that of the error it recorded, if it was killed while shutting down after it); a
    signal N becomes 128+N, as a shell reports it (137: SIGKILL, 135: SIGBUS)."""
    if failure.exitcode > 0:
        return failure.exitcode
    own = own_cause_code(failure)
    return own if own is not None else 128 - failure.exitcode


def _caller_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up from this one's (0), read off the frame."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a stack not that deep
        return "no_method_name"


def _name_rendezvous_events_cheaply() -> None:
    """torch's rendezvous names each of its events after the calling method with ``inspect.stack()``, which
    reads the source file of every frame on the stack and scans every loaded module for each: with torch
    imported, half a CPU second of every launch before the ranks start (measured: the launcher of a 2-rank
    tiny run 2.2 CPU seconds with it, 1.6 without). Same name, read off the frame."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = _caller_name


def launch(
    run: RunDir,
    nproc: int,
    cfg: Config,
    worker_args: list[str],
    module: str = "train.worker",
    address: str | None = None,
    resume_sha1: str | None = None,
    topology: Topology | None = None,
) -> None:
    """Run ``python -m MODULE --run-dir RUN --launch-record RECORD WORKER_ARGS`` on ``nproc`` local ranks; raise
    WorkerFailure on failure. ``address``: the address this node advertises to the others (several nodes);
    ``resume_sha1``: the checkpoint rank 0 must continue from (the launch plan's); ``topology``: where this node
    sits, as the launch session found it (default: asked of the launch target now)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as run_torchrun

    _name_rendezvous_events_cheaply()
    topology = topology or topology_from_environ(os.environ, cfg.run.name or run.root.name)
    debug = debug_enabled()
    _set_ranks_environ(run, cfg, topology, nproc, address, debug)
    live = sys.stderr.isatty()
    ranks_lock = run.lock_paths(topology.node_rank)[1]
    record = run.write_launch_record(topology.node_rank, ranks_lock, live and not debug, resume_sha1)
    rank_args = ["--run-dir", str(run.root), "--launch-record", str(record), *worker_args]
    argv = torchrun_argv(topology, nproc, cfg, run.logs / "torchrun", module, rank_args, debug, live, address)
    where = f"node {topology.node_rank} of {topology.nnodes} ({topology.source})" if topology.multi_node else "1 node"
    log.info("launching %d rank(s) on %s: torchrun %s", nproc, where, " ".join(argv))
    run.clear_preempted()
    # torchrun's agent turns signals into exceptions and leaves its handlers installed; put ours back.
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, name) for name in FORWARDED_SIGNALS)}
    freeze_imported()  # this process waits out the run with torch imported (train.heap)
    try:
        run_torchrun(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        _ranks_failed(e, run, cfg, topology, nproc, module, worker_args)
    except SignalException as e:
        if not run.preempted and _evaluating(run, cfg, module, worker_args):
            _stopped_while_evaluating(e.sigval)
        _stopped_by_signal(run, e.sigval, cfg)
    except RendezvousError as e:
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise DistributedError(
            f"the rendezvous at {topology.endpoint} (RDZV_ID={topology.run_id}) failed ({reason}). "
            f"A node never arrived within dist.timeout_s={cfg.dist.timeout_s}s: start the same command on all "
            f"{topology.nnodes} nodes (NNODES, NODE_RANK=0..{topology.nnodes - 1}, the same RDZV_ENDPOINT and "
            "RDZV_ID) and check that the first node's port is reachable from the others"
        ) from None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def stopped_with_checkpoint(failures: list) -> bool:
    """Whether the ranks stopped together after a checkpoint (a preemption, a store that stopped answering).
    A rank exits 75 only past the barrier that follows the checkpoint, so every rank saved; the agent may then
    SIGTERM the ranks still tearing down, which loses nothing."""
    codes = {f.exitcode for f in failures}
    return Preempted.exit_code in codes and codes <= {Preempted.exit_code, -int(signal.SIGTERM)}


def _ranks_failed(e, run: RunDir, cfg: Config, topology, nproc: int, module: str, worker_args: list[str]) -> None:
    """Ranks that failed, said as the project's error: a preemption (75), a stop during the final evaluation,
    or a WorkerFailure naming each rank's failure, the first to blame first, in the ranks' own numbering."""
    if run.preempted and stopped_with_checkpoint(list(e.failures.values())):
        why = run.preempted_reason() or "stopped by a signal"
        raise Preempted(f"{why}; checkpoint saved in {run.root}; re-run the same command to resume") from None
    stopped = {-f.exitcode for f in e.failures.values()} <= {int(s) for s in RANK_STOP_SIGNALS}
    if stopped and _evaluating(run, cfg, module, worker_args):
        _stopped_while_evaluating(signal.Signals(-next(iter(e.failures.values())).exitcode))
    failures = sorted(e.failures.items(), key=lambda item: (_blame_order(item[1]), item[1].timestamp, item[0]))
    # torchrun numbers ranks in the order the agents met; the ranks number themselves node by node
    ours = (lambda r, f: topology.node_rank * nproc + f.local_rank) if topology.multi_node else (lambda r, f: r)
    hints = dict(SIGNAL_HINTS)
    changed = run.changed_mapped_sources() if any(f.exitcode == -signal.SIGBUS for _, f in failures) else []
    if changed:  # not /dev/shm: a file the ranks read through a memory map changed under them
        hints[signal.SIGBUS] = f"a data file read through a memory map changed under it: {'; '.join(changed)}"
    lines = [describe_failure(ours(rank, failure), failure, hints) for rank, failure in failures]
    summary = f"{_what(module, worker_args)} failed:\n  " + "\n  ".join(lines) + f"\n  per-rank logs: {run.logs}"
    raise WorkerFailure(exit_code_of(failures[0][1]), summary) from None


def _set_ranks_environ(run: RunDir, cfg: Config, topology, nproc: int, address: str | None, debug: bool) -> None:
    """What the ranks inherit from this process's environment: their threads, the compiled-code cache, their
    console prefix, their node numbering and network, and DEBUG=1's variables."""
    # Ranks sharing a CPU must not each start one thread per core: that oversubscribes and crawls. The cores are
    # those this process may run on (a SLURM cpuset, a sweep's share of the machine), not all the machine's.
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(os.environ, cores, nproc)))
    # Compiled code (inductor's FX graph and autograd caches, Triton's kernels) beside the run's caches, not in a
    # temporary folder a reboot or a new container empties: a resumed run loads its step instead of compiling it.
    if not _CACHE_DIR_GIVEN:  # inductor itself sets the variable to its /tmp default once it has looked
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cfg.run.cache_dir).resolve() / COMPILED_CACHE)
    # Lines a rank prints (native crashes, NCCL) are prefixed with its global rank on the console.
    if topology.multi_node:
        # torchrun's ${rank} is its own numbering, not the ranks' (below): name the node and the local rank
        os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", f"[node{topology.node_rank}:${{local_rank}}]:")
        # The ranks number themselves node by node (train.distributed.env): rank 0 is on node 0, whose run folder
        # is the run's, whatever order the agents met in.
        os.environ.update(TRAIN_NODE_RANK=str(topology.node_rank), TRAIN_NNODES=str(topology.nnodes))
        for name, value in network_environ(address).items() if address else ():
            os.environ.setdefault(name, value)
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")
    if debug:
        for name, value in debug_variables(run).items():
            os.environ.setdefault(name, value)
        if os.environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and not detail_debug_works():
            log.warning(
                "TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DistributedDataParallel in this PyTorch build (a one-process "
                "probe died); using INFO instead. Set TORCH_DISTRIBUTED_DEBUG yourself to override."
            )
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
        run.flight_recorder.mkdir(parents=True, exist_ok=True)
        log.debug("environment: %s", redacted_environ(os.environ))


def _what(module: str, worker_args: list[str]) -> str:
    """What the ranks were doing, for the first line of a failure: training, evaluation or the smoke test."""
    if module == "train.smoke_worker":
        return "the smoke test"
    return "training" if "fit" in _stages(worker_args) else "evaluation"


def _stages(worker_args: list[str]) -> list[str]:
    return worker_args[worker_args.index("--stages") + 1].split(",") if "--stages" in worker_args else ["fit"]


def _evaluating(run: RunDir, cfg: Config, module: str, worker_args: list[str]) -> bool:
    """Whether the ranks were past training (evaluating, or writing the report) in this launch."""
    if module != "train.worker" or "evaluate" not in _stages(worker_args):
        return False
    return "fit" not in _stages(worker_args) or run.fit_is_done(cfg)


def _stopped_while_evaluating(sig: signal.Signals) -> None:
    """Evaluation keeps no state: a stop during it loses nothing, and the re-run evaluates (its report is written
    atomically, so none is left half-written). Exit 75, so a scheduler requeues it."""
    raise Preempted(
        f"stopped by {sig.name} during the evaluation, after training was complete; nothing is lost: re-run the same "
        "command to evaluate"
    ) from None


def _stopped_by_signal(run: RunDir, sig: signal.Signals, cfg: Config) -> None:
    if run.preempted:
        raise Preempted(f"stopped by {sig.name}, checkpoint saved in {run.root}; re-run the same command to resume")
    raise WorkerFailure(
        128 + int(sig),
        f"stopped by {sig.name}: the ranks were given dist.shutdown_timeout_s={cfg.dist.shutdown_timeout_s}s to "
        f"finish; re-running resumes from the newest checkpoint in {run.checkpoints}",
    )
