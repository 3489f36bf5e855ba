"""The doctor: checks this machine against the config before a launch, so that what would hang or crash
(too small a /dev/shm, more ranks than GPUs, SLURM tasks that contradict the launch, a busy port, a full disk,
missing data) fails in a second with a one-line fix instead.

Every check is a function of plain facts (``Facts``), so tests can simulate GPUs and SLURM allocations.
"""

from __future__ import annotations

import logging
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

from train.config import Config
from train.data.cache.info import CacheInfo
from train.disk import human, unwritable
from train.errors import ConfigError, PreflightError, TrainError
from train.launch.address import advertised_address, is_public
from train.launch.capacity import (
    MiB,
    device_data_need,
    find_caches,
    model_state_per_rank,
    needs_by_filesystem,
    shm_need,
)
from train.launch.facts import FAIL, PASS, WARN, Check, Facts, backend_of, gather_facts, requested_nproc
from train.launch.targets import LaunchTarget, detect_target, topology_from_environ
from train.launch.topology import Topology, threads_per_rank
from train.stores import is_local, local_path
from train.stores.b2 import missing_b2_credentials

log = logging.getLogger(__name__)

DOCKER_DEFAULT_SHM = 64 * MiB  # what a container's /dev/shm is unless --shm-size, shm_size or ipc: host
DISK_MARGIN = 256 * MiB
"""Room beyond the estimate a disk must have: logs, metrics, reports and the estimate's own error."""


def check_threads(n: int, facts: Facts) -> Check | None:
    """Ranks x threads against the cores the machine's load leaves free: threads that wait for each other's
    turn on a busy machine make every step several times slower (seen: 2 threads at ~5 steps/s, 1 at ~33)."""
    if not facts.cores or facts.load is None:
        return None
    threads = threads_per_rank(facts.environ, facts.cores, n)
    free = max(0.0, facts.cores - facts.load)
    source = "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in facts.environ else "OMP_NUM_THREADS, set by the launcher"
    detail = (
        f"{n} rank(s) x {threads} thread(s) ({source}) on {facts.cores} core(s) with a load of {facts.load:.1f} "
        f"({free:.1f} free)"
    )
    if threads > 1 and n * threads > free + 0.5:
        return Check(
            "cpu threads",
            WARN,
            detail + ": the other processes leave fewer free cores than the threads asked for",
            "set OMP_NUM_THREADS=1 (or lower NPROC) while the machine is busy; threads that wait for a core slow "
            "every step (docs/launching.md, CPU threads)",
        )
    return Check("cpu threads", PASS, detail)


def check_versions(cfg: Config, facts: Facts) -> Check:
    detail = ", ".join(f"{k} {v or 'none'}" for k, v in facts.versions.items())
    if backend_of(cfg, facts) == "nccl" and (not facts.gpus or not facts.nccl_available):
        why = "no GPU is visible" if not facts.gpus else "this PyTorch build has no NCCL"
        status = WARN if cfg.dist.backend_fallback else FAIL
        return Check(
            "libraries",
            status,
            f"{detail}; backend nccl asked for but {why}",
            "use dist.backend=auto (or unset DDP_BACKEND), or install a CUDA build of PyTorch",
        )
    return Check("libraries", PASS, detail)


def check_container(facts: Facts) -> Check:
    return Check("container", PASS, facts.container or "not in a container")


