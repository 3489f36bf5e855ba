"""Streamed training end to end, with real torchrun ranks and real stores on 127.0.0.1 (an HTTP server, moto's S3
server): a shard set written by `python -m train shard` trains from either store through a node cache 5x smaller
than the data with the weights of the same run reading the set from local disk (its split gathered on the
device); a store that goes away mid-epoch ends the launch with exit 75 and a checkpoint, and the same command
continues, bit for bit, once it is back; a launch SIGKILLed mid-epoch continues bit for bit; two ranks stopped
mid-epoch continue on one at the same sample; a dataset in The Well's schema streams with its constant channels; a
dry run prints the plan, a limit below the working set is exit 2, a full cache disk exit 4."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import h5py
import pytest
import torch
import yaml

from tests.helpers import (
    REPO,
    assert_bitwise_equal,
    folders,
    in_namespace_with_tmpfs,
    launch_in_background,
    mount_namespace_problem,
    run_cli,
    wait_for,
)
from tests.http_server import FileServer
from tests.unit.test_s3_store import s3  # noqa: F401 - the fixture: moto's S3 server on 127.0.0.1
from train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.integration

SOURCE = {
    "tasks": {"adv": {"pde": "advection1d", "n_samples": 80, "resolution": 64, "temporal_stride": 10}},
    "model": {"name": "fno", "fno": {"modes": 8, "width": 8}},
}
STEPS = ["--set", "train.epochs=2", "--set", "train.steps_per_epoch=6", "--set", "train.checkpoint_every=3"]


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> Path:
    """The advection task's shard set: 64 training trajectories in 22 shards of 16 KiB (3 trajectories each)."""
    tmp = tmp_path_factory.mktemp("shards")
    (tmp / "source.yaml").write_text(yaml.safe_dump(SOURCE))
    proc = run_cli("shard", "--config", str(tmp / "source.yaml"), *folders(tmp), "--output", str(tmp / "set"),
                   "--shard-mb", "0.016")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp / "set" / "adv" / "stream.json").read_text())
    assert len(manifest["shards"]) == 22 and sum(s["samples"] for s in manifest["shards"]) == 64
    return tmp / "set"


def streamed(tmp: Path, source: str, run: str, *extra: str) -> list[str]:
    task = {"pde": "advection1d", "source": source, "initial_step": 4, "batch_size": 32}  # 4 shards an epoch
    config = {**SOURCE, "tasks": {"adv": task}}
    (tmp / "stream.yaml").write_text(yaml.safe_dump({**config, "data": {"stream": True, "block_shards": 1}}))
    return ["fit", "--config", str(tmp / "stream.yaml"), "--nproc", "1", "--run", run, *folders(tmp), *STEPS, *extra]


def weights(tmp: Path, run: str) -> dict[str, torch.Tensor]:
    saved = torch.load(latest_checkpoint(tmp / "runs" / run / "checkpoints"), weights_only=False)
    assert saved["progress"]["global_step"] == 12, saved["progress"]
    return saved["model"]


