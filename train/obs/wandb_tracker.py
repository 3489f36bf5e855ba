"""The W&B tracker (a row of train.obs.tracking.TRACKERS): one W&B run per training run, continued by every launch
of it; a sweep's trials in the sweep's group."""

from __future__ import annotations

import logging
from pathlib import Path

from train.config import Config
from train.errors import PreflightError
from train.obs.tracking import Outcome

log = logging.getLogger(__name__)


def start(cfg: Config, run_root: Path, run_id: str) -> WandbTracker:
    import wandb

    settings = cfg.obs.wandb
    try:
        wb = wandb.init(
            project=settings.project,
            entity=settings.entity,
            group=settings.group,
            id=run_id,
            name=run_root.name if settings.group is None else f"{settings.group}-{run_root.name}",
            resume="allow",
            mode=settings.mode,
            dir=str(run_root),
            config=cfg.model_dump(mode="json"),
            settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False, silent=True),
        )
    except Exception as e:  # before any rank starts: nothing is lost by stopping here
        raise PreflightError(
            f"W&B could not start run {run_id} (obs.wandb.mode={settings.mode}, project {settings.project}): "
            f"{type(e).__name__}: {e}. Check WANDB_API_KEY (or `wandb login`) and the network, or set "
            "obs.wandb.mode=offline (sync later with `wandb sync`) or disabled"
        ) from None
    log.info(
        "W&B: run %s (%s, project %s%s)%s",
        run_id,
        settings.mode,
        settings.project,
        f", group {settings.group}" if settings.group else "",
        f" at {wb.url}" if settings.mode == "online" else "",
    )
    return WandbTracker(wb)


class WandbTracker:
    def __init__(self, wb):
        self.wb = wb

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.wb.log(scalars, step=step)

    def finish(self, outcome: Outcome, plots: dict[str, Path], step: int, preempted_at_step: int | None) -> None:
        import wandb

        if plots:
            self.wb.log({name: wandb.Image(str(png)) for name, png in plots.items()}, step=step)
        summary = {"outcome": outcome.state, "exit_code": outcome.exit_code}
        if outcome.error:
            summary["error"] = outcome.error
        if outcome.state == "preempted":
            summary["preempted_at_step"] = preempted_at_step
            self.wb.mark_preempting()
        self.wb.summary.update(summary)
        self.wb.finish(exit_code=outcome.exit_code)
        # finish() returns before W&B's service process has written the run's last records (an offline run file
        # could still be its 7-byte header); teardown waits for that process to end, so nothing of the run is
        # left in flight when the launcher exits (a container that stops with it would cut the write short).
        wandb.teardown()