def check_gpus(cfg: Config, nproc: str | int | None, facts: Facts) -> Check:
    n, how = requested_nproc(cfg, nproc, facts)
    if n is None:
        return Check("nproc vs GPUs", FAIL, how, "set NPROC=auto or a positive number")
    listed = facts.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in (listed or "").split(",") if d.strip()]
    if not facts.gpus:
        if devices:
            return Check(
                "nproc vs GPUs",
                WARN,
                f"CUDA_VISIBLE_DEVICES={listed} but PyTorch sees no GPU: {n} CPU process(es) with gloo",
                "check the driver (nvidia-smi), docker run --gpus all, and that PyTorch is a CUDA build",
            )
        return Check("nproc vs GPUs", PASS, f"no GPU: {n} CPU process(es) with gloo ({how})")
    if n > facts.gpus and backend_of(cfg, facts) != "gloo":
        return Check(
            "nproc vs GPUs",
            FAIL,
            f"nproc={n} but {facts.gpus} GPU(s) visible (CUDA_VISIBLE_DEVICES={listed or 'unset'}): the extra "
            "ranks would wait forever for GPUs that do not exist",
            f"use NPROC=auto or NPROC={facts.gpus}",
        )
    if devices and len(devices) != facts.gpus:
        return Check(
            "nproc vs GPUs",
            WARN,
            f"CUDA_VISIBLE_DEVICES lists {len(devices)} device(s), PyTorch sees {facts.gpus}",
            "fix CUDA_VISIBLE_DEVICES (indices that exist on this machine)",
        )
    if n < facts.gpus:
        return Check(
            "nproc vs GPUs",
            WARN,
            f"nproc={n} leaves {facts.gpus - n} of {facts.gpus} GPU(s) idle",
            "use NPROC=auto to train on all of them",
        )
    return Check("nproc vs GPUs", PASS, f"{n} rank(s), one per GPU ({how})")


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the rendezvous store binds: connections of a previous run in TIME_WAIT do not count as in use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def check_rendezvous(cfg: Config, facts: Facts, held: bool = False) -> tuple[Check, Topology | None]:
    """``held``: this launcher already hosts the store at the endpoint (a launch on node 0), so binding the port
    again would only find it busy."""
    try:
        topology = topology_from_environ(facts.environ, cfg.run.name or "run")
    except ConfigError as e:
        return Check("rendezvous", FAIL, str(e), "set NNODES, NODE_RANK and RDZV_ENDPOINT on every node"), None
    if not topology.multi_node:
        return Check("rendezvous", PASS, "one node: torchrun --standalone picks a free local port"), topology
    host, port = topology.host_port
    where = f"node {topology.node_rank} of {topology.nnodes}, c10d at {topology.endpoint} ({topology.source})"
    if held:
        return Check("rendezvous", PASS, f"{where}: hosted by this launcher"), topology
    if topology.node_rank == 0 and port_in_use(port):
        return Check(
            "rendezvous",
            FAIL,
            f"{where}: port {port} is already in use on this node",
            "stop what holds it (ss -ltnp) or pick another port in RDZV_ENDPOINT",
        ), topology
    try:
        resolved = socket.getaddrinfo(host, port)[0][4][0]
    except OSError as e:
        return Check(
            "rendezvous",
            FAIL,
            f"{where}: host {host!r} does not resolve ({e})",
            "set RDZV_ENDPOINT to the first node's address",
        ), topology
    return _exposure(where, resolved, facts, host, port), topology


def _exposure(where: str, endpoint: str, facts: Facts, host: str, port: int) -> Check:
    """A warning when the rendezvous, or the address this node advertises, is public: torch.distributed trusts
    whoever reaches its store and gloo/NCCL ports, and the launch plan travels through that store."""
    try:
        advertised = advertised_address(facts.environ, host, port)
    except ConfigError as e:
        return Check("rendezvous", FAIL, f"{where}: {e}", "set ADVERTISE_ADDR to this node's address on the network")
    public = [a for a in dict.fromkeys((endpoint, advertised)) if is_public(a)]
    if public:
        return Check(
            "rendezvous",
            WARN,
            f"{where}; advertises {advertised}: {', '.join(public)} is a public address, and anyone who reaches the "
            "rendezvous or gloo/NCCL ports can join or steer the run",
            "put the nodes on a private network or VPN and firewall the ports to the peers (docs/launching.md, "
            "several machines)",
        )
    return Check("rendezvous", PASS, f"{where}; this node advertises {advertised}")


