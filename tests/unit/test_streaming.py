"""Streaming's parts with real files and real stores (an HTTP server and an S3-compatible one on 127.0.0.1): the
order of an epoch, the node cache's limit, pins and verification, the plan's refusal, a resume on fewer ranks."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.b2sim import Account
from tests.http_server import FileServer
from tests.unit.test_s3_store import s3  # noqa: F401 - the fixture
from train.config import validate
from train.data.dataset import step_on_world_size
from train.data.stream.node_cache import Shard, ShardCache
from train.data.stream.order import epoch_order, item_ranges
from train.data.stream.sampler import StreamSampler
from train.data.stream.shards import ShardSet
from train.data.stream.stage import plan_stream, working_set
from train.errors import ConfigError, DataError, StoreUnavailable


def _shards(folder: Path, n: int, samples: int = 4, size: int = 256) -> list[Shard]:
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for i in range(n):
        path = folder / f"train-{i:05d}.npy"
        np.save(path, np.full((samples, size), i, np.float32))
        shards.append(Shard(path.name, path.stat().st_size, hashlib.sha1(path.read_bytes()).hexdigest(), samples))
    return shards


def _sampler(cache, counts, rank, world, steps, batch=3, **kw):
    options = {"canonical_nodes": 2, "block_shards": 2, "prefetch_blocks": 1, "behind_batches": 1} | kw
    return StreamSampler(cache, counts, 5, batch, steps, rank, world, 7, 0, **options)


def test_an_epoch_is_every_item_once_and_the_same_on_any_number_of_ranks(tmp_path):
    shards = _shards(tmp_path / "set", 6, samples=4)
    offsets = item_ranges([4] * 6, 5)
    order = epoch_order(offsets, seed=7, stream=0, epoch=0, pass_=0, canonical_nodes=2, block_shards=2)
    assert sorted(order.items.tolist()) == list(range(120))
    assert epoch_order(offsets, 7, 0, 1, 0, 2, 2).items.tolist() != order.items.tolist()  # epochs differ
    cache = ShardCache(str(tmp_path / "set"), tmp_path / "unused", shards, 10**9, 0)
    one = [i for b in _sampler(cache, [4] * 6, 0, 1, 40) for i in b]
    two = [_sampler(cache, [4] * 6, r, 2, 20) for r in range(2)]
    zipped = [i for a, b in zip(*two, strict=True) for i in a + b]
    assert Counter(one) == Counter(zipped) == Counter(order.items.tolist())


def test_two_ranks_stopped_mid_epoch_and_resumed_on_one_train_every_sample_of_the_epoch_once(tmp_path):
    shards = _shards(tmp_path / "set", 6, samples=4)
    cache = ShardCache(str(tmp_path / "set"), tmp_path / "unused", shards, 10**9, 0)
    steps_two, stopped = 20, 7
    seen = Counter()
    for rank in range(2):
        sampler = _sampler(cache, [4] * 6, rank, 2, steps_two)
        sampler.set_epoch(0, 0, stopped)
        seen.update(i for b in sampler for i in b)
    resumed = step_on_world_size(stopped, 2, 1)
    assert resumed == 14 and step_on_world_size(7, 2, 4) is None  # 14 batches are not a whole step of 4 ranks
    sampler = _sampler(cache, [4] * 6, 0, 1, 2 * steps_two)
    sampler.set_epoch(0, resumed)
    seen.update(i for b in sampler for i in b)
    assert seen == Counter(range(120)), "a sample trained twice or never"


def test_the_cache_stays_within_its_limit_and_never_evicts_a_pinned_shard(tmp_path):
    shards = _shards(tmp_path / "store", 8)
    with FileServer(tmp_path / "store") as server:
        cache = ShardCache(server.url, tmp_path / "node", shards, limit=3 * shards[0].bytes, wait_s=0)
        cache.fetch(["train-00000.npy", "train-00001.npy"])
        cache.pin({"train-00000.npy"})
        for name in ["train-00002.npy", "train-00003.npy", "train-00004.npy"]:
            cache.fetch([name])
            assert cache.usage() <= cache.limit
        held = {p.name for p in (tmp_path / "node").glob("*.npy")}
        assert held == {"train-00000.npy", "train-00003.npy", "train-00004.npy"}  # least recently used went
        cache.pin({"train-00000.npy", "train-00003.npy", "train-00004.npy"})
        with pytest.raises(ConfigError, match=r"data\.cache_limit"):
            cache.fetch(["train-00005.npy"])
        cache.unpin()


def test_a_local_shard_set_is_read_in_place_and_never_evicted(tmp_path):
    shards = _shards(tmp_path / "set", 6)
    before = {p.name: p.read_bytes() for p in (tmp_path / "set").iterdir()}
    cache = ShardCache(str(tmp_path / "set"), tmp_path / "node", shards, limit=1, wait_s=0)
    for sampler in [_sampler(cache, [4] * 6, 0, 1, 30)]:
        assert sum(len(b) for b in sampler) == 90
    assert cache.path("train-00003.npy") == tmp_path / "set" / "train-00003.npy"
    assert {p.name: p.read_bytes() for p in (tmp_path / "set").iterdir()} == before
    assert not (tmp_path / "node").exists()


def test_a_damaged_shard_is_fetched_again_and_refused_when_the_store_keeps_it_damaged(tmp_path):
    shards = _shards(tmp_path / "store", 2)
    with FileServer(tmp_path / "store") as server:
        cache = ShardCache(server.url, tmp_path / "node", shards, limit=10**6, wait_s=0)
        server.faults["train-00000.npy"] = "drop"  # the first answer is cut short: the next one is whole
        cache.fetch(["train-00000.npy"])
        assert server.requests["train-00000.npy"] == 2
        (tmp_path / "store" / "train-00001.npy").write_bytes(b"\x93NUMPY" + bytes(shards[1].bytes - 6))
        with pytest.raises(DataError, match=r"train-00001\.npy.*differ from the shard set's manifest twice") as e:
            cache.fetch(["train-00001.npy"])
        assert e.value.exit_code == 3 and not (tmp_path / "node" / "train-00001.npy").exists()


def test_a_store_that_stops_answering_is_waited_for_then_stops_the_run(tmp_path):
    shards = _shards(tmp_path / "store", 2)
    with FileServer(tmp_path / "store") as server:
        cache = ShardCache(server.url, tmp_path / "node", shards, limit=10**6, wait_s=1.5)
        server.outage_after = 0
        with pytest.raises(StoreUnavailable, match="did not answer") as e:
            cache.fetch(["train-00000.npy"])
        assert e.value.exit_code == 75 and server.requests["train-00000.npy"] >= 2


def test_shards_stream_from_an_s3_compatible_store(s3, tmp_path):  # noqa: F811
    shards = _shards(tmp_path / "store", 2)
    s3.create_bucket(Bucket="sets")
    for s in shards:
        s3.upload_file(str(tmp_path / "store" / s.name), "sets", f"adv/{s.name}")
    cache = ShardCache("s3://sets/adv", tmp_path / "node", shards, limit=10**6, wait_s=0)
    assert np.load(cache.path("train-00001.npy"))[0, 0] == 1


def test_shards_stream_from_b2(monkeypatch, tmp_path):
    account = Account(monkeypatch)
    shards = _shards(tmp_path / "store", 3, size=16)  # under the simulator's large-file threshold
    for s in shards:
        account.bucket.upload_bytes((tmp_path / "store" / s.name).read_bytes(), f"sets/adv/{s.name}")
    cache = ShardCache("b2://pdebench/sets/adv", tmp_path / "node", shards, limit=2 * shards[0].bytes, wait_s=0)
    cache._store = account.store("sets/adv")  # the simulated account (a rank opens b2:// from its credentials)
    for name in ("train-00000.npy", "train-00001.npy", "train-00002.npy"):
        assert np.load(cache.path(name))[0, 0] == int(name[-5])
    assert {p.name for p in (tmp_path / "node").glob("*.npy")} == {"train-00001.npy", "train-00002.npy"}


def test_a_limit_below_the_working_set_is_refused_with_the_figures(tmp_path):
    shard_set = ShardSet("adv", {}, [Shard(f"s{i}", 100_000, "x", 4) for i in range(20)], [])
    cfg = validate({"tasks": {"adv": {"pde": "advection1d", "source": "/x"}}, "data": {"cache_limit": "500KB"}}, "t")
    assert working_set(cfg, shard_set) == 1 * 2 * 3 * 100_000
    with pytest.raises(ConfigError, match=r"limit 488.3 KiB.*below the 585.9 KiB") as e:
        plan_stream("adv", cfg, shard_set, tmp_path)
    assert e.value.exit_code == 2
    ok = validate({"tasks": {"adv": {"pde": "advection1d", "source": "/x"}}, "data": {"cache_limit": "0.6MB"}}, "t")
    assert plan_stream("adv", ok, shard_set, tmp_path) == 600_000


def test_the_cache_settings_may_change_between_launches_but_the_order_may_not():
    from train.config import training_differences

    base = {"tasks": {"adv": {"pde": "advection1d", "source": "/x"}}, "data": {"stream": True}}
    cfg = validate(base, "t")
    roomier = validate({**base, "data": {"stream": True, "cache_limit": "9GB", "store_wait_s": 600}}, "t")
    reordered = validate({**base, "data": {"stream": True, "block_shards": 4}}, "t")
    assert not training_differences(cfg, roomier)
    assert training_differences(cfg, reordered)


def test_the_streaming_keys_at_their_defaults_leave_a_runs_identity_as_an_earlier_version_tagged_it(repo):
    from train.config import load_config, run_identity

    # The identities the version before streaming gave these configs: remotes it wrote still hold their runs.
    assert run_identity(load_config(repo / "configs" / "tiny.yaml")) == "25984c9b485181a8"
    assert run_identity(load_config(repo / "configs" / "default.yaml")) == "d4e252c9afb962d7"


def test_the_doctors_disk_plan_counts_the_cache_not_the_data(tmp_path):
    import json

    from train.data.stream.stage import disk_need

    shards = _shards(tmp_path / "set", 10, size=1000)  # 10 shards of about 16 KB: 160 KB of data
    manifest = {"format": 1, "task": "adv", "cache": {}, "shards": [s.record() for s in shards], "whole": []}
    (tmp_path / "set" / "stream.json").write_text(json.dumps(manifest))
    task = {"adv": {"pde": "advection1d", "source": str(tmp_path / "set")}}
    cfg = validate({"tasks": task, "data": {"stream": True, "block_shards": 1}}, "t")
    assert disk_need(cfg, "adv") == 3 * shards[0].bytes  # the working set: a block, the one before, one ahead
    cfg = validate({"tasks": task, "data": {"stream": True, "cache_limit": "50KB"}}, "t")
    assert disk_need(cfg, "adv") == 50_000
    remote = validate(
        {"tasks": {"adv": {"pde": "advection1d", "source": "https://x/set"}}, "data": {"stream": True}}, "t"
    )
    assert disk_need(remote, "adv") == 0  # not seen yet, and the doctor does not go to the network


@pytest.fixture(scope="module")
def well(tmp_path_factory) -> Path:
    """The Gray-Scott demo in The Well's layout (data/{train,valid,test}/, four files a split), small."""
    from train.data.acquire.generate_well import generate_gray_scott

    return generate_gray_scott(tmp_path_factory.mktemp("well"), resolution=8, frames=10, every=2, burn_in=4)


