"""The ``dist`` section: processes per node, the process group, and how the model is spread over the ranks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from train.config.section import Section


class DistConfig(Section):
    nproc: int | Literal["auto"] = "auto"
    """Processes per node: auto = one per visible GPU, or cpu_nproc without GPUs."""
    cpu_nproc: int = Field(2, ge=1)
    """Processes launched by nproc=auto when no GPU is visible."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto = nccl on CUDA, gloo on CPU."""
    timeout_s: int = Field(300, ge=10)
    """Seconds a collective (or the rendezvous) may wait for a peer before failing with an error."""
    max_restarts: int = Field(0, ge=0)
    """Times torchrun restarts the whole group after a rank fails."""
    backend_fallback: bool = False
    """Allow falling back from nccl to gloo (with a loud warning) when NCCL is missing or fails to start;
    off by default, because a silent fall back to gloo trains many times slower."""
    shutdown_timeout_s: int = Field(120, ge=1)
    """Seconds the ranks get to stop (and save a checkpoint) after the launcher forwards a SIGTERM or SIGUSR1,
    before they are killed."""
    parallel: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """How the model is spread over the ranks (the table of strategies: train/strategies.py's STRATEGIES, with
    train/engine/parallel.py's PARALLEL adding how each wraps the model): 'ddp', a whole copy of weights,
    gradients and optimizer state on every rank; 'fsdp', each of them sharded over all ranks (FSDP2's fully_shard:
    about 1/ranks of the model state per rank, the weights gathered unit by unit for the forward and backward);
    'hsdp', sharded within groups of dist.shard_group_size ranks and replicated across the groups."""
    shard_group_size: int | None = Field(None, ge=1)
    """With hsdp: the ranks one copy of the model is sharded over (it must divide the world size); default: the
    ranks of one node, so that the gathers stay inside a node and only the gradient reduction crosses nodes."""
    checkpoint: Literal["auto", "sharded", "full"] = "auto"
    """How a sharded model (fsdp, hsdp) is checkpointed. 'sharded': every rank writes its own shards into one
    folder, step_NNNNNNNN.dcp (torch.distributed.checkpoint): no rank ever holds the whole model, and the save
    costs no gathers. 'full': the shards gathered onto rank 0's CPU and written as one .pt file, as under ddp.
    'auto': sharded where every rank writes into the one run folder (one node, or nodes sharing a file system),
    full across nodes with run folders of their own (a launch hands rank 0's checkpoint to the other nodes as
    one file). Either form resumes under any strategy and world size, and run.remote mirrors either (a folder
    packed as one file); `python -m train consolidate` turns a folder into one file."""
