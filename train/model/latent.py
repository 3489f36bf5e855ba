"""Latent caches: a frozen encoder's output for every training input, precomputed into memory-mapped arrays.

When ``tasks.<name>.latent_encoder`` names a checkpoint, that checkpoint's encoder for the task is frozen:
its tokens for every training window (or sample) are computed once, here in the launcher, and stored
beside the data cache as one contiguous ``.npy`` file. Training then reads tokens instead of running the
encoder. Like the data cache it is opened with ``mmap_mode="r"`` by every rank and worker (one copy in the
page cache, nothing in /dev/shm), keyed by a hash of its inputs, and renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch

from train.atomic import atomic_dir, write_json_atomic
from train.checkpoint import CONFIG, MODEL, SPECS
from train.config import migrate_model_keys
from train.data.cache.cached_array import mapped_array
from train.data.cache.info import CacheInfo
from train.data.checksum import hash_file
from train.data.dataset import LATENT_FORMAT, MANIFEST, TOKENS, LatentInfo, training_dataset
from train.errors import ConfigError
from train.model.multitask import TaskCodec
from train.model.specs import TaskSpec

log = logging.getLogger(__name__)

ENCODER_KEYS = ("encode.weight", "encode.bias", "position")  # the codec's parameters that make tokens
_BLOCK_BYTES = 64 << 20


def frozen_encoder(checkpoint: Path, name: str, spec: TaskSpec, d_model: int, key: str) -> dict[str, torch.Tensor]:
    """The encoder parameters of task ``name`` in ``checkpoint``, checked against this run's task and model."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"{key}: '{checkpoint}' is not a readable checkpoint ({type(e).__name__}: {e})") from None
    specs, weights = state.get(SPECS, {}), state.get(MODEL, {})
    if name not in specs:
        raise ConfigError(
            f"{key}: checkpoint '{checkpoint}' has no task '{name}' (it has: {', '.join(sorted(specs)) or 'none'}); "
            f"name a checkpoint of a run that trained this task"
        )
    theirs, ours = (
        TaskSpec(
            **{
                **specs[name],
                "grid": tuple(specs[name]["grid"]),
                "boundary": tuple(map(tuple, specs[name].get("boundary", ()))),
            }
        ),
        spec,
    )
    differences = [
        f"{field} {getattr(theirs, field)} there, {getattr(ours, field)} here"
        for field in ours.__dataclass_fields__
        if getattr(theirs, field) != getattr(ours, field)
    ]
    their_width = migrate_model_keys(state.get(CONFIG, {}).get("model", {})).get("transformer", {}).get("d_model")
    if their_width != d_model:
        differences.append(f"model.transformer.d_model {their_width} there, {d_model} here")
    if differences:
        raise ConfigError(
            f"{key}: the encoder in '{checkpoint}' does not fit this run ({'; '.join(differences)}); "
            f"match the task's data settings and model.transformer.d_model to that run, or name another checkpoint"
        )
    return {k: weights[f"codecs.{name}.{k}"] for k in ENCODER_KEYS}


def build_latent_cache(
    name: str, info: CacheInfo, spec: TaskSpec, d_model: int, checkpoint: Path, key: str
) -> LatentInfo:
    """Return the latent cache of ``info``'s training split under the frozen encoder, building it if needed.

    The caller holds the cache root's :func:`train.data.cache.building_caches` lock.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise ConfigError(
            f"{key}: checkpoint '{checkpoint}' is no file; give the path of a .pt file of a run (a sharded "
            "checkpoint's .dcp folder becomes one with `python -m train consolidate`)"
        )
    encoder = frozen_encoder(checkpoint, name, spec, d_model, key)
    recipe = {
        "format": LATENT_FORMAT,
        "data": info.path.name,
        "initial_step": spec.initial_step if spec.autoregressive else None,
        "encoder": hash_file(checkpoint),
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    final = info.path.parent / f"latent-{digest}"
    found = LatentInfo.load(final)
    if found is not None:
        log.info("latent cache %s: up to date at %s", name, final)
        return found
    if final.exists():
        shutil.rmtree(final)
    with atomic_dir(final) as tmp:
        items, tokens = _write(tmp, info, spec, d_model, encoder)
        torch.save(encoder, tmp / "encoder.pt")
        manifest = {**recipe, "encoder": str(checkpoint.resolve()), "encoder_checksum": recipe["encoder"]}
        write_json_atomic(tmp / MANIFEST, {**manifest, "items": items, "tokens": tokens, "d_model": d_model})
    log.info(
        "latent cache %s: %d items x %d tokens x %d from %s -> %s", name, items, tokens, d_model, checkpoint, final
    )
    found = LatentInfo.load(final)
    assert found is not None
    return found


@torch.no_grad()
def _write(folder: Path, info: CacheInfo, spec: TaskSpec, d_model: int, encoder: dict) -> tuple[int, int]:
    codec = TaskCodec(spec, d_model)
    codec.load_state_dict(encoder, strict=False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    codec.to(device).eval()
    dataset = training_dataset(info, "train", spec.initial_step)
    tokens = codec.position.shape[1]
    out = mapped_array(folder / TOKENS, (len(dataset), tokens, d_model))
    step = max(1, _BLOCK_BYTES // (tokens * d_model * 4))
    for start in range(0, len(dataset), step):
        batch = dataset.__getitems__(range(start, min(start + step, len(dataset))))
        out[start : start + len(batch["x"])] = codec.tokens(batch["x"].to(device)).float().cpu().numpy()
    out.flush()
    return len(dataset), tokens