def _well_task(source: str):
    well = {"n_steps_input": 4, "n_steps_output": 1, "dt_stride": 1}
    return validate({"tasks": {"gs": {"pde": "well", "source": source, "well": well}}}, "t").tasks["gs"]


def _reader_values(task, path: Path) -> dict[str, np.ndarray]:
    from train.data.formats import open_reader

    reader = open_reader([path], task)
    try:
        blocks = list(reader.parts(range(reader.n_samples)))
        return {part: np.concatenate([b[part] for b in blocks]) for part in blocks[0]}
    finally:
        reader.close()


def _published_cache(shard_set: ShardSet, url: str, folder: Path, limit: int) -> ShardCache:
    from train.data.stream.convert import PARTS, Converted

    parts = tuple(p for p in PARTS if p != "const" or shard_set.cache["const_channels"])
    convert = Converted(shard_set.published["task"], parts, shard_set.sample_bytes)
    return ShardCache(url, folder, shard_set.shards, limit=limit, wait_s=0, convert=convert)


def test_the_wells_files_as_published_are_shards_converted_on_the_node_and_never_evicted_at_the_source(well, tmp_path):
    """A local published set: each file is verified and converted into the node's folder (the values its reader
    gives, constant channels apart), the conversions are evicted within the limit, the files never touched."""
    from train.data.stream.published import index_published

    task = _well_task(str(well))
    shard_set = index_published("gs", task, tmp_path / "set", tmp_path / "scratch")
    assert [p.name for p in (tmp_path / "set").iterdir()] == ["stream.json"] and shard_set.published
    assert [s.samples for s in shard_set.shards] == [8, 8, 10, 12] and len(shard_set.whole) == 8
    before = {p: p.stat().st_mtime_ns for p in well.rglob("*.hdf5")}
    limit = 2 * shard_set.largest + shard_set.download
    cache = _published_cache(shard_set, shard_set.published["files"], tmp_path / "node", limit)
    for shard in shard_set.shards:
        values = _reader_values(task, well / shard.name)
        assert np.array_equal(np.load(cache.path(shard.name)), values[""])
        assert np.array_equal(np.load(cache.path(shard.name, "const")), values["const"])
        assert cache.usage() <= limit
    assert len(cache._held()) == 2 and {p: p.stat().st_mtime_ns for p in well.rglob("*.hdf5")} == before