def check_shm(cfg: Config, nproc: int, caches: Mapping[str, CacheInfo | None], facts: Facts) -> Check:
    need, how = shm_need(cfg, nproc, caches, backend_of(cfg, facts))
    fix = "docker run --shm-size=8g (compose: shm_size), or lower train.num_workers / batch sizes"
    if facts.shm is None:
        status = FAIL if need else PASS
        return Check("/dev/shm", status, f"no /dev/shm on this machine; this config needs {how}", fix if need else "")
    size, free = facts.shm
    have = f"{human(free)} free of {human(size)}"
    if need is None:
        return Check("/dev/shm", PASS, f"{have}; {how} (checked again at launch)")
    if free < need:
        return Check("/dev/shm", FAIL, f"{have}, this config needs {human(need)}: {how}", fix)
    if free < 2 * need:
        return Check("/dev/shm", WARN, f"{have}, little above the {human(need)} needed: {how}", fix)
    if size <= DOCKER_DEFAULT_SHM:
        # Enough for this config, but the size every container gets unless asked: the next change (workers,
        # GPUs) is a SIGBUS in a DataLoader worker (docs/troubleshooting.md). Say so now, while it is cheap to fix.
        return Check(
            "/dev/shm",
            WARN,
            f"{have}; needs {human(need)}, but this is Docker's 64 MB default: more DataLoader "
            "workers or NCCL across GPUs will exhaust it",
            fix,
        )
    return Check("/dev/shm", PASS, f"{have}; needs {human(need)}")


def check_device_data(cfg: Config, caches: Mapping[str, CacheInfo | None], facts: Facts) -> Check:
    """What train.data_on_device will take from each rank's device (or why it reads through the loader)."""
    setting, share = cfg.train.data_on_device, cfg.train.data_on_device_share
    need = device_data_need(cfg, caches)
    size = "their size is known once the caches are built" if need is None else f"{human(need)} per rank"
    if setting is False:
        return Check("data on device", PASS, "train.data_on_device=false: batches read through the loader")
    if not facts.gpus:
        where = "copied into each rank's host memory" if setting is True else "read through the loader"
        return Check("data on device", PASS, f"no GPU: the training arrays ({size}) are {where}")
    budget = share * facts.gpu_memory
    have = f"{human(budget)} (train.data_on_device_share={share} of the GPU's {human(facts.gpu_memory)})"
    if need is None:
        return Check("data on device", PASS, f"training arrays: {size}; they may take {have}")
    if need <= budget:
        return Check("data on device", PASS, f"training arrays on each GPU: {size} of {have}")
    fix = "set train.data_on_device=auto or false, or raise train.data_on_device_share"
    if setting is True:
        return Check("data on device", FAIL, f"training arrays take {size}, more than {have}", fix)
    return Check(
        "data on device",
        WARN,
        f"training arrays take {size}, more than {have}: read through the loader (slower)",
        "smaller or fewer tasks, or a larger train.data_on_device_share",
    )


def check_model_state(cfg: Config, nproc: int, facts: Facts) -> Check | None:
    """The model state (weights, gradients, AdamW's moments) one rank holds under dist.parallel, against the GPU's
    memory; None for a model of your own (its size is known once it is built)."""
    try:
        nodes = topology_from_environ(facts.environ, cfg.run.name or "run").nnodes
    except ConfigError:
        nodes = 1  # the rendezvous check says what is wrong with the settings
    per_rank, whole = model_state_per_rank(cfg, nproc * nodes, nproc)
    if not whole:
        return None
    strategy = cfg.dist.parallel
    detail = f"{human(per_rank)} of weights, gradients and AdamW state per rank under dist.parallel={strategy}"
    if strategy != "ddp":
        detail += f" ({human(whole)} under ddp)"
    if not facts.gpus or per_rank <= 0.5 * facts.gpu_memory:
        return Check("model state", PASS, detail + ("" if facts.gpus else "; no GPU"))
    fix = "dist.parallel=fsdp (or hsdp across nodes) shards it over the ranks" if strategy == "ddp" else "more ranks"
    status = FAIL if per_rank > facts.gpu_memory else WARN
    return Check(
        "model state", status, f"{detail}, of the GPU's {human(facts.gpu_memory)} (activations come on top)", fix
    )


