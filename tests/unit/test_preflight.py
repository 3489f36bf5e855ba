"""The doctor's checks on simulated machines: GPU counts, SLURM allocations, /dev/shm sizes, ports, data."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.config import load_config
from train.data.cache.info import CacheInfo
from train.errors import PreflightError
from train.launch.capacity import MiB, sample_bytes, shm_need
from train.launch.doctor import (
    FAIL,
    PASS,
    WARN,
    Facts,
    check_data,
    check_device_data,
    check_gpus,
    check_memlock,
    check_model_state,
    check_remote,
    check_rendezvous,
    check_shm,
    check_versions,
    doctor,
    render,
)
from train.launch.targets.slurm import check_slurm, slurm_gpus_on_node
from train.launch.topology import Topology


def facts(gpus: int = 0, environ: dict | None = None, shm: tuple[int, int] | None = (1 << 34, 1 << 34), **kw) -> Facts:
    return Facts(
        environ=environ or {},
        gpus=gpus,
        versions={"torch": "2.x", "CUDA": "12.4" if gpus else None, "NCCL": "2.21" if gpus else None},
        shm=shm,
        memlock=kw.get("memlock", -1),
        container=kw.get("container"),
        nccl_available=gpus > 0,
        gpu_memory=kw.get("gpu_memory", 80 << 30 if gpus else 0),
    )


def config(*overrides: str, tmp: Path | None = None):
    folders = [f"run.{k}_dir={tmp / k}" for k in ("data", "cache", "runs")] if tmp else []
    return load_config("configs/tiny.yaml", [*folders, *overrides])


def cache(grid=(64,), autoregressive=True, in_channels=1, out_channels=1) -> CacheInfo:
    return CacheInfo(Path("/nonexistent"), "advection1d", autoregressive, grid, 41, in_channels, out_channels,
                     {}, (0.0,), (1.0,), (0.0,), (1.0,), {})  # fmt: skip


# --- GPUs and nproc --------------------------------------------------------------------------------------------


def test_more_ranks_than_gpus_fails_with_the_number_to_use():
    check = check_gpus(config(), 8, facts(gpus=1, environ={"CUDA_VISIBLE_DEVICES": "0"}))
    assert check.status == FAIL
    assert "nproc=8" in check.detail and "1 GPU" in check.detail
    assert "NPROC=1" in check.fix


def test_auto_uses_every_gpu_and_fewer_ranks_warn_about_idle_gpus():
    assert check_gpus(config(), None, facts(gpus=4)).status == PASS
    idle = check_gpus(config(), 2, facts(gpus=4))
    assert idle.status == WARN and "2 of 4" in idle.detail


def test_cuda_visible_devices_without_a_visible_gpu_warns():
    check = check_gpus(config(), None, facts(gpus=0, environ={"CUDA_VISIBLE_DEVICES": "0,1"}))
    assert check.status == WARN and "CUDA_VISIBLE_DEVICES=0,1" in check.detail and "no GPU" in check.detail


def test_cuda_visible_devices_listing_more_than_exist_warns():
    check = check_gpus(config(), 2, facts(gpus=2, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}))
    assert check.status == WARN and "lists 4" in check.detail


def test_unusable_nproc_fails():
    assert check_gpus(config(), "many", facts()).status == FAIL


def test_forced_nccl_without_gpus_fails_unless_fallback_is_allowed():
    env = {"DDP_BACKEND": "nccl"}
    assert check_versions(config(), facts(environ=env)).status == FAIL
    assert check_versions(config("dist.backend_fallback=true"), facts(environ=env)).status == WARN
    assert check_versions(config(), facts(gpus=2)).status == PASS


# --- SLURM -------------------------------------------------------------------------------------------------------


def test_one_gpu_granted_but_eight_tasks_fails():
    """The classic hang: --gres=gpu:1 with --ntasks-per-node=8."""
    env = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "1"}
    check = check_slurm(config(), None, facts(gpus=1, environ=env))
    assert check.status == FAIL
    assert "8 tasks per node" in check.detail and "1 GPU(s)" in check.detail
    assert "--ntasks-per-node=1" in check.fix


def test_more_ranks_than_granted_gpus_fails():
    env = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "1", "SLURM_NTASKS": "1", "SLURM_GPUS_PER_NODE": "h200:2"}
    check = check_slurm(config(), 4, facts(gpus=4, environ=env))
    assert check.status == FAIL and "granted 2" in check.detail


def test_ntasks_over_nodes_counts_tasks_per_node():
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}
    check = check_slurm(config(), None, facts(gpus=8, environ=env))
    assert check.status == FAIL and "8 tasks per node" in check.detail


def test_nnodes_contradicting_slurm_fails():
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "NNODES": "4"}
    check = check_slurm(config(), None, facts(gpus=0, environ=env))
    assert check.status == FAIL and "NNODES=4" in check.detail


def test_a_consistent_slurm_job_passes_and_no_job_means_no_row():
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8"}
    assert check_slurm(config(), None, facts(gpus=8, environ=env)).status == PASS
    assert check_slurm(config(), None, facts(gpus=8)) is None


def test_granted_gpus_from_each_slurm_variable():
    assert slurm_gpus_on_node({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert slurm_gpus_on_node({"SLURM_GPUS_PER_NODE": "a100:2"}) == 2
    assert slurm_gpus_on_node({"SLURM_JOB_GPUS": "0,3,5"}) == 3
    assert slurm_gpus_on_node({}) is None


# --- rendezvous ----------------------------------------------------------------------------------------------------


def test_busy_rendezvous_port_on_the_first_node_fails():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": f"127.0.0.1:{port}"}
        check, topology = check_rendezvous(config(), facts(environ=env))
    assert check.status == FAIL and f"port {port} is already in use" in check.detail
    assert topology is not None and topology.multi_node


def test_free_port_and_single_node_pass():
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    env = {"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": f"127.0.0.1:{port}"}
    assert check_rendezvous(config(), facts(environ=env))[0].status == PASS
    assert check_rendezvous(config(), facts())[0].status == PASS


def test_a_public_rendezvous_address_is_warned_about_and_a_private_one_passes():
    # A literal address and ADVERTISE_ADDR: nothing is resolved or routed, no packet leaves the machine.
    env = {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": "8.8.8.8:29400", "ADVERTISE_ADDR": "127.0.0.1"}
    check, _ = check_rendezvous(config(), facts(environ=env))
    assert check.status == WARN and "8.8.8.8 is a public address" in check.detail and "firewall" in check.fix
    check, _ = check_rendezvous(config(), facts(environ={**env, "RDZV_ENDPOINT": "10.9.8.7:29400"}))
    assert check.status == PASS and "this node advertises 127.0.0.1" in check.detail
    check, _ = check_rendezvous(config(), facts(environ={**env, "ADVERTISE_ADDR": "node1"}))
    assert check.status == FAIL and "ADVERTISE_ADDR" in check.detail


def test_multi_node_without_an_endpoint_fails():
    check, topology = check_rendezvous(config(), facts(environ={"NNODES": "2", "NODE_RANK": "1"}))
    assert check.status == FAIL and "RDZV_ENDPOINT" in check.detail and topology is None


# --- /dev/shm -------------------------------------------------------------------------------------------------------


def test_sample_bytes_counts_input_frames_and_target():
    assert sample_bytes(cache(grid=(64,)), initial_step=4) == 4 * 64 * (4 + 1)
    assert sample_bytes(cache(grid=(16, 16), autoregressive=False), initial_step=10) == 4 * 256 * 2


def test_shm_need_grows_with_workers_ranks_and_nccl():
    caches = {"advection1d": cache(grid=(64,)), "darcy2d": cache(grid=(16, 16), autoregressive=False)}
    assert shm_need(config(), 2, caches, "gloo")[0] == 0  # no workers: batches never cross processes
    cfg = config("train.num_workers=4")
    per_rank = (4 * 2 + 4) * (8 * 4 * 64 * 5 + 4 * 4 * 256 * 2)
    assert shm_need(cfg, 2, caches, "gloo")[0] == 2 * per_rank
    assert shm_need(cfg, 2, caches, "nccl")[0] > 2 * per_rank
    assert shm_need(cfg, 2, {"advection1d": None, "darcy2d": None}, "gloo")[0] is None


def test_docker_default_shm_fails_for_eight_gpus():
    check = check_shm(config(), 8, {}, facts(gpus=8, shm=(64 * MiB, 64 * MiB)))
    assert check.status == FAIL and "--shm-size" in check.fix
    roomy = check_shm(config(), 8, {}, facts(gpus=8, shm=(16 << 30, 16 << 30)))
    assert roomy.status == PASS


def test_dockers_default_shm_warns_even_when_it_suffices():
    check = check_shm(config(), 2, {}, facts(shm=(64 * MiB, 64 * MiB)))
    assert check.status == WARN and "Docker's 64 MB default" in check.detail and "--shm-size" in check.fix
    assert check_shm(config(), 2, {}, facts(shm=(1 << 30, 1 << 30))).status == PASS


def test_shm_just_above_the_need_warns():
    caches = {"advection1d": cache(grid=(64,)), "darcy2d": cache(grid=(16, 16), autoregressive=False)}
    cfg = config("train.num_workers=4")
    need = shm_need(cfg, 2, caches, "gloo")[0]
    assert check_shm(cfg, 2, caches, facts(shm=(need * 3 // 2, need * 3 // 2))).status == WARN
    assert check_shm(cfg, 2, caches, facts(shm=(need // 2, need // 2))).status == FAIL


def test_the_doctor_counts_the_training_arrays_a_gpu_holds_and_says_no_gpu_on_cpu(tmp_path):
    from tests.unit.test_dataset import _adv_cache, _darcy_cache
    from train.data.dataset import WindowDataset
    from train.data.device_data import dataset_bytes
    from train.launch.capacity import device_data_need

    cfg = config("tasks.advection1d.initial_step=2", "train.objective=one_step")
    adv, darcy = _adv_cache(tmp_path), _darcy_cache(tmp_path)
    caches = {"advection1d": adv, "darcy2d": darcy}
    # What the trainer copies, counted from the cache's manifest before any dataset is opened.
    arrays = dataset_bytes([WindowDataset(adv, "train", 2)]) + darcy.array("train", "x").nbytes * 2
    assert device_data_need(cfg, caches) == arrays
    assert "no GPU" in check_device_data(cfg, caches, facts()).detail
    assert check_device_data(cfg, caches, facts(gpus=1)).status == PASS
    small = facts(gpus=1, gpu_memory=arrays)  # half of it is the share
    assert check_device_data(cfg, caches, small).status == WARN
    forced = check_device_data(config("tasks.advection1d.initial_step=2", "train.objective=one_step",
                                       "train.data_on_device=true"), caches, small)  # fmt: skip
    assert forced.status == FAIL and "train.data_on_device_share" in forced.fix


# --- data, memlock, the table ----------------------------------------------------------------------------------------


def test_data_check_names_missing_files_and_credentials(tmp_path):
    cfg = config(f"tasks.advection1d.source={tmp_path}/gone.hdf5", "tasks.darcy2d.source=b2://bucket/pdebench")
    check = check_data(cfg, facts())
    assert check.status == FAIL
    assert "gone.hdf5 not found" in check.detail and "B2_APPLICATION_KEY_ID" in check.detail
    creds = {"B2_APPLICATION_KEY_ID": "id", "B2_APPLICATION_KEY": "k"}
    cfg = config("tasks.darcy2d.source=b2://bucket/pdebench")
    assert check_data(cfg, facts(environ=creds)).status == PASS


def test_memlock_matters_only_for_gpus_across_nodes():
    multi = Topology(2, 0, "h:1", "x", "environment")
    assert check_memlock(facts(gpus=8, memlock=64 * 1024), multi).status == WARN
    assert check_memlock(facts(gpus=8, memlock=64 * 1024), None).status == PASS
    assert check_memlock(facts(gpus=8, memlock=-1), multi).status == PASS


def test_doctor_raises_preflight_error_with_exit_code_4_and_prints_fixes(tmp_path, capsys):
    with pytest.raises(PreflightError) as e:
        doctor(config(tmp=tmp_path), 8, caches={}, facts=facts(gpus=2))
    assert e.value.exit_code == 4 and "nproc vs GPUs" in str(e.value)
    out = capsys.readouterr().out
    assert "FAIL  nproc vs GPUs" in out and "fix: use NPROC=auto or NPROC=2" in out


def test_doctor_passes_on_a_consistent_machine(tmp_path, capsys):
    checks = doctor(config(tmp=tmp_path), None, caches={}, facts=facts(gpus=0))
    assert all(c.status == PASS for c in checks), render(checks)
    assert {c.name for c in checks} >= {"libraries", "nproc vs GPUs", "/dev/shm", "disk", "data", "memlock"}


def test_the_remote_row_says_whether_the_remote_answers_and_what_it_holds(tmp_path, monkeypatch):
    from tests.b2sim import Account

    assert check_remote(config(tmp=tmp_path)) is None  # no remote, no row
    folder = check_remote(config("run.remote=" + str(tmp_path / "shared"), tmp=tmp_path))
    assert folder.status == PASS and "reachable, no checkpoint yet" in folder.detail
    account = Account(monkeypatch)
    good = check_remote(config("run.remote=b2://pdebench/runs", tmp=tmp_path), account.api)
    assert good.status == PASS and good.detail.startswith("b2://pdebench/runs/tiny: reachable")
    monkeypatch.delenv("B2_APPLICATION_KEY")
    missing = check_remote(config("run.remote=b2://pdebench/runs", tmp=tmp_path), account.api)
    assert missing.status == FAIL and "B2_APPLICATION_KEY" in missing.detail and "B2_APPLICATION_KEY" in missing.fix


@pytest.mark.parametrize(
    "settings",
    [
        ["model.name=fno"],
        ["model.name=fno", "model.fno.width=32", "model.fno.modes=16"],
        ["model.name=unet"],
        ["model.name=unet", "model.unet.init_features=8"],
        ["model.name=transformer", "model.transformer.d_model=64", "model.transformer.n_layers=2"],
    ],
)
def test_the_disk_estimate_of_a_checkpoint_follows_the_model_built(settings):
    """Within a third of the parameters the model really has, for the default tasks' grids."""
    from train.engine.loaders import initial_model
    from train.launch.capacity import parameter_estimate
    from train.model.specs import TaskData, TaskSpec

    cfg = load_config(Path(__file__).parents[2] / "configs/default.yaml", settings)
    specs = {"advection1d": TaskSpec((256,), 1, 1, 8, 10, True), "darcy2d": TaskSpec((64, 64), 1, 1, 8, 1, False)}
    tasks = [TaskData(name, None, spec) for name, spec in specs.items()]  # the model is built from the specs
    real = sum(p.numel() for p in initial_model(cfg, tasks, torch.device("cpu")).parameters())
    assert abs(parameter_estimate(cfg) - real) < real / 3, (parameter_estimate(cfg), real)