def test_published_files_stream_from_s3_and_b2_and_a_damaged_one_is_refused(well, s3, monkeypatch, tmp_path):  # noqa: F811
    """The files in an S3-compatible store and in B2, as published: the index lists and reads them there, a node
    converts what it fetches; a file whose bytes differ from the manifest is fetched again, then refused (exit 3)
    with nothing converted."""
    from train.data.stream.published import index_published

    s3.create_bucket(Bucket="well")
    account = Account(monkeypatch)
    for path in sorted(well.rglob("*.hdf5")):
        name = path.relative_to(well).as_posix()
        s3.upload_file(str(path), "well", f"gray_scott/{name}")
        account.bucket.upload_bytes(path.read_bytes(), f"sets/gs/{name}")
    shard_set = index_published("gs", _well_task("s3://well/gray_scott"), tmp_path / "set", tmp_path / "scratch")
    assert shard_set.published["files"] == "s3://well/gray_scott" and not list((tmp_path / "scratch").iterdir())
    local = index_published("gs", _well_task(str(well)), tmp_path / "local", tmp_path / "scratch")
    assert shard_set.cache["input_mean"] == local.cache["input_mean"] and shard_set.shards == local.shards
    first = shard_set.shards[0]
    cache = _published_cache(shard_set, "s3://well/gray_scott", tmp_path / "node", 2**30)
    expected = _reader_values(_well_task(str(well)), well / first.name)[""]
    assert np.array_equal(np.load(cache.path(first.name)), expected)
    b2 = _published_cache(shard_set, "b2://pdebench/sets/gs", tmp_path / "node-b2", 2**30)
    b2._store = account.store("sets/gs")  # the simulated account (a rank opens b2:// from its credentials)
    assert np.array_equal(np.load(b2.path(first.name)), expected)
    damaged = shard_set.shards[1]
    s3.put_object(Bucket="well", Key=f"gray_scott/{damaged.name}", Body=(well / first.name).read_bytes())
    with pytest.raises(DataError, match=r"differ from the shard set's manifest twice") as e:
        cache.fetch([damaged.name])
    assert e.value.exit_code == 3 and not any("maze" in p.name for p in (tmp_path / "node").iterdir())


def test_a_dataset_not_published_as_many_files_is_repacked_instead(well, tmp_path):
    from train.data.stream.published import published_files

    pdebench = validate({"tasks": {"adv": {"pde": "advection1d", "source": "/x"}}}, "t").tasks["adv"]
    with pytest.raises(
        ConfigError, match=r"tasks\.adv: pde advection1d is not published as many files.*make shard \(without"
    ):
        published_files("adv", pdebench)
    (tmp_path / "gs" / "data" / "train").mkdir(parents=True)
    for path in (well / "data" / "train").iterdir():
        (tmp_path / "gs" / "data" / "train" / path.name).symlink_to(path)
    with pytest.raises(ConfigError, match=r"tasks\.gs: .* has no val files of its own \(data/valid/\*\.hdf5\)"):
        published_files("gs", _well_task(str(tmp_path / "gs")))
