"""The ``train`` and ``compile`` sections: optimisation, checkpoints, validation, logging and torch.compile."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from train.config.section import Section


class TrainConfig(Section):
    epochs: int = Field(10, ge=1)
    """Training epochs."""
    steps_per_epoch: int | None = Field(None, ge=1)
    """Optimizer steps per epoch; default: enough for one pass over the largest task's training windows."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(1e-4, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(50, ge=0)
    """Linear warm-up steps before the cosine decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes per rank (unused while the training data is on the device)."""
    data_on_device: bool | Literal["auto"] = "auto"
    """Copy each task's training arrays to every rank's device once and gather each step's batches there by index
    (no DataLoader, no per-batch host work or copy): true, false, or auto (on a GPU when they fit in
    data_on_device_share of its free memory; never on CPU). The same seed trains on the same batches either way;
    true on a device they do not fit is an error (exit 2)."""
    data_on_device_share: float = Field(0.5, gt=0, le=1)
    """The share of a device's free memory (at start-up) the training arrays may take on it; the rest is left to
    the model, its activations and the optimizer."""
    log_every: int = Field(20, ge=1)
    """Write a metrics line every n steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Step checkpoints kept (best.pt is kept besides them); older ones are deleted only after a newer one is
    safely written."""
    checkpoint_every: int | None = Field(None, ge=1)
    """Also checkpoint every n optimizer steps (mid-epoch); default: at the end of each epoch only."""
    find_unused_parameters: bool = False
    """Tell DDP that a step may leave some parameters without a gradient (a model whose forward skips parts of
    itself depending on the data). DDP then searches the autograd graph at every step, which costs time; set
    automatically when ranks draw different tasks (task_sampling=weighted) and the model leaves some task's
    parameters unused when another runs."""
    accept_changed_model_source: bool = False
    """Resume although the source file of a factory of your own (model.name=path.py:function) changed since the
    checkpoint was written; the saved weights are then loaded into the edited model as they are. By default such
    a resume is refused (exit 2): an edit that keeps every shape (GELU to ReLU) would otherwise continue
    silently as another model."""
    accept_changed_data: bool = False
    """Continue (or evaluate) a run whose checkpoints were trained on source files that have changed since (each
    checkpoint records the checksums of the files it was trained on). By default such a launch is refused
    (exit 3) naming the file and both checksums: a rewritten or replaced file would otherwise be trained on, and
    scored, without a word. train.resume=never starts over on the new data instead."""
    resume: str = "auto"
    """'auto': continue from the newest complete checkpoint of this run; 'never': start over (earlier
    checkpoints are moved to checkpoints/archive-<time>/, not deleted); or the path of a checkpoint to start
    from (used while this run has none of its own; its model config must match)."""
    init_from: str | None = None
    """Fine-tuning: start from another run's weights, given as a checkpoint file, a run folder (its best.pt, else
    its newest checkpoint) or a run's remote copy b2://bucket/prefix/<run name>. Only the weights come across:
    the optimizer, schedule, data and steps are this run's own. Parameters of tasks the source was not trained on
    start fresh; any other difference in names or shapes is an error naming the parameter. Used while this run
    has no checkpoint of its own (then it resumes from those). inputs.json and the report record the source."""
    freeze: list[str] = []
    """Parameters kept fixed during training, each given as a name prefix, e.g. ['processor.'] (the transformer's
    shared processor) or ['networks.advection1d.lift'], or as a group the model names (multiphysics: trunk,
    field_rows, patches, decoders); each must match a parameter."""
    lr_groups: dict[str, float] = {}
    """Learning-rate multipliers by parameter group (a name prefix or a group the model names), e.g.
    {trunk: 0.1}: those parameters learn at 0.1 x train.lr, the rest at train.lr, all on the one schedule; the
    first entry that matches a parameter applies. The usual fine-tuning recipe: the pretrained trunk about 10x
    slower than the embeddings and decoders (docs/models.md, 'Fine-tuning onto a new dataset')."""
    init_reset: dict[str, Literal["fresh", "zero"]] = {}
    """With train.init_from: parameter groups (name prefixes or groups the model names) that do not take the
    source's weights: 'fresh' keeps this run's new initialisation, 'zero' sets them to zero (the multi-physics
    model's output rows, field_out, zeroed start fine-tuning at "repeat the last frame", as training from scratch
    does, with the source's decoder projections kept; zero is refused where it would leave no gradient)."""
    eval_batch_size: int = Field(64, ge=1)
    """Samples per rank per evaluation batch."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Autocast precision: auto = bf16 on GPUs that support it (fp16 with a gradient scaler on older ones),
    fp32 on CPU; bf16 and fp16 may be asked for on CPU too."""
    accumulate_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step; gradients are synchronised only on the last (no_sync on the others),
    so the effective batch is batch_size x accumulate_steps x ranks."""
    task_sampling: Literal["all", "weighted"] = "all"
    """'all': every step trains one batch of every task (every head is used, DDP needs no unused-parameter
    search); 'weighted': each rank draws one task per micro-step with probability proportional to
    tasks.<name>.sampling_weight x (its training windows)^sampling_alpha, from (seed, draw group, epoch, step):
    under ddp every rank is its own draw group, so ranks train different tasks in the same step; under fsdp and
    hsdp the ranks of one shard group draw the same task."""
    sampling_alpha: float = Field(0.0, ge=0)
    """With task_sampling=weighted: the exponent of each task's size (its training windows) in its probability; 0
    ignores sizes (sampling_weight alone), 1 draws in proportion to size, between them flattens a mix toward its
    small sources (alpha = 1/temperature)."""
    held_out: list[str] = []
    """Datasets this run must not train on (a pretraining recipe's evaluation sets, kept for fine-tuning): a task
    of that name is refused (exit 2)."""
    val_every: int | None = Field(None, ge=1)
    """Validate every n optimizer steps (on every rank's shard, reduced); default: at the end of each epoch."""
    objective: Literal["one_step", "pushforward", "unrolled"] = "one_step"
    """How time-dependent tasks are trained (steady ones always predict their one output): 'one_step' predicts
    the next frame from true frames; 'pushforward' first rolls out a number of steps drawn from
    0..rollout_steps-1 without gradient, then trains one step from its own predictions (robust rollouts at
    about one step's cost); 'unrolled' backpropagates through rollout_steps predicted frames."""
    rollout_steps: int = Field(4, ge=2)
    """Frames predicted from one training window by pushforward (the most steps rolled out without gradient,
    plus one) and unrolled (the steps backpropagated through); one_step does not use it."""
    val_metric: Literal["rollout_nrmse", "loss"] = "rollout_nrmse"
    """What validation scores, and best.pt and early stopping follow: 'rollout_nrmse', the nRMSE of the whole
    autoregressive rollout on the val split (the test metric: a low one-step loss can still roll out badly);
    'loss', the one-step training loss. Both are logged. Tasks are weighed by loss_weight."""
    early_stop_patience: int | None = Field(None, ge=1)
    """Stop after this many validations in a row without improvement of the validation score (val_metric);
    every rank stops at the same step. Default: never stop early."""
    early_stop_min_delta: float = Field(0.0, ge=0)
    """A validation score counts as an improvement only when it is below the best by more than this."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What a NaN/Inf gradient does (detected after the all-reduce, so every rank agrees): 'stop' exits with
    an error and keeps the last good checkpoint; 'skip' drops that step's update."""
    max_skipped_steps: int = Field(10, ge=1)
    """Non-finite steps in a row tolerated (with on_nonfinite=skip, or fp16's loss scaling) before stopping."""


class CompileConfig(Section):
    enabled: bool | Literal["auto"] = "auto"
    """torch.compile the whole training step (rollout, loss, gradients and their all-reduce, clipping, AdamW;
    the model alone where a strategy or model rules that out): true, false, or auto (on with CUDA; off on CPU,
    where compiling a default-sized run costs about what it saves: docs/benchmarks.md, 'Compiled step')."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode. reduce-overhead replays the whole step as a CUDA graph with one process; with several,
    or where the model is compiled alone under DDP (whose gradient hooks a replayed CUDA graph would skip), the
    modes that capture CUDA graphs run as their graph-free variant (default, max-autotune-no-cudagraphs)."""
    backend: Literal["inductor", "aot_eager"] = "inductor"
    """The compiler behind torch.compile: inductor generates fused kernels (Triton on GPU, C++ on CPU); aot_eager
    traces the same graphs (rollout, backward, all-reduce, update) and runs them with PyTorch's own kernels. With no
    code generated it compiles in seconds and gains no speed: to tell a failing code generator from a step that
    does not hold as one graph, and to check a compiled run's graphs and its replay after a fault on CPU."""
    strict: bool = False
    """Stop (exit 2) when the step cannot be compiled whole (a graph break, named with its place) or compiling
    fails; by default a break compiles the model alone and a failing compiler runs the step eagerly, each with a
    warning."""