@pytest.mark.parametrize("model", ["model.name=fno", "model.name=unet"])
def test_the_parameter_estimate_covers_3d_models(tmp_path, model):
    """A 3D CFD task: within a third of the parameters the FNO (four blocks of 3D modes) or U-Net really has."""
    from train.engine.loaders import initial_model
    from train.launch.capacity import parameter_estimate
    from train.model.specs import TaskData, TaskSpec

    config = tmp_path / "cfd3d.yaml"
    config.write_text("tasks:\n  cfd3d: {pde: cfd3d, source: x.hdf5, initial_step: 10}\n")
    cfg = load_config(config, [model, "model.fno.modes=8"])
    tasks = [TaskData("cfd3d", None, TaskSpec((32, 32, 32), 5, 5, 8, 10, True))]
    real = sum(p.numel() for p in initial_model(cfg, tasks, torch.device("cpu")).parameters())
    assert abs(parameter_estimate(cfg) - real) < real / 3, (parameter_estimate(cfg), real)


_COUNT_AND_LIST_IMPORTS = """
import sys
from train.config import load_config
from train.launch.capacity import parameter_estimate
for config, override in (("configs/pretrain.yaml", None), ("configs/default.yaml", None), *(("configs/tiny.yaml",
                         f"model.name={m}") for m in ("fno", "unet", "transformer", "conv", "resnet"))):
    assert parameter_estimate(load_config(config, [override] if override else [])) > 0
    imported = [m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules]
    if imported:
        sys.exit(f"counting the parameters of {config} ({override or 'as it is'}) imported {', '.join(imported)}")
"""