def check_stop_window(cfg: Config, target: LaunchTarget) -> Check | None:
    """The time the engine leaves between its stop signal and the kill, against what a stop may take: the ranks'
    checkpoint (dist.shutdown_timeout_s) and, with a remote, its upload (run.remote_wait_s). None where the engine
    fixes no such time."""
    grace = target.grace_s(cfg)
    if grace is None:
        return None
    need = cfg.dist.shutdown_timeout_s + (cfg.run.remote_wait_s if cfg.run.remote else 0)
    upload = f" and run.remote_wait_s={cfg.run.remote_wait_s} s to send it" if cfg.run.remote else ""
    detail = (
        f"{target.engine} kills {grace} s after its {target.stop_signal}; the ranks may take "
        f"dist.shutdown_timeout_s={cfg.dist.shutdown_timeout_s} s to save a checkpoint{upload}"
    )
    if grace < need:
        fix = (
            "lower dist.shutdown_timeout_s (and run.remote_wait_s) to fit, or checkpoint more often "
            "(train.checkpoint_every): what the kill cuts short is the training since the last checkpoint"
        )
        return Check("stop window", WARN, detail, fix)
    return Check("stop window", PASS, detail)


def check_memlock(facts: Facts, topology: Topology | None) -> Check:
    if facts.memlock == -1:
        return Check("memlock", PASS, "unlimited")
    detail = f"locked-memory limit {human(facts.memlock)}"
    if facts.gpus and topology is not None and topology.multi_node:
        return Check(
            "memlock",
            WARN,
            f"{detail}: InfiniBand/RDMA transports need it unlimited",
            "docker run --ulimit memlock=-1 (compose: ulimits), or memlock unlimited in limits.conf",
        )
    return Check("memlock", PASS, f"{detail} (only RDMA across nodes needs more)")


def check_data(cfg: Config, facts: Facts) -> Check:
    """Each task's source, without touching the network: missing files or credentials fail here, not mid-run."""
    from train.data.acquire import download

    missing, notes = [], []
    for name, task in cfg.tasks.items():
        source = task.location
        if source == "generate":
            notes.append(f"{name}: generated locally")
        elif source.startswith(("https://", "http://")):
            how = "a shard set, streamed" if cfg.streamed(name) else "downloaded over HTTPS"
            notes.append(f"{name}: {source} ({how})")
        elif source.startswith("s3://"):
            endpoint = facts.environ.get("AWS_ENDPOINT_URL_S3") or facts.environ.get("AWS_ENDPOINT_URL")
            notes.append(f"{name}: {source} (S3-compatible, {endpoint or 'Amazon S3'}; boto3's credentials)")
        elif source.startswith("b2://"):
            credentials = not missing_b2_credentials(facts.environ)
            earlier = download.read_manifest(Path(cfg.run.data_dir) / name)
            if credentials or earlier:
                notes.append(f"{name}: {source} ({'credentials set' if credentials else 'downloaded earlier'})")
            else:
                missing.append(f"{name}: {source} needs B2_APPLICATION_KEY_ID and B2_APPLICATION_KEY")
        else:
            path = local_path(source)
            (notes if path.exists() else missing).append(f"{name}: {path}{'' if path.exists() else ' not found'}")
    if missing:
        return Check("data", FAIL, "; ".join(missing), "fix tasks.<name>.source, or export the B2 credentials")
    return Check("data", PASS, "; ".join(notes))


