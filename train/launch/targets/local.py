"""A shell: the launcher started by hand (or by any tool) on each node, told where it sits by NNODES,
NODE_RANK, RDZV_ENDPOINT and RDZV_ID, or on one node with none of them. The row every other one falls back
to: it is detected always, and its engine says nothing of the nodes."""

from __future__ import annotations

from collections.abc import Mapping

from train.launch.targets.base import LaunchTarget


class Local(LaunchTarget):
    name, engine = "local", "environment"
    stop_signal = "SIGTERM"  # what `kill`, docker stop and most schedulers send; Ctrl-C and SIGHUP stop it too

    def detect(self, environ: Mapping[str, str]) -> bool:
        return True
