"""``python -m train slurm``: an sbatch file rendered from the config's ``slurm`` section (the SLURM row of the
launch-target table renders its jobs and sweep arrays with it).

One SLURM task per node runs the launcher, which starts one rank per GPU on its node. The batch script
forwards the time-limit/preemption signal to the ranks (they checkpoint and exit 75), requeues the job on
that code, and always exits with the training's own status.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from dataclasses import dataclass

from train.config import Config, SlurmConfig
from train.errors import ConfigError

log = logging.getLogger(__name__)

# sbatch reads its #SBATCH lines with its own small parser: whitespace ends a value, quotes and backslashes
# are consumed, an unquoted '#' starts a comment. Values holding any of them would be cut or changed silently.
_SBATCH_BREAKING = re.compile(r"[\s'\"\\#]|[^\x20-\x7e]")
# minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
# SLURM checks time limits every 30 s and sends --signal's signal once it falls due before the next check: it can
# arrive up to 60 s earlier than asked. A requeued run then still needs a minute to resume and train, or every run
# is signalled while it starts and the job requeues forever.
SIGNAL_EARLY_S = 60
MIN_TRAINING_S = 60
# The rendezvous port is derived from the job id: below Linux's ephemeral range (32768+), so a client socket never
# holds it, and two jobs sharing a first node rarely collide.
PORT_BASE = 20000
PORT_SPAN = 10000
# A control character in a shell line ends the header comment early or splits a command.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

_HEADER = """\
#!/bin/bash
# Rendered from the config by:
#   {command}
# Submit it from the project directory (the job runs in the folder it was submitted from):
#   sbatch {submit}
# SLURM writes {output_note} in that folder.
"""

_BODY = """\
set -euo pipefail
cd "$SLURM_SUBMIT_DIR"

# Rendezvous of the per-node launchers on the first node. The port is derived from the job id, so jobs sharing
# a node do not collide. The launcher takes its node rank from each task's own SLURM_NODEID; a NODE_RANK
# inherited from the submitting shell would give every node the same rank.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail
export NNODES="$SLURM_NNODES"
export RDZV_ENDPOINT="$head_node:$(({port_base} + SLURM_JOB_ID % {port_span}))"
export RDZV_ID="$SLURM_JOB_ID"
unset NODE_RANK{cpu_only}

# SLURM sends SIGUSR1 to this script only (--signal=B:...); srun passes it on to the launchers, which pass it
# to the ranks: they save a checkpoint and exit with 75.
pid=""
interrupted=0
stopped=0
forward_usr1() {{
    interrupted=1
    stopped=1
    echo "received SIGUSR1 (time limit or preemption): forwarding to the ranks"
    if [[ -n $pid ]]; then kill -USR1 "$pid" 2>/dev/null || true; fi
}}
trap forward_usr1 USR1

{launch} &
pid=$!

# A trapped signal makes `wait` return early (status above 128) while srun runs on: wait again until srun's
# own status arrives. The `&& ... ||` form keeps `set -e` from ending the script on a failed training.
code=""
while [[ -z $code ]]; do
    interrupted=0
    wait "$pid" && code=0 || code=$?
    if (( interrupted && code > 128 )); then code=""; fi
done
# The signal reached the launcher before it could handle it, while it started (seen: SLURM's second delivery of a
# stop to an array task requeued a moment before): it died of it with nothing run, a stop like any other.
if (( stopped && code == 128 + $(kill -l USR1) )); then
    echo "the launcher was stopped by SIGUSR1 as it started: nothing ran"
    code=75
fi

{on_preempted}
exit "$code"
"""

_CPU_ONLY = """

# No GPU was requested: on a node that has some (without a device cgroup) the launcher must not see them and
# start GPU ranks; it starts CPU ranks instead.
export CUDA_VISIBLE_DEVICES=''"""

_REQUEUE = """\
if [[ $code -eq 75 ]]; then
    echo "stopped on request (exit 75, nothing lost): requeueing job $SLURM_JOB_ID to resume"
    scontrol requeue "$SLURM_JOB_ID" || echo "scontrol requeue failed: submit this script again to resume" >&2
fi"""

_NO_REQUEUE = """\
if [[ $code -eq 75 ]]; then
    echo "stopped on request (exit 75, nothing lost): submit this script again to resume"