@pytest.fixture(scope="module")
def local(shard_set, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights of the run reading the shard set where it lies on local disk, its training split gathered on
    the device (train.data_on_device) instead of read through the loader: the same batches either way."""
    tmp = tmp_path_factory.mktemp("local")
    proc = run_cli(*streamed(tmp, str(shard_set / "adv"), "local", "--set", "train.data_on_device=true"))
    assert proc.returncode == 0 and "training data on the device" in proc.stderr, proc.stderr[-3000:]
    assert not (shard_set / "adv" / "pins").exists()  # read in place: nothing written beside the set
    return weights(tmp, "local")


def test_streamed_from_a_store_through_a_small_cache_equals_local_and_resumes_after_an_outage(
    shard_set, local, tmp_path
):
    with FileServer(shard_set) as server:
        # 60 KB of cache for 339 KiB of shards; the store goes away after the manifest, val, test and 3 shards.
        server.outage_after = 6
        args = streamed(tmp_path, f"{server.url}/adv", "http", "--set", "data.cache_limit=60KB",
                        "--set", "data.store_wait_s=1")  # fmt: skip
        stopped = run_cli(*args)
        assert stopped.returncode == 75, stopped.stderr[-3000:]
        assert "did not answer" in stopped.stderr and "stopped with a checkpoint" in stopped.stderr
        progress = torch.load(latest_checkpoint(tmp_path / "runs" / "http" / "checkpoints"), weights_only=False)
        assert 0 < progress["progress"]["global_step"] < 12, progress["progress"]
        server.outage_after = None
        resumed = run_cli(*args)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_equal(weights(tmp_path, "http"), local)
    cache = next((tmp_path / "cache" / "adv").glob("stream-*")) / "shards"
    held = sum(p.stat().st_size for p in cache.glob("*.npy"))
    assert held <= 60_000, held
    fetched = [json.loads(line) for line in (cache / "fetched.jsonl").read_text().splitlines()]
    assert len(fetched) > 3  # more shards than the cache holds at once went through it


def test_streamed_from_an_s3_compatible_store_equals_local(shard_set, local, s3, tmp_path):  # noqa: F811
    s3.create_bucket(Bucket="sets")
    for path in sorted((shard_set / "adv").iterdir()):
        s3.upload_file(str(path), "sets", f"pdebench/adv/{path.name}")
    proc = run_cli(*streamed(tmp_path, "s3://sets/pdebench/adv", "s3", "--set", "data.cache_limit=60KB"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_bitwise_equal(weights(tmp_path, "s3"), local)


def test_the_wells_files_as_published_stream_over_http_with_the_weights_of_their_repacked_shards(tmp_path):
    """The Well's schema (the Gray-Scott demo: four files a split, two fields, constant scalars, periodic) served
    over HTTP as published: ``shard --published`` reads the files once from the server and writes only the
    manifest; the run that streams the files through a cache smaller than them (each converted on the node,
    its constant channels too) trains the weights of the run reading the same trajectories repacked into shards
    of one file each from local disk: the same bytes, statistics and order."""
    from train.data.cache.info import CacheInfo
    from train.data.stream.shards import write_shard_set

    short = ["--set", "train.epochs=1", "--set", "train.steps_per_epoch=4", "--set", "model.fno.width=8"]
    base = ["--config", "configs/well.yaml", *folders(tmp_path)]
    assert run_cli("cache", *base).returncode == 0
    (built,) = (tmp_path / "cache" / "gray_scott").iterdir()
    files = sorted((tmp_path / "data" / "gray_scott" / "data" / "train").iterdir())
    counts = []
    for file in files:
        with h5py.File(file) as f:
            counts.append(int(f.attrs["n_trajectories"]))
    write_shard_set("gray_scott", CacheInfo.load(built), tmp_path / "repacked", counts=counts)
    runs = {}
    with FileServer(tmp_path / "data") as server:
        source = ["--set", f"tasks.gray_scott.source={server.url}/gray_scott"]
        proc = run_cli("shard", *base, *source, "--published", "--output", str(tmp_path / "set"))
        assert proc.returncode == 0, proc.stderr
        assert [p.name for p in (tmp_path / "set" / "gray_scott").iterdir()] == ["stream.json"]
        for run, where in (("repacked", tmp_path / "repacked"), ("published", tmp_path / "set" / "gray_scott")):
            stream = ["--set", f"tasks.gray_scott.source={where}", "--set", "data.stream=true"]
            small = [
                "--set",
                "data.block_shards=1",
                "--set",
                "data.prefetch_blocks=0",
                "--set",
                "data.cache_limit=15MB",
            ]
            proc = run_cli("fit", *base, "--nproc", "1", "--run", run, *short, *stream, *small)
            assert proc.returncode == 0, proc.stderr[-3000:]
            saved = torch.load(latest_checkpoint(tmp_path / "runs" / run / "checkpoints"), weights_only=False)
            assert saved["progress"]["global_step"] == 4
            runs[run] = saved["model"]
    assert_bitwise_equal(runs["published"], runs["repacked"])
    (shards,) = (tmp_path / "cache" / "gray_scott").glob("stream-*/shards")
    fetched = [json.loads(line)["name"] for line in (shards / "fetched.jsonl").read_text().splitlines()]
    assert fetched and all(n.startswith("data/train/") for n in fetched)  # the published files, as they are
    assert not list((shards / ".downloads").iterdir())  # converted, the downloads gone


def first_new_shards(shard_set: Path, epoch: int, after: int, world: int = 1, steps: int = 6) -> tuple[int, set[str]]:
    """The first step of ``epoch`` from ``after`` on that needs a shard no earlier step of the run needed, and
    those shards: the order is a pure function of the seed, so the test knows it as the run does."""
    from train.config import TrainConfig
    from train.data.stream.node_cache import Shard, ShardCache
    from train.data.stream.sampler import StreamSampler

    meta = json.loads((shard_set / "stream.json").read_text())
    shards = [Shard.from_record(r) for r in meta["shards"]]
    sampler = StreamSampler(
        ShardCache(str(shard_set), shard_set, shards, 0, 0), [s.samples for s in shards], 17, 32, steps, 0, world, 0, 0,
        canonical_nodes=1, block_shards=1, prefetch_blocks=1, behind_batches=2 * TrainConfig().num_workers + 1,
    )  # fmt: skip
    seen: set[str] = set()
    for e in range(epoch + 1):
        sampler.set_epoch(e)
        passes = sampler.passes()
        for step in range(steps):
            first = step * sampler.global_batch
            needed, _ = sampler._around(passes, first, first + sampler.global_batch - 1)
            if e == epoch and step >= after and needed - seen:
                return step, needed - seen
            seen |= needed
    raise AssertionError("no step of the epoch needs a shard no earlier step needed")


def test_a_streamed_run_sigkilled_mid_epoch_resumes_with_the_uninterrupted_weights(shard_set, local, tmp_path):
    step, missing = first_new_shards(shard_set / "adv", epoch=0, after=2)
    log = tmp_path / "launch.log"
    with FileServer(shard_set) as server:
        # The shards first needed at `step` do not answer: the rank waits for them there (it would for
        # data.store_wait_s), after the checkpoint of every step before, and is killed.
        server.faults = {f"adv/{name}": "503" for name in missing}
        args = streamed(tmp_path, f"{server.url}/adv", "killed", "--set", "data.cache_limit=60KB",
                        "--set", "train.checkpoint_every=1")  # fmt: skip
        proc = launch_in_background(*args, log=log)
        try:
            wait_for(lambda: "trying again" in log.read_text(), "the rank waiting for the store", 120, proc)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        checkpoint = latest_checkpoint(tmp_path / "runs" / "killed" / "checkpoints")
        saved = torch.load(checkpoint, weights_only=False)["progress"]
        assert (saved["epoch"], saved["step_in_epoch"]) == (0, step), saved  # mid-epoch
        server.faults = {}
        resumed = run_cli(*args)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resumed from {checkpoint}" in resumed.stderr
    assert_bitwise_equal(weights(tmp_path, "killed"), local)


def test_two_ranks_stopped_mid_epoch_continue_on_one_at_the_same_sample(shard_set, tmp_path):
    # One pass an epoch: 1,088 windows, 17 steps of 2 x 32 or 34 steps of 32.
    step, missing = first_new_shards(shard_set / "adv", epoch=0, after=2, world=2, steps=17)
    with FileServer(shard_set) as server:
        args = streamed(tmp_path, f"{server.url}/adv", "ranks", "--set", "data.store_wait_s=1",
                        "--set", "train.steps_per_epoch=null", "--set", "train.epochs=1")  # fmt: skip
        dry = run_cli(*args[:1], "--dry-run", *args[1:])
        assert dry.returncode == 0 and "22 shards, 338.8 KiB of training data" in dry.stdout, dry.stdout
        refused = run_cli("cache", *args[1:], "--set", "data.cache_limit=20KB")
        assert refused.returncode == 2 and "below the 47.6 KiB the stream reads at once" in refused.stderr
        server.faults = {f"adv/{name}": "503" for name in missing}
        two = [a if a != "1" else "2" for a in args]  # --nproc 2
        stopped = run_cli(*two)
        assert stopped.returncode == 75, stopped.stderr[-3000:]
        assert "error: the shard store" in stopped.stderr and "did not answer" in stopped.stderr
        saved = torch.load(latest_checkpoint(tmp_path / "runs" / "ranks" / "checkpoints"), weights_only=False)
        assert (saved["progress"]["step_in_epoch"], saved["progress"]["world_size"]) == (step, 2), saved["progress"]
        server.faults = {}
        resumed = run_cli(*args)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {step} of the epoch becomes step {2 * step} (the same sample)" in resumed.stderr
    final = torch.load(latest_checkpoint(tmp_path / "runs" / "ranks" / "checkpoints"), weights_only=False)
    # `step` steps on 2 ranks, then the 34 - 2 x step that remain of the epoch's sequence on one: every window once
    assert final["progress"]["global_step"] == step + 34 - 2 * step and final["progress"]["epoch"] == 1


def test_a_full_cache_disk_ends_with_exit_4_naming_the_folder(shard_set, tmp_path):
    problem = mount_namespace_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the full-disk test must run in CI, but {problem}")
        pytest.skip(problem)
    cache = tmp_path / "cache"
    cache.mkdir()
    with FileServer(shard_set) as server:
        # The limit says 10 MB, the disk holds 160 KiB: val and test (86 KiB), then a few shards.
        args = streamed(tmp_path, f"{server.url}/adv", "full", "--set", "data.cache_limit=10MB", "--skip-doctor")
        proc = in_namespace_with_tmpfs(cache, "160k", sys.executable, "-m", "train", *args)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "disk full: writing " + str(cache / "adv") in proc.stderr, proc.stderr[-3000:]
    assert REPO.is_dir()
