"""The launcher side of the smoke test: does distributed training work on this machine, in seconds?

``python -m train smoke`` launches one rank per visible GPU (or dist.cpu_nproc CPU processes) through the
same launcher as training; each rank runs train.smoke_worker's checks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from train.config import Config
from train.errors import TrainError
from train.launch.doctor import doctor
from train.launch.session import launch_session
from train.launch.torchrun import launch, resolve_nproc
from train.run_dir import RunDir

log = logging.getLogger(__name__)


def run_smoke(cfg: Config, nproc: str | int | None, *, compile_step: bool = True, preflight: bool = True) -> Path:
    """Launch the smoke test on this node; raises on any failed check. Returns the smoke run folder."""
    run = RunDir(Path(cfg.run.runs_dir) / "smoke")
    with launch_session(cfg, run) as session:
        if preflight:
            doctor(cfg, nproc, caches={}, quiet=True, data=False, rendezvous_held=session.hosts_rendezvous)
        run.prepare(cfg, same_run=False)  # any config may smoke-test; the folder keeps the last one
        start = time.perf_counter()
        n = resolve_nproc(nproc, cfg)
        session.ready_to_launch()
        error = None
        try:
            args = [] if compile_step else ["--skip-compile"]
            launch(run, n, cfg, args, module="train.smoke_worker", address=session.address, topology=session.topology)
        except TrainError as e:
            error = e
        session.conclude(error)
    log.info("smoke test passed in %.1f s; results in %s", time.perf_counter() - start, run.smoke_results)
    return run.root