fi"""


@dataclass(frozen=True)
class ArrayJob:
    """A job array whose tasks run another command than a single run (a sweep's workers)."""

    name: str
    """The job's name (--job-name)."""
    tasks: int
    """Array tasks in all (--array=0-<tasks - 1>)."""
    at_once: int
    """Tasks that run at the same time (--array=...%<at_once>)."""
    train_args: list[str]
    """The words after ``python -m train`` that each task runs."""
    rendered_by: str
    """The command line that renders this file, for its header."""


def _sbatch_value(key: str, value: object) -> str:
    text = str(value)
    if not text or _SBATCH_BREAKING.search(text):
        raise ConfigError(
            f"{key}={text!r} cannot go on an #SBATCH line: use no whitespace, quotes, backslashes, '#' or "
            f"non-ASCII characters"
        )
    return text


def _shell_word(key: str, value: str) -> str:
    if _CONTROL.search(value):
        raise ConfigError(f"{key}={value!r} contains a control character (a newline?), which a script cannot hold")
    return shlex.quote(value)


def time_limit_seconds(text: str) -> int | None:
    """The seconds of a SLURM time limit as SLURM enforces it (rounded up to whole minutes); None for no limit.

    Formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; UNLIMITED, infinite and 0 mean no limit.
    """
    if text.lower() in ("unlimited", "infinite"):
        return None
    match = _SLURM_TIME.fullmatch(text)
    if not match:
        raise ConfigError(
            f"slurm.time={text!r} is not a SLURM time limit: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
            f"D-HH:MM:SS, e.g. 24:00:00 or 2-00:00:00"
        )
    days, first, second, third = (int(g) if g is not None else None for g in match.groups())
    if days is not None:
        seconds = days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)
    elif third is not None:
        seconds = first * 3600 + second * 60 + third
    else:
        seconds = first * 60 + (second or 0)
    return -(-seconds // 60) * 60 or None


def _check_time_limit(s: SlurmConfig) -> None:
    limit = time_limit_seconds(s.time)
    need = s.preempt_signal_s + SIGNAL_EARLY_S + MIN_TRAINING_S
    if limit is None or limit >= need:
        return
    fixes = [f"Raise slurm.time to at least {-(-need // 60)} minutes ({_hms(need)})"]
    if limit - SIGNAL_EARLY_S - MIN_TRAINING_S >= 10:
        fixes.append(f"lower slurm.preempt_signal_s to at most {limit - SIGNAL_EARLY_S - MIN_TRAINING_S}")
    raise ConfigError(
        f"slurm.time={s.time} ({limit} s) is too short for slurm.preempt_signal_s={s.preempt_signal_s}: SLURM sends "
        f"SIGUSR1 preempt_signal_s before the time limit and up to {SIGNAL_EARLY_S} s earlier than that, and a "
        f"run needs at least {MIN_TRAINING_S} s of training before it, so the time limit must be at least "
        f"preempt_signal_s + {SIGNAL_EARLY_S + MIN_TRAINING_S} s; with less, every run is signalled as it starts "
        f"and the job requeues forever. " + " or ".join(fixes) + "."
    )


STOP_MARGIN_S = 30
"""Seconds beyond the ranks' stop and the remote's final uploads that a stop signal must leave before the time
limit: the launcher's own start of the stop and the scheduler's latency."""


def _check_stop_window(cfg: Config) -> None:
    """The warning before the time limit (slurm.preempt_signal_s) must leave the ranks time to stop with a
    checkpoint (dist.shutdown_timeout_s) and, with run.remote, the launcher time to upload it (run.remote_wait_s):
    otherwise SLURM kills the job at its limit while the checkpoint is being written or sent."""
    s, need = cfg.slurm, cfg.dist.shutdown_timeout_s + STOP_MARGIN_S
    parts = [f"dist.shutdown_timeout_s={cfg.dist.shutdown_timeout_s} for the ranks to checkpoint"]
    if cfg.run.remote:
        need += cfg.run.remote_wait_s
        parts.append(f"run.remote_wait_s={cfg.run.remote_wait_s} to send it to run.remote")
    if s.preempt_signal_s >= need:
        return
    raise ConfigError(
        f"slurm.preempt_signal_s={s.preempt_signal_s} leaves too little time after the stop signal: "
        + " and ".join(parts)
        + f", plus {STOP_MARGIN_S} s, need {need} s before SLURM kills the job at slurm.time; with less, the "
        "checkpoint of a time-limited job may never be written or reach the remote. Raise slurm.preempt_signal_s to "
        f"at least {need}, or lower dist.shutdown_timeout_s" + (" or run.remote_wait_s" if cfg.run.remote else "")
    )


def _hms(seconds: int) -> str:
    minutes = -(-seconds // 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def _cpus_per_task(cfg: Config) -> int:
    s = cfg.slurm
    if s.cpus_per_task is not None:
        return s.cpus_per_task
    if s.gpus_per_node:
        return s.gpus_per_node * s.cpus_per_gpu
    # CPU ranks, each with its DataLoader workers beside it
    ranks = cfg.dist.nproc if isinstance(cfg.dist.nproc, int) else cfg.dist.cpu_nproc
    return ranks * (cfg.train.num_workers + 1)


def _directives(cfg: Config, array: ArrayJob | None = None) -> list[str]:
    s = cfg.slurm
    _check_time_limit(s)
    _check_stop_window(cfg)
    name = _sbatch_value("sweep name", array.name) if array else _sbatch_value("run.name", cfg.run.name)
    options = [
        f"--job-name={name}",
        f"--nodes={s.nodes}",
        # One task per node: it runs the launcher, which starts one rank per GPU. One task per GPU would start
        # gpus_per_node launchers per node, each starting a rank on every GPU.
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={s.gpus_per_node}"] if s.gpus_per_node else []),
        f"--cpus-per-task={_cpus_per_task(cfg)}",
        f"--time={s.time}",
    ]
    if s.partition is not None:
        options.append(f"--partition={_sbatch_value('slurm.partition', s.partition)}")
    if s.account is not None:
        options.append(f"--account={_sbatch_value('slurm.account', s.account)}")
    options.append(f"--signal=B:USR1@{s.preempt_signal_s}")
    if s.requeue:
        options.append("--requeue")
    if array is not None:  # each task's output file: %A the array's job id, %a the task's index
        options += [f"--array=0-{array.tasks - 1}%{array.at_once}", "--open-mode=append", "--output=%x-%A_%a.out"]
    else:
        options += ["--open-mode=append", "--output=%x-%j.out"]
    for i, extra in enumerate(s.extra_sbatch):
        key = f"slurm.extra_sbatch[{i}]"
        if not extra.startswith("-"):
            raise ConfigError(f"{key}={extra!r} must be an sbatch option, e.g. --qos=high")
        options.append(_sbatch_value(key, extra))
    return [f"#SBATCH {option}" for option in options]


def _launch(cfg: Config, config_path: str, overrides: list[str], array: ArrayJob | None = None) -> str:
    s = cfg.slurm
    # srun takes its task count from the job's: with `#SBATCH --ntasks-per-node=2` edited into the header it would
    # ignore --ntasks-per-node=1 (with a warning) and start two launchers per node. --ntasks pins one per node.
    # Since SLURM 22.05 a step no longer inherits --cpus-per-task from the job: without it the launcher and
    # all its ranks would share one core.
    gpus = [f"--gpus-per-node={s.gpus_per_node}"] if s.gpus_per_node else []
    srun = [
        "srun",
        "--kill-on-bad-exit=1",
        '--ntasks="$SLURM_NNODES"',
        "--ntasks-per-node=1",
        *gpus,
        f"--cpus-per-task={_cpus_per_task(cfg)}",
    ]
    if array is not None:
        train = ["-m", "train", *(_shell_word("command", word) for word in array.train_args)]
    else:
        train = ["-m", "train", "run", "--config", _shell_word("config path", config_path)]
        train += ["--run", _shell_word("run.name", str(cfg.run.name))]
        for override in overrides:
            # slurm.* settings only shape this file; the run inside the job does not need them
            if not override.strip().startswith("slurm."):
                train += ["--set", _shell_word(f"override {override!r}", override)]
    if s.container == "none":
        # PYTHON may name the project's virtual environment on the shared file system
        lines = [srun, ['"${PYTHON:-python3}"', *train]]
    elif s.container == "pyxis":
        image = _shell_word("slurm.image", f"--container-image={s.image}")
        mounts = '--container-mounts="$SLURM_SUBMIT_DIR":/workspace'
        lines = [srun, [image, mounts, "--container-workdir=/workspace"], ["python3", *train]]
    else:
        image = _shell_word("slurm.image", str(s.image))
        bind = ["--bind", '"$SLURM_SUBMIT_DIR":/workspace', "--pwd", "/workspace"]
        nv = ["--nv"] if s.gpus_per_node else []  # binds the host's NVIDIA driver into the container
        lines = [srun, ["apptainer", "exec", *nv, *bind, image], ["python3", *train]]
    return " \\\n    ".join(" ".join(words) for words in lines)


def render_command(config_path: str, overrides: list[str], run_name: str | None, output: str | None) -> str:
    """The ``python -m train slurm`` command line that renders the same file."""
    words = ["python", "-m", "train", "slurm", "--config", _shell_word("config path", config_path)]
    if run_name is not None:
        words += ["--run", _shell_word("run.name", run_name)]
    for override in overrides:
        words += ["--set", _shell_word(f"override {override!r}", override)]
    if output is not None:
        words += ["--output", _shell_word("output path", output)]
    return " ".join(words)


def render_sbatch(
    cfg: Config, config_path: str, overrides: list[str], output: str | None = None, array: ArrayJob | None = None
) -> str:
    """The sbatch script of ``cfg``; ``output`` is only named in its header (where it is written to); ``array``
    makes it a job array whose tasks run ``array.train_args``."""
    # load_config names a run after its config file; any other name came from --run or the YAML and must be
    # on the command line in the header for it to reproduce this file.
    default_name = os.path.splitext(os.path.basename(config_path))[0]
    run_name = cfg.run.name if cfg.run.name != default_name else None
    submit = _shell_word("output path", output) if output is not None else "FILE  (python -m train slurm --output FILE)"
    command = array.rendered_by if array else render_command(config_path, overrides, run_name, output)
    output_note = (
        "each array task's output to <job name>-<array job id>_<task index>.out"
        if array
        else "the job's output to <job name>-<job id>.out"
    )
    header = _HEADER.format(command=command, submit=submit, output_note=output_note)
    body = _BODY.format(
        cpu_only=_CPU_ONLY if cfg.slurm.gpus_per_node == 0 else "",
        port_base=PORT_BASE,
        port_span=PORT_SPAN,
        launch=_launch(cfg, config_path, overrides, array),
        on_preempted=_REQUEUE if cfg.slurm.requeue else _NO_REQUEUE,
    )
    return header + "\n".join(_directives(cfg, array)) + "\n\n" + body