def check_disk(cfg: Config, caches: Mapping[str, CacheInfo | None]) -> Check:
    """Free space where checkpoints and missing caches go (a cache takes about its source file's size)."""
    details, status = [], PASS
    for root, need, folders in needs_by_filesystem(cfg, caches):
        free = shutil.disk_usage(root).free
        details.append(
            f"{human(free)} free for {', '.join(folders)} (needs about {human(need)} + a {human(DISK_MARGIN)} margin)"
        )
        if free < need + DISK_MARGIN:
            status = FAIL
        elif free < 2 * need + 1024 * MiB and status == PASS:
            status = WARN
    fix = "free space, or point run.runs_dir / run.cache_dir / run.data_dir at a bigger disk"
    return Check("disk", status, "; ".join(details), fix)


def folders_to_write(cfg: Config, command: str = "run") -> dict[str, Path]:
    """The folders ``command`` writes into, by setting: data_dir where a task generates or downloads its data
    (local files are read where they lie), cache_dir from the cache stage on, runs_dir for a launch."""
    fetched = any(task.source == "generate" or not is_local(task.source) for task in cfg.tasks.values())
    wanted = {"run.data_dir": fetched, "run.cache_dir": command != "data", "run.runs_dir": command not in DATA_ONLY}
    return {setting: Path(getattr(cfg.run, setting.split(".")[1])) for setting, want in wanted.items() if want}


DATA_ONLY = ("data", "cache")


def unwritable_folders(cfg: Config, command: str = "run") -> list[str]:
    """``setting=folder: why`` for each folder ``command`` would write into but cannot (a real probe write)."""
    problems = []
    for setting, folder in folders_to_write(cfg, command).items():
        why = unwritable(folder)
        if why is not None:
            problems.append(f"{setting}={folder}: {why}")
    return problems


def check_folders(cfg: Config) -> Check:
    problems = unwritable_folders(cfg)
    fix = "point the setting at a writable folder (a read-only mount, or another user's folder, cannot hold it)"
    if problems:
        return Check("folders", FAIL, "cannot write " + "; ".join(problems), fix)
    return Check("folders", PASS, "writable: " + ", ".join(f"{k}={v}" for k, v in folders_to_write(cfg).items()))


def require_writable_folders(cfg: Config, command: str) -> None:
    """Before a stage writes: a folder it cannot write to stops it (exit 4) naming the setting, not an OSError."""
    problems = unwritable_folders(cfg, command)
    if problems:
        raise PreflightError(
            "cannot write " + "; ".join(problems) + ". Point the setting at a writable folder (--set "
            "run.runs_dir=..., run.cache_dir=..., run.data_dir=...)"
        )


def check_remote(cfg: Config, b2_api=None) -> Check | None:
    """Whether run.remote answers with the credentials at hand (`make doctor` only: it asks the network), and
    what it holds of this run."""
    if not cfg.run.remote:
        return None
    from train.remote.pointer import read_pointer
    from train.remote.store import open_remote

    try:
        remote = open_remote(cfg.run.remote, cfg.run.name or "run", b2_api)
        pointer = read_pointer(remote) or {}
    except TrainError as e:
        fix = "check run.remote and, for b2://, B2_APPLICATION_KEY_ID / B2_APPLICATION_KEY (a key that can write)"
        return Check("remote", FAIL, str(e), fix)
    if not pointer.get("checkpoint"):
        return Check("remote", PASS, f"{remote.url}: reachable, no checkpoint yet")
    if pointer.get("rebuilt"):  # the SHA1s of a rebuilt pointer are of whatever bytes lie there
        return Check(
            "remote",
            WARN,
            f"{remote.url}: reachable, newest checkpoint {pointer['checkpoint']} NOT verified: its pointer cannot be "
            f"read ({pointer['rebuilt']}) and was rebuilt from the files the remote lists",
            "the next launch checks each listed checkpoint against the checksum written into it, resumes from the "
            "newest intact one and writes the pointer back",
        )
    name = pointer["checkpoint"]
    listed = next((e for e in pointer.get("kept", []) if e.get("name") == name), {})
    try:  # B2 keeps each file's SHA1; a folder's is read from its bytes
        there = remote.stat(f"checkpoints/{name}")
    except TrainError as e:
        return Check("remote", WARN, f"{remote.url}: reachable, newest checkpoint {name} listed (not checked: {e})")
    if there is None or (there.sha1 and listed.get("sha1") and there.sha1 != listed["sha1"]):
        what = (
            "is missing" if there is None else f"has SHA1 {there.sha1}, not the {listed['sha1']} verified after upload"
        )
        return Check(
            "remote",
            WARN,
            f"{remote.url}: reachable, but its newest listed checkpoint {name} {what}",
            "a launch that needs it (a new machine) skips it and resumes from the newest intact one the pointer lists",
        )
    state = "verified (its SHA1 matches the upload's)" if there.sha1 and listed.get("sha1") else "listed"
    return Check("remote", PASS, f"{remote.url}: reachable, newest checkpoint {name} {state}")


