"""Tests of latent caches: a frozen encoder's tokens precomputed into memory-mapped arrays."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from train.checkpoint import save_checkpoint
from train.config import TaskConfig, TransformerConfig
from train.data.acquire.generate import generate
from train.data.cache.build import build_cache
from train.data.dataset import LatentDataset, training_dataset
from train.errors import ConfigError
from train.model.latent import LatentInfo, build_latent_cache
from train.model.multitask import MultiTaskSurrogate
from train.model.specs import TaskSpec

CFG = TransformerConfig(d_model=16, n_heads=2, n_layers=1)
KEY = "tasks.t.latent_encoder"


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("latent")
    generate("advection1d", tmp / "adv.h5", n_samples=20, resolution=32, coefficient=0.1, seed=0)
    generate("darcy2d", tmp / "darcy.h5", n_samples=20, resolution=16, coefficient=1.0, seed=0)
    adv = build_cache("adv", TaskConfig(pde="advection1d", temporal_stride=20, initial_step=3), tmp / "adv.h5", tmp)
    darcy = build_cache("darcy", TaskConfig(pde="darcy2d"), tmp / "darcy.h5", tmp)
    specs = {
        "adv": TaskSpec(adv.grid, 1, 1, patch_size=4, initial_step=3, autoregressive=True),
        "darcy": TaskSpec(darcy.grid, 1, 1, patch_size=4, initial_step=3, autoregressive=False),
    }
    return tmp, {"adv": adv, "darcy": darcy}, specs


def checkpoint(tmp_path, specs, seed=0, d_model=CFG.d_model):
    torch.manual_seed(seed)
    cfg = CFG.model_copy(update={"d_model": d_model})
    model = MultiTaskSurrogate(specs, cfg)
    state = {
        "model": model.state_dict(),
        "specs": {name: spec.as_dict() for name, spec in specs.items()},
        "config": {"model": {"transformer": cfg.model_dump(mode="json")}},
    }
    return save_checkpoint(tmp_path / f"ckpt{seed}", 1, state, keep=1), model


@pytest.mark.parametrize("name", ["adv", "darcy"])
def test_latents_are_the_encoders_tokens_of_every_training_item(tmp_path, caches, name):
    _, infos, specs = caches
    path, model = checkpoint(tmp_path, specs)
    latent = build_latent_cache(name, infos[name], specs[name], CFG.d_model, path, KEY)
    base = training_dataset(infos[name], "train", specs[name].initial_step)
    z = np.load(latent.file, mmap_mode="r")
    assert z.shape == (len(base), latent.tokens, CFG.d_model) and latent.items == len(base)
    rows = [0, 5, len(base) - 1]
    with torch.no_grad():
        expected = model.codecs[name].tokens(base.__getitems__(rows)["x"])
    torch.testing.assert_close(torch.from_numpy(z[rows]), expected, rtol=1e-5, atol=1e-5)
    ds = LatentDataset(base, latent.file)
    batch = ds.__getitems__(rows)
    assert set(batch) == {"x", "y", "z"}
    torch.testing.assert_close(batch["z"], expected, rtol=1e-5, atol=1e-5)
    assert len(pickle.dumps(ds)) < 2000  # paths only: nothing large goes to DataLoader workers


def test_model_on_latents_equals_model_on_fields_with_the_frozen_encoder(tmp_path, caches):
    _, infos, specs = caches
    path, trained = checkpoint(tmp_path, specs, seed=1)
    latent = build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, path, KEY)
    torch.manual_seed(7)  # a fresh model, as a new run builds it
    model = MultiTaskSurrogate(specs, CFG).eval()
    model.freeze_encoder("adv", latent.encoder_state())
    assert not model.codecs["adv"].encode.weight.requires_grad and not model.codecs["adv"].position.requires_grad
    assert model.codecs["adv"].decode[1].weight.requires_grad and model.codecs["darcy"].encode.weight.requires_grad
    torch.testing.assert_close(model.codecs["adv"].encode.weight, trained.codecs["adv"].encode.weight)
    batch = LatentDataset(training_dataset(infos["adv"], "train", 3), latent.file).__getitems__([1, 2])
    with torch.no_grad():
        on_fields = model({"adv": batch["x"]})["adv"]
        on_latents = model({"adv": batch["x"]}, {"adv": batch["z"]})["adv"]
    torch.testing.assert_close(on_latents, on_fields, rtol=1e-5, atol=1e-5)


def test_latent_cache_is_reused_and_follows_the_encoder(tmp_path, caches):
    _, infos, specs = caches
    path, _ = checkpoint(tmp_path, specs, seed=0)
    first = build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, path, KEY)
    mtime = first.file.stat().st_mtime_ns
    again = build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, path, KEY)
    assert again == first and first.file.stat().st_mtime_ns == mtime
    other, _ = checkpoint(tmp_path, specs, seed=2)
    changed = build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, other, KEY)
    assert changed.path != first.path and LatentInfo.load(first.path) == first
    assert not np.array_equal(np.load(changed.file), np.load(first.file))


def test_incomplete_latent_cache_is_rebuilt(tmp_path, caches):
    _, infos, specs = caches
    path, _ = checkpoint(tmp_path, specs, seed=3)
    first = build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, path, KEY)
    (first.path / "manifest.json").unlink()
    assert LatentInfo.load(first.path) is None
    assert build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, path, KEY) == first


@pytest.mark.parametrize(
    ("change", "message"),
    [({"patch_size": 8}, "patch_size 4 there, 8 here"), ({"initial_step": 2}, "initial_step 3 there, 2 here")],
)
def test_encoder_of_another_task_shape_is_refused(tmp_path, caches, change, message):
    _, infos, specs = caches
    path, _ = checkpoint(tmp_path, specs)
    ours = TaskSpec(**{**specs["adv"].as_dict(), **change})
    with pytest.raises(ConfigError, match=message) as e:
        build_latent_cache("adv", infos["adv"], ours, CFG.d_model, path, KEY)
    assert KEY in str(e.value)


def test_encoder_of_another_width_is_refused(tmp_path, caches):
    _, infos, specs = caches
    path, _ = checkpoint(tmp_path, specs, d_model=32)
    with pytest.raises(ConfigError, match=r"model\.transformer\.d_model 32 there, 16 here"):
        build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, path, KEY)


def test_checkpoint_without_the_task_names_the_tasks_it_has(tmp_path, caches):
    _, infos, specs = caches
    path, _ = checkpoint(tmp_path, {"darcy": specs["darcy"]})
    with pytest.raises(ConfigError, match=r"has no task 'adv' \(it has: darcy\)"):
        build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, path, KEY)


@pytest.mark.parametrize("content", [None, b"not a checkpoint"])
def test_missing_or_unreadable_checkpoint(tmp_path, caches, content):
    _, infos, specs = caches
    path = tmp_path / "model.pt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=KEY.replace(".", r"\.")):
        build_latent_cache("adv", infos["adv"], specs["adv"], CFG.d_model, path, KEY)
    assert not list(infos["adv"].path.parent.glob("*.tmp"))
