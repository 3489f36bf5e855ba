"""Tests of checkpoint files (keep-last-k, discovery, safe loading) and of atomic writes."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
import torch

from train.atomic import atomic_path, write_json_atomic, write_text_atomic
from train.checkpoint import (
    BEST,
    INTEGRITY,
    archive_checkpoints,
    checkpoint_for_evaluation,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    model_differences,
    resume_source,
    save_best,
    save_checkpoint,
    set_aside_unreadable,
    unreadable,
)
from train.config import TransformerConfig, load_config
from train.engine.optim import warmup_cosine
from train.errors import ConfigError, DataError
from train.model.multitask import MultiTaskSurrogate
from train.model.specs import TaskSpec


def names(paths):
    return [p.name for p in paths]


def trainer_like_state(repo, epoch=3):
    """A state dict with the same components Trainer.state() saves, after a real optimizer step."""
    cfg = load_config(repo / "configs" / "tiny.yaml")
    spec = TaskSpec(grid=(16,), in_channels=1, out_channels=1, patch_size=4, initial_step=2, autoregressive=True)
    torch.manual_seed(0)
    model = MultiTaskSurrogate({"adv": spec}, TransformerConfig(d_model=16, n_heads=2, n_layers=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(2, 10))
    out = model({"adv": torch.randn(2, 2, 16, 1)})["adv"]
    out.square().mean().backward()
    optimizer.step()
    scheduler.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "progress": {"epoch": epoch, "global_step": 17},
        "config": cfg.model_dump(mode="json"),
        "specs": {"adv": spec.as_dict()},
    }


# -------------------------------------------------------------------------------------------- names
def test_checkpoint_name():
    assert checkpoint_name(3) == "step_00000003.pt"
    assert checkpoint_name(123456789) == "step_123456789.pt"


def test_list_checkpoints_sorts_numerically_and_ignores_others(tmp_path):
    for name in (
        "step_00000010.pt",
        "step_00000009.pt",
        "step_00000002.pt",
        "step_100000000.pt",
        ".step_00000011.pt.abc123.tmp",  # an interrupted atomic save
        "step_00000011.pt.tmp",
        "step_12.pt",  # fewer than 8 digits: not ours
        "step_00000003.pth",
        "best.pt",  # the best checkpoint is found by name, never as "the newest"
        "notes.txt",
        "xstep_00000004.pt",
    ):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "step_00000099.pt.d").mkdir()
    found = list_checkpoints(tmp_path)
    assert names(found) == ["step_00000002.pt", "step_00000009.pt", "step_00000010.pt", "step_100000000.pt"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_100000000.pt"


def test_list_checkpoints_of_missing_or_empty_folder(tmp_path):
    assert list_checkpoints(tmp_path / "absent") == []
    assert latest_checkpoint(tmp_path / "absent") is None
    assert list_checkpoints(tmp_path) == []
    assert latest_checkpoint(tmp_path) is None


# ------------------------------------------------------------------------------------------ save/load
@pytest.mark.parametrize("keep", [1, 2, 3])
def test_save_keeps_the_last_k(tmp_path, keep):
    folder = tmp_path / "ckpt"
    for epoch in range(1, 7):
        path = save_checkpoint(folder, epoch, {"progress": {"epoch": epoch}}, keep)
        assert path == folder / checkpoint_name(epoch)
        assert path.is_file()
        assert len(list_checkpoints(folder)) == min(epoch, keep)
    expected = [checkpoint_name(e) for e in range(7 - keep, 7)]
    assert names(list_checkpoints(folder)) == expected
    assert sorted(p.name for p in folder.iterdir()) == expected  # no temporary files either
    for e in range(7 - keep, 7):
        assert load_checkpoint(folder / checkpoint_name(e))["progress"]["epoch"] == e


def test_keep_counts_numerically_across_digit_widths(tmp_path):
    for step in (99999998, 99999999, 100000000, 100000001):
        save_checkpoint(tmp_path, step, {"e": step}, keep=2)
    assert names(list_checkpoints(tmp_path)) == ["step_100000000.pt", "step_100000001.pt"]


def test_save_does_not_touch_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    for epoch in range(1, 4):
        save_checkpoint(tmp_path, epoch, {"e": epoch}, keep=1)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_trainer_state_round_trips_with_weights_only(tmp_path, repo):
    state = trainer_like_state(repo)
    path = save_checkpoint(tmp_path, 3, state, keep=2)
    loaded = load_checkpoint(path)
    assert set(loaded) == set(state) | {INTEGRITY}
    assert loaded["progress"] == {"epoch": 3, "global_step": 17}
    assert loaded["config"] == state["config"]
    assert loaded["specs"] == state["specs"]
    assert loaded["scheduler"] == state["scheduler"]
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for idx, per_param in state["optimizer"]["state"].items():
        for key, value in per_param.items():
            assert torch.equal(loaded["optimizer"]["state"][idx][key], value)
    # the loaded dicts restore into fresh objects
    spec = TaskSpec(**loaded["specs"]["adv"])
    model = MultiTaskSurrogate({"adv": spec}, TransformerConfig(d_model=16, n_heads=2, n_layers=1))
    model.load_state_dict(loaded["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(2, 10))
    scheduler.load_state_dict(loaded["scheduler"])
    assert scheduler.last_epoch == 1


def test_load_maps_to_cpu(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"t": torch.arange(3.0)}, keep=1)
    assert load_checkpoint(path)["t"].device.type == "cpu"


@pytest.mark.parametrize("content", [b"", b"garbage, not a zip file", b"PK\x03\x04 truncated zip"])
def test_unreadable_checkpoint_is_a_data_error(tmp_path, content):
    path = tmp_path / "step_00000003.pt"
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value)
    assert e.value.exit_code == 3


def test_truncated_checkpoint_is_a_data_error(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"w": torch.randn(1000)}, keep=1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=re.escape(str(path))):
        load_checkpoint(path)


class _NotAllowed:
    pass


def test_checkpoint_with_arbitrary_objects_is_refused(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save({"obj": _NotAllowed()}, path)
    with pytest.raises(DataError, match=re.escape(str(path))):
        load_checkpoint(path)


def test_a_checkpoint_whose_payload_changed_after_its_save_is_refused_and_set_aside(tmp_path, repo, caplog):
    """A flipped bit in a tensor leaves a file torch loads without a word (an Adam moment off by 1435.6 went
    unnoticed that way); the checksum written at save time is checked at every load."""
    at = lambda step: {**trainer_like_state(repo), "progress": {"epoch": 3, "global_step": step}}  # noqa: E731
    older = save_checkpoint(tmp_path, 10, at(10), keep=3)
    newest = save_checkpoint(tmp_path, 20, at(20), keep=3)
    state = torch.load(newest, weights_only=True)
    moment = next(iter(state["optimizer"]["state"].values()))["exp_avg"]
    moment.view(torch.int32).view(-1)[0] ^= 1 << 30
    torch.save(state, newest)  # loadable, its recorded checksum now of other bytes
    with pytest.raises(DataError, match=r"step_00000020\.pt cannot be used \(its payload hashes to \w+, but \w+ was "
                       r"written with it\)"):  # fmt: skip
        load_checkpoint(newest)
    moved = set_aside_unreadable(tmp_path)
    assert [p.name.split(".pt")[0] for p in moved] == ["step_00000020"] and latest_checkpoint(tmp_path) == older
    assert "cannot be read (its payload hashes to" in caplog.text
    assert load_checkpoint(older)[INTEGRITY]["xxh3_128"]


def test_missing_checkpoint_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"absent\.pt"):
        load_checkpoint(tmp_path / "absent.pt")


# ------------------------------------------------------------------------------------------- atomic
def test_atomic_path_replaces_on_success(tmp_path):
    final = tmp_path / "sub" / "file.txt"
    with atomic_path(final) as tmp:
        assert tmp.parent == final.parent  # same folder: rename, not copy
        assert tmp != final
        tmp.write_text("new")
        assert not final.exists()  # nothing under the final name until the block ends
    assert final.read_text() == "new"
    assert sorted(p.name for p in final.parent.iterdir()) == ["file.txt"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_atomic_path_keeps_old_content_on_exception(tmp_path, exc):
    final = tmp_path / "file.txt"
    final.write_text("old")
    with pytest.raises(exc), atomic_path(final) as tmp:
        tmp.write_text("half-writ")
        raise exc("crash")
    assert final.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_atomic_path_exception_without_previous_file(tmp_path):
    final = tmp_path / "file.txt"
    with pytest.raises(ValueError), atomic_path(final) as tmp:
        tmp.write_text("x")
        raise ValueError
    assert list(tmp_path.iterdir()) == []


def test_atomic_save_failure_keeps_previous_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 1, {"e": 1}, keep=2)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises for an unpicklable object
        save_checkpoint(tmp_path, 2, {"bad": lambda: None}, keep=2)
    assert names(list_checkpoints(tmp_path)) == ["step_00000001.pt"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001.pt"]
    assert load_checkpoint(tmp_path / "step_00000001.pt")["e"] == 1


def test_write_json_atomic(tmp_path):
    obj = {"b": [1, 2.5, None], "a": {"z": "text", "y": True}}
    final = tmp_path / "out" / "meta.json"
    write_json_atomic(final, obj)
    text = final.read_text()
    assert json.loads(text) == obj
    assert text.endswith("\n")
    assert text.index('"a"') < text.index('"b"')  # sorted keys
    write_json_atomic(final, [1])
    assert json.loads(final.read_text()) == [1]
    assert sorted(p.name for p in final.parent.iterdir()) == ["meta.json"]


def test_write_json_atomic_failure_keeps_old_file(tmp_path):
    final = tmp_path / "meta.json"
    write_json_atomic(final, {"v": 1})
    with pytest.raises(TypeError):
        write_json_atomic(final, {"v": object()})  # not JSON-serialisable
    assert json.loads(final.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_write_text_atomic(tmp_path):
    final = tmp_path / "a.txt"
    write_text_atomic(final, "héllo\n")
    assert final.read_text() == "héllo\n"


def test_atomic_write_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "atomic.txt", "x")
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
    plain = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    assert plain == 0o644
    assert stat.S_IMODE((tmp_path / "atomic.txt").stat().st_mode) == plain


# ------------------------------------------------------------------------------------ resume policy
def test_resume_auto_takes_the_newest_and_never_takes_none(tmp_path):
    assert resume_source("auto", tmp_path) is None
    for step in (4, 8):
        save_checkpoint(tmp_path, step, {"s": step}, keep=3)
    save_best(tmp_path, {"s": 4})
    assert resume_source("auto", tmp_path) == tmp_path / checkpoint_name(8)
    assert resume_source("never", tmp_path) is None


def test_resume_from_a_path_only_until_the_run_has_its_own(tmp_path):
    other = save_checkpoint(tmp_path / "other", 5, {"s": 5}, keep=1)
    own = tmp_path / "own"
    assert resume_source(str(other), own) == other
    save_checkpoint(own, 2, {"s": 2}, keep=1)
    assert resume_source(str(other), own) == own / checkpoint_name(2)


def test_resume_from_a_missing_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"train.resume=.*nope.pt: no such checkpoint"):
        resume_source(str(tmp_path / "nope.pt"), tmp_path / "own")


def test_archive_moves_every_checkpoint_and_keeps_their_content(tmp_path):
    assert archive_checkpoints(tmp_path) is None
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"s": step}, keep=2)
    save_best(tmp_path, {"s": 1})
    archive = archive_checkpoints(tmp_path)
    assert list_checkpoints(tmp_path) == [] and not (tmp_path / BEST).exists()
    assert sorted(p.name for p in archive.iterdir()) == [BEST, checkpoint_name(1), checkpoint_name(2)]
    assert load_checkpoint(archive / checkpoint_name(2))["s"] == 2


def test_evaluation_prefers_the_best_checkpoint(tmp_path):
    assert checkpoint_for_evaluation(tmp_path) is None
    save_checkpoint(tmp_path, 3, {"s": 3}, keep=1)
    assert checkpoint_for_evaluation(tmp_path) == tmp_path / checkpoint_name(3)
    save_best(tmp_path, {"s": 2})
    assert checkpoint_for_evaluation(tmp_path) == tmp_path / BEST


def test_model_differences_name_every_differing_key(repo):
    state = trainer_like_state(repo)
    same = model_differences(state, state["config"]["model"], state["specs"])
    assert same == []
    model = {**state["config"]["model"], "d_model": 64, "n_layers": 7}
    spec = {**state["specs"]["adv"], "patch_size": 8}
    found = model_differences(state, model, {"adv": spec, "extra": spec})
    assert [f.split(" ")[0] for f in found] == [
        "model.d_model",
        "model.n_layers",
        "tasks.adv.patch_size",
        "tasks.extra",
    ]
    assert "(4 there, 8 here)" in found[2]
    # Compared under the keys a model is built from only: the transformer's width is no FNO's business.
    assert model_differences(state, model, state["specs"], keys=("name", "fno")) == []
    # A checkpoint written before a spec had frame_stride and boundary resumes; other values of them do not.
    old = {
        **state,
        "specs": {"adv": {k: v for k, v in state["specs"]["adv"].items() if k not in ("frame_stride", "boundary")}},
    }
    assert model_differences(old, state["config"]["model"], state["specs"]) == []
    wrapped = {"adv": {**state["specs"]["adv"], "boundary": ((2, 2),)}}
    assert model_differences(old, state["config"]["model"], wrapped) == [
        "tasks.adv.boundary (() there, ((2, 2),) here)"
    ]


def test_evaluating_a_checkpoint_of_another_model_names_what_differs_not_every_key(tmp_path, repo):
    """Evaluation dumped every state_dict key of the mismatch; resume already said what differed."""
    from train.checkpoint import check_same_model

    saved = trainer_like_state(repo)  # a transformer (d_model 16) of task adv
    cfg = load_config(repo / "configs" / "tiny.yaml", ["model.name=fno"])
    with pytest.raises(ConfigError, match=r"cannot evaluate x\.pt: its model differs from this config in "
                       r"model\.name \('transformer' there, 'fno' here\)") as e:  # fmt: skip
        check_same_model(saved, cfg.model, saved["specs"], "x.pt", "evaluate")
    assert "state_dict" not in str(e.value) and len(str(e.value)) < 600


def test_a_sharded_checkpoint_is_a_folder_and_only_a_folder(tmp_path):
    from train.checkpoint import BEST_SHARDED, best_checkpoint

    (tmp_path / "step_00000002.dcp").mkdir()
    (tmp_path / "step_00000004.dcp").write_bytes(b"a file under a folder's name")
    (tmp_path / ".step_00000006.dcp.partial").mkdir()  # a killed writer's
    (tmp_path / "step_00000003.pt").write_bytes(b"x")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002.dcp", "step_00000003.pt"]
    assert best_checkpoint(tmp_path) is None
    (tmp_path / BEST).write_bytes(b"x")
    os.utime(tmp_path / BEST, (1, 1))
    (tmp_path / BEST_SHARDED).mkdir()
    assert best_checkpoint(tmp_path) == tmp_path / BEST_SHARDED  # the newer of the two


def test_a_replaced_folder_cut_short_between_its_renames_is_put_back(tmp_path):
    from train.checkpoint.shards import recover_replaced, replace_folder

    (tmp_path / "best.dcp").mkdir()
    (tmp_path / "best.dcp" / "a").write_text("old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "a").write_text("new")
    replace_folder(tmp_path / "new", tmp_path / "best.dcp")
    assert (tmp_path / "best.dcp" / "a").read_text() == "new" and not (tmp_path / ".best.dcp.old").exists()
    os.rename(tmp_path / "best.dcp", tmp_path / ".best.dcp.old")  # as a crash after the first rename leaves it
    assert recover_replaced(tmp_path) == [tmp_path / "best.dcp"]
    assert (tmp_path / "best.dcp" / "a").read_text() == "new"


def _hand_made_folder(folder):
    """A sharded checkpoint's files without DCP: what damaged() checks is the manifest against the files."""
    from train.checkpoint import sealed
    from train.checkpoint.shards import COMPONENTS, MANIFEST, file_digest

    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"rank 0's shards")
    (folder / "__1_0.distcp").write_bytes(b"rank 1's shards")
    torch.save(sealed({"progress": {"global_step": 2}}), folder / COMPONENTS)
    files = {p.name: file_digest(p) for p in folder.iterdir()}
    (folder / MANIFEST).write_text(json.dumps({"format": "dcp", "ranks": 2, "files": files}))
    return folder