def test_counting_a_built_in_models_parameters_imports_no_compiler():
    """The doctor counts the parameters on the meta device before every launch. Arithmetic on a meta tensor
    (``0.02 * randn``, an FNO's DFT angles) ran PyTorch's Python meta kernels, which imported dynamo, inductor
    and sympy: 3 CPU seconds of each launch of the FNO or the multi-physics model. Every built-in model, counted
    in one fresh process as the launcher counts, the first that imports one named."""
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_AND_LIST_IMPORTS],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_disk_plan_counts_no_copy_for_a_cache_in_place_and_the_strided_share_otherwise(tmp_path):
    import h5py
    import numpy as np

    from train.launch.capacity import cache_bytes

    plain, chunked = tmp_path / "plain.hdf5", tmp_path / "chunked.hdf5"
    data = np.zeros((8, 11, 64), np.float32)
    with h5py.File(plain, "w") as f:
        f.create_dataset("tensor", data=data)
    with h5py.File(chunked, "w") as f:
        f.create_dataset("tensor", data=data, chunks=(1, 11, 64), compression="gzip")
    cfg = load_config(Path(__file__).parents[2] / "configs/tiny.yaml")
    whole = cfg.tasks["advection1d"].model_copy(update={"temporal_stride": 1, "spatial_stride": 1})
    strided = whole.model_copy(update={"temporal_stride": 5, "spatial_stride": 2})
    assert cache_bytes(whole, plain, 1000) == 0  # mapped where it lies
    assert cache_bytes(whole, None, 1000) == 0  # a file still to generate: plain float32 too
    assert cache_bytes(whole, chunked, 1000) == 1000  # compressed: copied whole
    assert cache_bytes(strided, plain, 1000) == 100  # the strided share


