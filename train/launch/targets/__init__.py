"""Where the launcher runs, as one table: each row an engine that starts it on every node of a job
(train.launch.targets.base.LaunchTarget says what a row answers). The launcher asks the table once which
engine it runs under (the first row that detects itself; a shell when no engine does) and passes the answer on;
rendering an engine's job asks that engine's row. Adding an engine is its row here and its own module.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping

from train.atomic import write_text_atomic
from train.config import Config
from train.errors import ConfigError
from train.launch.targets.base import LaunchTarget, Rendered
from train.launch.targets.kubernetes import Kubernetes
from train.launch.targets.local import Local
from train.launch.targets.skypilot import SkyPilot
from train.launch.targets.slurm import Slurm
from train.launch.topology import Topology

log = logging.getLogger(__name__)

# Most specific first: SkyPilot runs its tasks on Kubernetes and SLURM too, and says so in its own variables.
TARGETS: tuple[LaunchTarget, ...] = (SkyPilot(), Kubernetes(), Slurm(), Local())


def detect_target(environ: Mapping[str, str]) -> LaunchTarget:
    """The engine this process runs under: the first row that detects itself."""
    return next(t for t in TARGETS if t.detect(environ))


def target_named(name: str) -> LaunchTarget:
    for target in TARGETS:
        if target.name == name:
            return target
    raise ConfigError(f"no launch target {name!r}; the targets: {', '.join(t.name for t in TARGETS)}")


def topology_from_environ(environ: Mapping[str, str], run_name: str) -> Topology:
    """Where this node sits, as the engine it runs under says (explicit NNODES/NODE_RANK/... win)."""
    return detect_target(environ).topology(environ, run_name)


def write_job(target: LaunchTarget, cfg: Config, config_path: str, overrides: list[str], output: str | None) -> None:
    """Print ``target``'s job of ``cfg``, or write it to ``output`` (a script: executable)."""
    rendered: Rendered = target.render_job(cfg, config_path, overrides, output)
    if output is None:
        sys.stdout.write(rendered.text)
        return
    write_text_atomic(output, rendered.text)
    if rendered.executable:
        os.chmod(output, 0o755)
    log.info("wrote %s; submit it from the project directory with: %s %s", output, rendered.submit, shlex.quote(output))