def test_a_sharded_checkpoint_is_damaged_by_any_file_missing_cut_or_changed(tmp_path):
    from train.checkpoint import small_components

    folder = _hand_made_folder(tmp_path / "step_00000002.dcp")
    assert unreadable(folder) is None and small_components(folder)["progress"] == {"global_step": 2}
    (folder / "__1_0.distcp").write_bytes(b"rank 1's shardz")  # same size, other bytes
    assert re.fullmatch(r"__1_0\.distcp hashes to \w+, but \w+ was written", unreadable(folder))
    (folder / "__1_0.distcp").write_bytes(b"cut")
    assert unreadable(folder) == "__1_0.distcp holds 3 bytes, 15 were written"
    (folder / "__1_0.distcp").unlink()
    assert unreadable(folder) == "__1_0.distcp is missing"
    (folder / "manifest.json").unlink()
    assert unreadable(folder).startswith("its manifest.json cannot be read")
    with pytest.raises(DataError, match=r"step_00000002.dcp cannot be used \(its manifest.json cannot be read"):
        load_checkpoint(folder)


def test_shards_that_other_nodes_wrote_elsewhere_are_refused_before_the_folder_is_named(tmp_path):
    from train.checkpoint.shards import _seal_folder

    partial = tmp_path / ".step_00000002.dcp.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    digests = [{"__0_0.distcp": {"bytes": 1, "xxh3_128": "0"}}, {"__1_0.distcp": {"bytes": 1, "xxh3_128": "0"}}]
    with pytest.raises(
        ConfigError, match=r"the shards __1_0.distcp written by other ranks are not in .*dist.checkpoint=auto"
    ):
        _seal_folder(partial, tmp_path / "step_00000002.dcp", {}, digests)
    assert not (tmp_path / "step_00000002.dcp").exists()


