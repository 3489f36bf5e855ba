"""A launch target: one engine that starts the package's launcher on every node of a job (a shell, SLURM,
SkyPilot, Kubernetes), as one row of ``train.launch.targets.TARGETS``.

A row answers, for its engine: whether this process runs under it (``detect``, from the environment), where the
node sits (``placement``: nodes, this node's rank, the first node's address, the job's id, from the engine's own
variables), the doctor's checks of what the engine granted, the signal the engine sends before it takes a node
and how long it waits before it kills, and where the engine has one, the job it runs (``render_job``) and the
sweep array (``render_array``) rendered from the config, with the config section that holds its settings.
Everything else of a launch is the same on every engine, and nothing outside ``train.launch.targets`` asks which
engine it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from train.config import Config
from train.errors import ConfigError
from train.launch.facts import Check, Facts
from train.launch.topology import Topology
from train.stores import is_local

STORE_KEYS = {  # the variables a run's remote needs, by scheme: secrets a job is given, never written into it
    "b2": ("B2_APPLICATION_KEY_ID", "B2_APPLICATION_KEY"),
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"),
}


@dataclass(frozen=True)
class Placement:
    """What an engine's variables say of this node; None where they say nothing."""

    nnodes: int | None = None
    node_rank: int | None = None
    endpoint: str | None = None
    """host:port of the rendezvous on the first node."""
    run_id: str | None = None
    """The rendezvous id: the same on every node of one job."""


@dataclass(frozen=True)
class Rendered:
    """A job file rendered for an engine: its text, how to submit it, and whether it is a script to mark
    executable."""

    text: str
    submit: str
    executable: bool = False


class LaunchTarget:
    """One row of the launch-target table; the defaults are an engine with nothing to say."""

    name: str = ""
    """The row's name: the command that renders its job (``python -m train <name>``), and the docs' word."""
    engine: str = ""
    """How messages name the engine."""
    section: str | None = None
    """The config section of the engine's settings (None: it has none)."""
    stop_signal: str = "SIGTERM"
    """What the engine sends the launcher before it takes the node (a preemption, a time limit, a cancel)."""
    docs: str = "docs/launching.md"
    renders: str | None = None
    """What ``python -m train <name>`` renders (its help); None: the engine has no job file."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def placement(self, environ: Mapping[str, str]) -> Placement:
        return Placement()

    def grace_s(self, cfg: Config) -> int | None:
        """Seconds from the stop signal to the kill, where the engine fixes them; None: the user's to say."""
        return None

    def checks(self, cfg: Config, nproc: str | int | None, facts: Facts) -> list[Check]:
        """The doctor's checks of what the engine granted this node (``nproc``: the launch's setting)."""
        return []

    def render_job(self, cfg: Config, config_path: str, overrides: list[str], output: str | None) -> Rendered:
        """The engine's job for ``cfg`` (loaded from ``config_path`` with ``overrides``); ``output``: where it
        will be written, for its header."""
        raise ConfigError(f"{self.engine} has no job file to render; see {self.docs}")

    def render_array(self, cfg: Config, config_path: str, overrides: list[str], output: str, array) -> Rendered:
        """The engine's job array of a sweep (``array``: train.launch.targets.sbatch.ArrayJob)."""
        raise ConfigError(f"{self.engine} runs no sweep arrays; see {self.docs}")

    def topology(self, environ: Mapping[str, str], run_name: str) -> Topology:
        """Where this node sits: the variables a user sets by hand on each node (NNODES, NODE_RANK, RDZV_ENDPOINT,
        RDZV_ID) where set, else the engine's; one node when neither says more."""
        engine = self.placement(environ)
        nnodes = env_int(environ, "NNODES")
        source = "environment" if nnodes is not None else self.engine
        nnodes = engine.nnodes if nnodes is None else nnodes
        if nnodes is None or nnodes == 1:
            return Topology(1, 0, None, run_name, "single node")
        if nnodes < 1:
            raise ConfigError(f"NNODES={nnodes} must be at least 1")
        node_rank = env_int(environ, "NODE_RANK")
        node_rank = engine.node_rank if node_rank is None else node_rank
        if node_rank is None:
            raise ConfigError(f"NNODES={nnodes} but NODE_RANK is not set: set NODE_RANK=0..{nnodes - 1} on each node")
        if not 0 <= node_rank < nnodes:
            raise ConfigError(f"NODE_RANK={node_rank} is outside 0..{nnodes - 1} (NNODES={nnodes})")
        endpoint = environ.get("RDZV_ENDPOINT", "").strip() or engine.endpoint
        if not endpoint:
            raise ConfigError(
                f"NNODES={nnodes} needs RDZV_ENDPOINT=host:port, the address of the first node (NODE_RANK=0), "
                "reachable from every node"
            )
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"RDZV_ENDPOINT={endpoint!r} must be host:port, e.g. node01:29400")
        run_id = environ.get("RDZV_ID") or engine.run_id or run_name
        return Topology(nnodes, node_rank, endpoint, run_id, source)


def env_int(environ: Mapping[str, str], name: str) -> int | None:
    """An integer variable, or None where it is unset; a malformed one is a ConfigError naming it."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer") from None


def store_keys(remote: str | None) -> tuple[str, ...]:
    """The secrets a run's remote store reads from the environment (none for a folder or HTTPS)."""
    return STORE_KEYS.get((remote or "").partition("://")[0], ())


def launch_words(cfg: Config, config_path: str, overrides: list[str], engine_sections: tuple[str, ...]) -> list[str]:
    """``python -m train run`` of the config with its overrides, less those that only shape the job file."""
    words = ["python", "-m", "train", "run", "--config", config_path, "--run", str(cfg.run.name)]
    for override in overrides:
        if not override.strip().startswith(tuple(f"{s}." for s in engine_sections)):
            words += ["--set", override]
    return words


def require_remote(cfg: Config, engine: str, why: str) -> None:
    """A job an engine relaunches on new machines resumes only from run.remote: refuse one without (exit 2)."""
    if cfg.run.remote is None or is_local(cfg.run.remote):
        where = "no run.remote" if cfg.run.remote is None else f"run.remote={cfg.run.remote} (a local folder)"
        raise ConfigError(
            f"{engine}: {where}; {why}, so its checkpoints must be in a bucket: set run.remote=b2://bucket/prefix "
            "(docs/remote-runs.md)"
        )
