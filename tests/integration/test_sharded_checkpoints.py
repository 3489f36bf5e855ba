"""Sharded checkpoints (dist.checkpoint=auto under fsdp on one node): folders of every rank's shards written by
real torchrun processes (the farm's fsdp reference: 2 gloo ranks, 160 steps, a checkpoint every 10), read back
by every reader, a corrupt shard set aside, and one file made of them by ``python -m train consolidate``.
(SIGKILL and SIGTERM replayed bitwise from them: tests/integration/test_faults.py's fsdp variant; another
strategy and world size resuming them: test_sharded_runs.py; a full disk while shards are written:
test_full_disk.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.farm import fit_argv
from tests.helpers import run_cli
from train.checkpoint import INTEGRITY, MODEL, OPTIMIZER, PROGRESS, list_checkpoints, load_checkpoint, unreadable

pytestmark = pytest.mark.integration


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_a_sharded_runs_checkpoints_are_folders_of_every_ranks_shards(farm):
    folder = farm.reference_run("fsdp") / "checkpoints"
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000150.dcp", "step_00000160.dcp"]  # keep 2
    assert not [p for p in folder.iterdir() if p.name.endswith((".pt", ".partial", ".old"))]
    newest = folder / "step_00000160.dcp"
    names = {p.name for p in newest.iterdir()}
    assert names == {".metadata", "__0_0.distcp", "__1_0.distcp", "components.pt", "manifest.json"}, names
    assert unreadable(newest) is None
    state = load_checkpoint(newest)  # consolidated: the whole state, as a file checkpoint holds it
    assert state[PROGRESS]["global_step"] == 160
    assert set(state[OPTIMIZER]["state"]) == set(range(len(state[OPTIMIZER]["state"])))  # by position
    whole = sum(t.nbytes for t in state[MODEL].values())
    for rank in (0, 1):  # each rank wrote its own shards: about half the weights and optimizer state
        assert (newest / f"__{rank}_0.distcp").stat().st_size < 0.8 * 3 * whole


def test_a_corrupt_shard_is_set_aside_and_the_run_redoes_the_steps_bitwise(tmp_path, farm):
    shutil.copytree(farm.reference_run("fsdp").parents[1], tmp_path, dirs_exist_ok=True)
    checkpoints = tmp_path / "runs" / "reference" / "checkpoints"
    newest = checkpoints / "step_00000160.dcp"
    straight = load_checkpoint(newest)[MODEL]
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: bit rot, a bad copy
    shard.write_bytes(bytes(data))
    assert "__1_0.distcp hashes to" in unreadable(newest)
    leftover = checkpoints / ".step_00000170.dcp.partial"  # what a writer killed mid-save leaves
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half")

    again = run_cli(*fit_argv(tmp_path, "reference", "--set", "dist.parallel=fsdp"))
    assert again.returncode == 0, again.stderr[-4000:]
    assert "checkpoint step_00000160.dcp cannot be read (__1_0.distcp hashes to" in again.stderr
    assert f"resumed from {checkpoints / 'step_00000150.dcp'}" in again.stderr
    (kept,) = (checkpoints / "corrupt").glob("step_00000160.dcp.*")
    assert (kept / "__1_0.distcp").read_bytes() == bytes(data)  # moved aside whole, never deleted
    assert not leftover.exists()  # taken by nothing, removed by the next save
    redone = load_checkpoint(newest)[MODEL]
    assert all(torch.equal(redone[k], straight[k]) for k in straight)  # steps 151-160 again, from the shards


def test_consolidate_writes_one_file_that_every_reader_loads_as_the_folder(tmp_path, farm):
    from train.use.surrogate import Surrogate

    source = farm.reference_run("fsdp") / "checkpoints" / "step_00000160.dcp"
    one = tmp_path / "one.pt"
    proc = run_cli("consolidate", "--run", str(source), "--output", str(one))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"consolidated {source} into {one}" in proc.stdout
    assert unreadable(one) is None  # sealed with its checksum, as every file checkpoint
    written, folder = load_checkpoint(one), load_checkpoint(source)
    assert _equal({k: v for k, v in written.items() if k != INTEGRITY}, folder)
    a, b = Surrogate.load(source), Surrogate.load(one)
    assert _equal(a.model.state_dict(), b.model.state_dict())

    again = run_cli("consolidate", "--run", str(one))
    assert again.returncode == 2 and "is already one file" in again.stderr


def test_consolidate_never_writes_into_a_runs_checkpoints_and_checks_before_it_loads(tmp_path, farm):
    """--output was written anywhere: over another checkpoint's shard (exit 0), as step_N.pt (the run's newest
    checkpoint then, so the next launch rewound), and naming the folder itself ended in a traceback (exit 1)."""
    shutil.copytree(farm.reference_run("fsdp").parents[1], tmp_path, dirs_exist_ok=True)
    checkpoints = tmp_path / "runs" / "reference" / "checkpoints"
    source, other = checkpoints / "step_00000160.dcp", checkpoints / "step_00000150.dcp"
    before = {p: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()}
    for output in (other / "__0_0.distcp", checkpoints / "step_00000170.pt", other, tmp_path / "elsewhere.dcp"):
        if output.name == "elsewhere.dcp":  # a sharded checkpoint outside any run folder is no output either
            shutil.copytree(other, output)
            output = output / "__0_0.distcp"
        proc = run_cli("consolidate", "--run", str(source), "--output", str(output))
        assert proc.returncode == 2, (output, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr and "writing there would" in proc.stderr, proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in checkpoints.rglob("*") if p.is_file()} == before

    (source / "components.pt").write_bytes(b"damaged")
    damaged = run_cli("consolidate", "--run", str(source), "--output", str(tmp_path / "one.pt"))
    assert damaged.returncode == 3, damaged.stderr[-3000:]
    assert "Re-run the same command" not in damaged.stderr and "--checkpoint" in damaged.stderr


def test_a_sharded_checkpoint_under_another_steps_name_is_unusable(tmp_path, farm):
    """step_150.dcp renamed step_170.dcp was taken for the newest and resumed as step 150 without a word."""
    renamed = tmp_path / "step_00000170.dcp"
    shutil.copytree(farm.reference_run("fsdp") / "checkpoints" / "step_00000150.dcp", renamed)
    assert "it records global step 150, but its name says step 170" in unreadable(renamed)


def test_fine_tuning_starts_from_a_sharded_checkpoint(farm):
    """train.init_from names the folder: the launcher records it (the SHA-256 of its manifest), every rank loads
    its consolidated weights."""
    from tests.farm import LONG
    from tests.helpers import REPO
    from train.config import load_config
    from train.engine.init_from import load_initial_weights
    from train.use.surrogate import Surrogate, resolve_initial_weights

    source = farm.reference_run("fsdp") / "checkpoints" / "step_00000160.dcp"
    cfg = load_config(REPO / "configs" / "tiny.yaml", [*(a for a in LONG if "=" in a), f"train.init_from={source}"])
    record = resolve_initial_weights(cfg)
    assert record["checkpoint"] == str(source.resolve()) and len(record["sha256"]) == 64
    model = Surrogate.load(source).model
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    done = load_initial_weights(model, cfg, record)
    assert done, done
    assert _equal(model.state_dict(), load_checkpoint(source)[MODEL])