def run_checks(
    cfg: Config,
    nproc: str | int | None,
    facts: Facts,
    caches: Mapping[str, CacheInfo | None],
    data: bool = True,
    rendezvous_held: bool = False,
) -> list[Check]:
    rendezvous, topology = check_rendezvous(cfg, facts, rendezvous_held)
    n, _ = requested_nproc(cfg, nproc, facts)
    checks = [check_versions(cfg, facts), check_container(facts), check_gpus(cfg, nproc, facts)]
    target = detect_target(facts.environ)
    checks += target.checks(cfg, nproc, facts)
    checks += [c for c in [check_stop_window(cfg, target)] if c is not None]
    checks += [rendezvous, check_shm(cfg, n or 1, caches, facts), check_folders(cfg), check_disk(cfg, caches)]
    checks += [c for c in [check_threads(n or 1, facts)] if c is not None]
    checks.append(check_device_data(cfg, caches, facts))
    checks += [c for c in [check_model_state(cfg, n or 1, facts)] if c is not None]
    checks += [check_data(cfg, facts)] if data else []
    checks += [c for c in [check_remote(cfg)] if c is not None] if data else []
    checks.append(check_memlock(facts, topology))
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"  {c.status.upper():4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != PASS:
            lines.append(f"  {'':4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def doctor(
    cfg: Config,
    nproc: str | int | None,
    caches: Mapping[str, CacheInfo | None] | None = None,
    facts: Facts | None = None,
    quiet: bool = False,
    data: bool = True,
    rendezvous_held: bool = False,
) -> list[Check]:
    """Run every check and print the table (logged instead when ``quiet``); raise PreflightError on a fail.

    ``data=False`` leaves out the data check: the smoke test needs none, and before a launch the data stage
    itself reports a missing file (exit 3) right after. ``rendezvous_held``: see ``check_rendezvous``."""
    facts = facts or gather_facts()
    checks = run_checks(cfg, nproc, facts, find_caches(cfg) if caches is None else caches, data, rendezvous_held)
    table = render(checks)
    if quiet:
        log.info("preflight checks:\n%s", table)
    else:
        print(f"doctor: {cfg.run.name or 'config'} on {socket.gethostname()}\n{table}")
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        raise PreflightError(
            f"preflight failed ({', '.join(failed)}): a launch would hang or crash; see the fixes above "
            "(skip the checks with --skip-doctor or SKIP_DOCTOR=1)"
        )
    return checks


def check_shm_at_launch(cfg: Config, nproc: int, caches: Mapping[str, CacheInfo | None]) -> None:
    """The /dev/shm check again, sized from the caches just built (the doctor may have run before them)."""
    check = check_shm(cfg, nproc, caches, gather_facts())
    if check.status == FAIL:
        raise PreflightError(f"/dev/shm: {check.detail}; fix: {check.fix} (or skip the checks with --skip-doctor)")
    if check.status == WARN:
        log.warning("/dev/shm: %s; %s", check.detail, check.fix)