def test_a_disk_too_small_for_source_cache_and_checkpoints_fails_with_the_numbers(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from train.launch import doctor

    cfg = load_config(
        Path(__file__).parents[2] / "configs/tiny.yaml",
        [f"run.{d}_dir={tmp_path / d}" for d in ("data", "cache", "runs")]
        + [f"tasks.advection1d.{k}" for k in ("n_samples=20000", "resolution=1024", "temporal_stride=2")],
    )
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 10 << 30))
    check = doctor.check_disk(cfg, {})
    assert check.status == doctor.FAIL, check
    # 16.5 GB of advection to generate, its temporal_stride-2 copy in the cache: both named, with the total
    assert "10.0 GiB free" in check.detail and f"{tmp_path / 'data'} 15.3 GiB" in check.detail
    assert f"{tmp_path / 'cache'} 7.7 GiB" in check.detail and "needs about 23.0 GiB" in check.detail
    assert "+ a 256.0 MiB margin" in check.detail  # what the verdict counts is said: "20 MiB free, needs 1 MiB" failed


def test_the_gpu_config_passes_the_doctor_on_a_cpu_with_a_no_gpu_note(tmp_path):
    from train.launch.doctor import run_checks

    cfg = load_config("configs/gpu.yaml", [f"run.{k}_dir={tmp_path / k}" for k in ("data", "cache", "runs")])
    checks = {c.name: c for c in run_checks(cfg, None, facts(), {}, data=True)}
    assert checks["nproc vs GPUs"].status == PASS and "no GPU" in checks["nproc vs GPUs"].detail
    assert checks["data on device"].status == PASS and "no GPU" in checks["data on device"].detail
    # The disk's verdict is the machine's (9.6 GiB of generated data); every other check passes.
    assert all(c.status != FAIL for name, c in checks.items() if name != "disk"), render(list(checks.values()))