def test_a_packed_sharded_checkpoint_is_the_same_bytes_for_the_same_files_and_unpacks_only_intact(tmp_path):
    import tarfile

    from train.checkpoint.shards import pack, unpack

    folder = _hand_made_folder(tmp_path / "step_00000002.dcp")
    pack(folder, tmp_path / "a.tar")
    os.utime(folder / "__0_0.distcp", (5, 5))  # times and owners are not packed: the SHA1 names the content
    pack(folder, tmp_path / "b.tar")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    unpack(tmp_path / "a.tar", tmp_path / "fetched" / "step_00000002.dcp")
    assert unreadable(tmp_path / "fetched" / "step_00000002.dcp") is None

    (folder / "__1_0.distcp").write_bytes(b"rank 1's shardz")  # packed after its bytes changed
    pack(folder, tmp_path / "changed.tar")
    with pytest.raises(DataError, match=r"does not hold an intact sharded checkpoint: __1_0.distcp hashes to"):
        unpack(tmp_path / "changed.tar", tmp_path / "fetched" / "step_00000004.dcp")
    assert sorted(p.name for p in (tmp_path / "fetched").iterdir()) == ["step_00000002.dcp"]  # nothing partial

    with tarfile.open(tmp_path / "escape.tar", "w") as tar:
        tar.add(folder / "manifest.json", arcname="../manifest.json")
    with pytest.raises(DataError, match=r"'../manifest.json' is no file of a sharded checkpoint"):
        unpack(tmp_path / "escape.tar", tmp_path / "fetched" / "step_00000006.dcp")
    assert not (tmp_path / "manifest.json").exists()


def test_a_sharded_checkpoints_size_estimate_covers_what_dcp_writes(tmp_path):
    """A full disk during a sharded save said "needs 188.3 KiB" of a folder that took about 580: DCP writes each
    shard as a torch.save of its own, which costs more than the bytes of a small model's many small tensors."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from tests.helpers import free_port
    from train.checkpoint.shards import folder_bytes, save_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(12)))  # many small tensors, as the FNO's
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    final = tmp_path / "step_00000001.dcp"
    save_shards(final, model, optimizer, {"progress": {"global_step": 1}}, 0)
    written = sum(p.stat().st_size for p in final.iterdir())
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    assert written <= folder_bytes(state, 1) <= 3 * written, (written, folder_bytes(state, 1))