def test_the_model_state_per_rank_shrinks_with_sharding_and_a_model_too_large_for_ddp_is_named():
    big = ("model.transformer.d_model=1024", "model.transformer.n_layers=24", "model.transformer.n_heads=16")
    ddp = check_model_state(config(*big), 8, facts(gpus=8, gpu_memory=4 << 30))
    assert ddp.status == FAIL and "dist.parallel=fsdp" in ddp.fix and "under dist.parallel=ddp" in ddp.detail
    fsdp = check_model_state(config(*big, "dist.parallel=fsdp"), 8, facts(gpus=8, gpu_memory=4 << 30))
    assert fsdp.status == PASS and "under ddp)" in fsdp.detail
    from train.launch.capacity import model_state_per_rank

    sharded, whole = model_state_per_rank(config(*big, "dist.parallel=fsdp"), 8, 4)
    assert sharded == whole // 8 and whole > 4 << 30
    assert model_state_per_rank(config(*big, "dist.parallel=hsdp"), 8, 4)[0] == whole // 4  # a node's 4 ranks
    assert check_model_state(config("model.name=x.py:build"), 2, facts()) is None


def test_the_doctor_warns_when_the_machines_load_leaves_fewer_free_cores_than_the_threads_asked():
    """On 2 cores at a load of 4-5, one rank with 2 threads ran at ~5 steps/s and with 1 thread at ~33."""
    from dataclasses import replace

    from train.launch.doctor import check_threads

    busy = replace(facts(), cores=2, load=4.5)
    check = check_threads(1, busy)
    assert check.status == "warn" and "1 rank(s) x 2 thread(s)" in check.detail and "OMP_NUM_THREADS=1" in check.fix
    assert check_threads(1, replace(busy, environ={"OMP_NUM_THREADS": "1"})).status == "pass"
    assert check_threads(2, busy).status == "pass"  # 1 thread each: nothing to lower but NPROC
    assert check_threads(1, replace(busy, load=0.1)).status == "pass"
    assert check_threads(1, facts()) is None  # cores and load unknown
