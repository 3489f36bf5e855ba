"""Two boxes without a shared disk: one launcher and one rank on each, each box with its own run, data and cache
folders, meeting across a veth pair.

Every interrupted run must end with weights bitwise equal to the uninterrupted one (CPU, eager, gloo), whatever
the other box's own run folder holds: node 0 decides the stages and the checkpoint, and rank 0, always on node
0, sends the checkpoint's bytes to the ranks of node 1. (One test gives both boxes one runs folder, as a shared
file system does: a sharded model's checkpoints are then every rank's shards.)
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import assert_bitwise_equal, folders, run_cli, startup_s
from tests.multinode.hosts import Box
from train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from train.obs.sinks import read_metrics

# 80 steps of a few tens of ms: a window of seconds in which to interrupt the run at a random step.
LONG = [
    "--set", "train.epochs=2", "--set", "train.steps_per_epoch=40", "--set", "train.checkpoint_every=10",
    "--set", "train.log_every=1", "--set", "model.d_model=64", "--set", "model.n_layers=2",
    "--set", "model.dropout=0.1", "--set", "dist.timeout_s=60",
]  # fmt: skip
STEPS = 80
_ports = iter(range(29600 + os.getpid() % 1000 * 10, 65000))


class Job:
    """One launch on both boxes: a launcher per box, NODE_RANK = the box's index."""

    def __init__(
        self, boxes: list[Box], root: Path, command: str, run: str, *extra: str, tag: str = "", shared_runs=None
    ):
        """``shared_runs``: one runs folder both boxes write into (a shared file system)."""
        self.boxes, self.root, self.run, self.shared_runs = boxes, root, run, shared_runs
        endpoint = f"{boxes[0].address}:{next(_ports)}"
        self.logs = [root / f"{run}{tag}-node{b.index}.log" for b in boxes]
        args = [command, "--config", "configs/tiny.yaml", "--nproc", "1", "--run", run, *extra]
        self.procs = []
        for box, log in zip(boxes, self.logs, strict=True):
            env = {"NNODES": "2", "NODE_RANK": str(box.index), "RDZV_ENDPOINT": endpoint, "RDZV_ID": run}
            shared = ["--set", f"run.runs_dir={shared_runs}"] if shared_runs else []
            self.procs.append(box.popen(*args, *box.folders(root), *shared, env=env, log=log))

    def run_dir(self, node: int) -> Path:
        if self.shared_runs is not None:
            return self.shared_runs / self.run
        return self.root / self.boxes[node].hostname / "runs" / self.run

    def output(self, node: int) -> str:
        return self.logs[node].read_text()

    def wait(self, timeout: float | None = None) -> list[int]:
        timeout = timeout or 120 * startup_s()
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def outputs(self) -> str:
        return "\n".join(f"--- node {n} ---\n{self.output(n)[-4000:]}" for n in range(2))

    def wait_for_step(self, step: int) -> int:
        """Poll rank 0's metrics (on node 0) until it logged ``step``; returns the newest step seen."""
        metrics = self.run_dir(0) / "metrics.jsonl"
        deadline = time.monotonic() + 60 * startup_s()
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in self.procs), f"a launcher ended before step {step}:\n{self.outputs()}"
            lines = [r for r in read_metrics(metrics) if "loss" in r]
            if lines and lines[-1]["step"] >= step:
                return lines[-1]["step"]
            time.sleep(0.005)
        raise AssertionError(f"step {step} not reached:\n{self.outputs()}")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert state["progress"]["global_step"] == STEPS, state["progress"]
    return state["model"]


@pytest.fixture(scope="module")
def reference(boxes, tmp_path_factory) -> Job:
    """The uninterrupted two-box run (all stages), ended."""
    job = Job(boxes, tmp_path_factory.mktemp("two-boxes"), "run", "reference", *LONG)
    codes = job.wait()
    assert codes == [0, 0], job.outputs()
    return job


def test_a_fresh_run_keeps_the_run_on_node_0_and_a_relaunch_trains_nothing(boxes, reference):
    node0, node1 = reference.run_dir(0), reference.run_dir(1)
    assert (node0 / "report" / "summary.json").is_file() and len(list_checkpoints(node0 / "checkpoints")) > 0
    # Rank 0 is on node 0 (though torchrun numbered node 1's agent first): node 1 keeps only its rank's log.
    assert not list_checkpoints(node1 / "checkpoints") and not (node1 / "report").exists()
    assert "training from epoch 1" in (node1 / "logs" / "rank1.log").read_text()
    assert not (node1 / "logs" / "rank0.log").exists()
    assert "node 0 decided: fit and evaluate" in reference.output(1)
    assert "this node's own" in reference.output(1)

    # A stale checkpoint on node 1 must not matter: node 0 decides, and rank 0 sends its checkpoint.
    (node1 / "checkpoints").mkdir(parents=True, exist_ok=True)
    shutil.copy(list_checkpoints(node0 / "checkpoints")[0], node1 / "checkpoints")
    before = final_weights(node0)
    again = Job(boxes, reference.root, "run", "reference", *LONG, tag="-again")
    assert again.wait() == [0, 0], again.outputs()
    assert "already holds 2 trained epochs" in again.output(0) and "is up to date" in again.output(0)
    assert "node 0 decided: nothing to do" in again.output(1)
    assert "launching" not in again.output(0) + again.output(1)
    assert_bitwise_equal(final_weights(node0), before)


def test_a_killed_node_stops_the_other_naming_it_and_the_relaunch_ends_bitwise_equal(boxes, reference, tmp_path):
    at = random.Random().randrange(15, STEPS - 15)
    print(f"SIGKILL to node 1's launcher at step {at}")
    job = Job(boxes, tmp_path, "fit", "killed", *LONG)
    job.wait_for_step(at)
    killed = time.monotonic()
    job.procs[1].kill()  # the launcher alone: its rank dies with it (parent-death signal)
    code = job.procs[0].wait(timeout=120 * startup_s())
    print(f"node 0 ended {time.monotonic() - killed:.1f} s after node 1's launcher was killed")
    assert time.monotonic() - killed < 30 * max(1.0, startup_s() / 2), job.outputs()
    job.kill()
    assert code == 5, job.outputs()
    assert "node(s) 1 stopped answering while the ranks ran" in job.output(0)
    assert "Traceback" not in job.output(0)  # a peer that went away is no bug of this node's

    again = Job(boxes, tmp_path, "fit", "killed", *LONG, tag="-again")
    assert again.wait() == [0, 0], again.outputs()
    assert "sent to these ranks by rank 0" in again.output(1)
    assert_bitwise_equal(final_weights(again.run_dir(0)), final_weights(reference.run_dir(0)))


def stop_both(job: Job, at: int) -> None:
    """SIGTERM to both jobs (launcher, rank, workers), as a scheduler preempting them; both must end 75."""
    job.wait_for_step(at)
    for p in job.procs:
        os.killpg(p.pid, signal.SIGTERM)
    assert job.wait() == [75, 75], job.outputs()


def test_sigterm_to_both_ends_75_on_both_and_the_relaunch_ends_bitwise_equal(boxes, reference, tmp_path):
    at = random.Random().randrange(15, STEPS - 15)
    print(f"SIGTERM to both at step {at}")
    job = Job(boxes, tmp_path, "fit", "preempted", *LONG)
    stop_both(job, at)
    assert "node 0: stopped by" in job.output(1)
    again = Job(boxes, tmp_path, "fit", "preempted", *LONG, tag="-again")
    assert again.wait() == [0, 0], again.outputs()
    assert_bitwise_equal(final_weights(again.run_dir(0)), final_weights(reference.run_dir(0)))


def test_with_a_remote_two_interruptions_and_a_new_node_0_end_bitwise_equal(boxes, reference, tmp_path):
    remote = tmp_path / "remote"
    extra = [*LONG, "--set", f"run.remote={remote}", "--set", "run.remote_wait_s=60"]
    # The new node 0's run folder comes back from the remote with its metrics up to the first stop (a step or two
    # past `first`): the second stop is at least 10 steps later, so that only the resumed run's own steps reach it.
    rng = random.Random()
    first = rng.randrange(15, STEPS - 25)
    second = rng.randrange(first + 10, STEPS - 15)
    print(f"SIGTERM to both at step {first}, node 0 replaced, SIGTERM again at step {second} (or later)")
    job = Job(boxes, tmp_path, "fit", "mirrored", *extra)
    stop_both(job, first)
    shutil.rmtree(job.run_dir(0))  # node 0 is a new box: the run comes back from the remote
    job = Job(boxes, tmp_path, "fit", "mirrored", *extra, tag="-2")
    stop_both(job, second)
    assert "remote: resuming from" in job.output(0)
    job = Job(boxes, tmp_path, "fit", "mirrored", *extra, tag="-3")
    assert job.wait() == [0, 0], job.outputs()
    assert_bitwise_equal(final_weights(job.run_dir(0)), final_weights(reference.run_dir(0)))
    # Node 1 mirrored its rank's logs alone: the remote's metrics are node 0's, up to the last step.
    assert read_metrics(remote / "mirrored" / "metrics.jsonl")[-1]["step"] >= STEPS
    assert (remote / "mirrored" / "logs" / "rank1.log").is_file()
    assert not list_checkpoints(job.run_dir(1) / "checkpoints")


def test_fsdp_across_boxes_writes_one_file_on_their_own_disks_and_shards_on_a_shared_one(boxes, tmp_path):
    """dist.checkpoint=auto under fsdp: boxes with run folders of their own get one file, gathered onto rank 0
    (rank 0 sends it to node 1 on a resume); boxes sharing one runs folder get every rank's shards in one folder.
    A SIGTERMed run on the shared folder resumes from its shards bitwise equal to the run on separate disks."""
    fsdp = [*LONG, "--set", "dist.parallel=fsdp"]
    alone = Job(boxes, tmp_path, "fit", "fsdp", *fsdp)
    assert alone.wait() == [0, 0], alone.outputs()
    assert "the nodes keep run folders of their own: one file" in (alone.run_dir(0) / "logs" / "rank0.log").read_text()
    assert [p.suffix for p in list_checkpoints(alone.run_dir(0) / "checkpoints")] == [".pt", ".pt"]

    shared = tmp_path / "shared-runs"
    at = random.Random().randrange(15, STEPS - 15)
    print(f"SIGTERM to both at step {at}, on a shared runs folder")
    job = Job(boxes, tmp_path, "fit", "fsdp", *fsdp, tag="-shared", shared_runs=shared)
    stop_both(job, at)
    newest = latest_checkpoint(job.run_dir(0) / "checkpoints")
    assert newest.suffix == ".dcp" and {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in newest.iterdir()}
    again = Job(boxes, tmp_path, "fit", "fsdp", *fsdp, tag="-shared-again", shared_runs=shared)
    assert again.wait() == [0, 0], again.outputs()
    assert f"resumed from {newest}" in (job.run_dir(0) / "logs" / "rank0.log").read_text()
    assert_bitwise_equal(final_weights(job.run_dir(0)), final_weights(alone.run_dir(0)))


def test_an_address_node_0_cannot_reach_fails_before_the_launch_naming_it(boxes, tmp_path):
    # Node 1 advertises its loopback address, which node 0 cannot reach: named before any rank starts.
    env = {"NNODES": "2", "RDZV_ENDPOINT": f"{boxes[0].address}:{next(_ports)}", "RDZV_ID": "u"}
    args = ["smoke", "--config", "configs/tiny.yaml", "--nproc", "1", "--skip-compile"]
    procs = [
        box.popen(*args, *box.folders(tmp_path), env={**env, "NODE_RANK": str(box.index),
                  **({"ADVERTISE_ADDR": "127.0.0.1"} if box.index == 1 else {})}, log=tmp_path / f"u{box.index}.log")
        for box in boxes
    ]  # fmt: skip
    codes = [p.wait(timeout=60 * startup_s()) for p in procs]
    outputs = [(tmp_path / f"u{n}.log").read_text() for n in range(2)]
    assert codes[0] == 4 and codes[1] in (4, 5), outputs
    assert "node 1 advertises 127.0.0.1, which this node" in outputs[0], outputs[0][-3000:]
    assert "launching" not in outputs[0] + outputs[1]


def test_the_doctor_and_launch_log_name_the_advertised_addresses(boxes, reference):
    for node, box in enumerate(boxes):
        assert f"node {node} advertises {box.address}; every node reaches every other" in reference.output(node)
        assert f"--local-addr={box.address}" in reference.output(node)


def test_ip_netns_is_what_separates_the_boxes(boxes):
    # The boxes reach each other only through their veth pair, and neither resolves the other's hostname.
    probe = subprocess.run(
        boxes[1].command("python3", "-c", f"import socket; socket.gethostbyname({boxes[0].hostname!r})"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.returncode != 0


def test_two_boxes_stream_one_shard_set_into_their_own_caches_and_train_as_one_box_does(boxes, tmp_path):
    """A shard set served from box 0 (an HTTP server in its namespace): each box's launcher fetches the val and test
    files, each box's rank its shards, into that box's own cache; the weights are those of two ranks on one box."""
    source = {"tasks": {"adv": {"pde": "advection1d", "n_samples": 80, "resolution": 64, "temporal_stride": 10}}}
    (tmp_path / "source.yaml").write_text(yaml.safe_dump(source))
    proc = run_cli("shard", "--config", str(tmp_path / "source.yaml"), *folders(tmp_path / "host"),
                   "--output", str(tmp_path / "set"), "--shard-mb", "0.016")  # fmt: skip
    assert proc.returncode == 0, proc.stderr

    def config(location: str, name: str) -> Path:
        task = {"pde": "advection1d", "source": location, "initial_step": 4, "batch_size": 16}
        streamed = {
            "tasks": {"adv": task},
            "model": {"name": "fno", "fno": {"modes": 8, "width": 8}},
            "data": {"stream": True, "block_shards": 1, "cache_limit": "60KB"},
            "train": {"epochs": 2, "steps_per_epoch": 6},
        }
        (tmp_path / name).write_text(yaml.safe_dump(streamed))
        return tmp_path / name

    port = next(_ports)
    server = subprocess.Popen(
        boxes[0].command(sys.executable, "-m", "http.server", str(port), "--bind", boxes[0].address,
                         "--directory", str(tmp_path / "set")),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        remote = config(f"http://{boxes[0].address}:{port}/adv", "remote.yaml")
        job = Job(boxes, tmp_path, "fit", "streamed", "--config", str(remote), "--set", "dist.timeout_s=60")
        assert job.wait() == [0, 0], job.outputs()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    for box in boxes:  # each box fetched into its own cache, within the limit
        cache = next((tmp_path / box.hostname / "cache" / "adv").glob("stream-*"))
        assert (cache / "val.npy").is_file() and (cache / "shards" / "fetched.jsonl").is_file(), box.hostname
        assert sum(p.stat().st_size for p in (cache / "shards").glob("*.npy")) <= 60_000
    one_box = run_cli("fit", "--config", str(config(str(tmp_path / "set" / "adv"), "local.yaml")), "--nproc", "2",
                      "--run", "one-box", *folders(tmp_path / "host"))  # fmt: skip
    assert one_box.returncode == 0, one_box.stderr[-3000:]
    two = load_checkpoint(latest_checkpoint(job.run_dir(0) / "checkpoints"))
    one = load_checkpoint(latest_checkpoint(tmp_path / "host" / "runs" / "one-box" / "checkpoints"))
    assert two["progress"]["global_step"] == one["progress"]["global_step"] == 12
    assert_bitwise_equal(two["model"], one["model"])


class EngineJob(Job):
    """The job an engine's file says, run on both boxes with exactly the variables that engine sets: SkyPilot's
    task's run section, or the Indexed Job's pod command with each pod's index and its Service's DNS name (pod
    0's name in each box's /etc/hosts, as the cluster's DNS answers it). Each box appends its own folders and the
    shared remote folder, standing in for the bucket the file names."""

    def __init__(self, boxes: list[Box], root: Path, engine: str, run: str, remote: Path, tag: str = ""):
        from train.config import load_config
        from train.launch.targets import target_named

        self.boxes, self.root, self.run, self.shared_runs = boxes, root, run, None
        overrides = [
            *LONG[1::2],
            "dist.nproc=1",
            "run.remote=b2://bucket/runs",
            f"{engine}.nodes=2",
            f"{engine}.port={next(_ports)}",
        ]
        cfg = load_config("configs/tiny.yaml", overrides, run_name=run)
        text = target_named(engine).render_job(cfg, "configs/tiny.yaml", overrides, None).text
        mine = ["--set", f"run.remote={remote}", "--set", "run.remote_wait_s=60"]
        if engine == "skypilot":
            task = yaml.safe_load(text)
            argv = ["bash", "-c", task["run"].rstrip() + ' "$@"', "run"]
            ips = "\n".join(b.address for b in boxes) + "\n"
            envs = [
                {
                    **task["envs"],
                    "SKYPILOT_NODE_RANK": str(b.index),
                    "SKYPILOT_NUM_NODES": "2",
                    "SKYPILOT_NODE_IPS": ips,
                    "SKYPILOT_TASK_ID": "sky-managed-test_1-0",
                }
                for b in boxes
            ]
        else:
            config_map, _, job = yaml.safe_load_all(text)
            (container,) = job["spec"]["template"]["spec"]["containers"]
            (root / "etc-train").mkdir(exist_ok=True)
            for name, body in config_map["data"].items():
                (root / "etc-train" / name).write_text(body)
            argv = [w.replace("/etc/train/", f"{root / 'etc-train'}/") for w in container["command"]]
            pod = {e["name"]: e["value"] for e in container["env"]}
            envs = [{**pod, "JOB_COMPLETION_INDEX": str(b.index)} for b in boxes]
        self.logs = [root / f"{engine}{tag}-node{b.index}.log" for b in boxes]
        self.procs = [
            box.shell([*argv, *box.folders(root), *mine], env=env, log=log)
            for box, env, log in zip(boxes, envs, self.logs, strict=True)
        ]


ENGINES_RUN = "engines"
"""The run both engines' jobs continue: the Kubernetes Job, its Service and its pods take their names from it."""


@pytest.fixture
def pod_dns(boxes):
    """Pod 0's DNS name (``<job>-0.<service>``) resolving to box 0 in both boxes: ``ip netns exec`` mounts
    /etc/netns/<namespace>/hosts over /etc/hosts."""
    made = []
    for box in boxes:
        folder = Path("/etc/netns") / box.namespace
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{boxes[0].address} {ENGINES_RUN}-0.{ENGINES_RUN}\n")
        made.append(folder)
    yield
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_job_preempted_under_skypilot_resumes_under_kubernetes_from_the_remote_bitwise(
    boxes, reference, pod_dns, tmp_path
):
    """Each engine's file run on both boxes as that engine runs it, with its variables and nothing else. SkyPilot's
    run section: the launcher places each node from SKYPILOT_*; SIGTERM to one box (a preemption) ends both with
    75 and a checkpoint on the remote. Then the Indexed Job's pods on new boxes (both run folders gone), placed from
    their index and the Service's DNS name: they resume from the remote, bit for bit. One run across both engines:
    a run belongs to its remote, not to the engine that started it (and one run, not one per engine, costs CI half
    a minute)."""
    remote = tmp_path / "remote"
    at = random.Random().randrange(15, STEPS - 15)
    print(f"skypilot: SIGTERM to box 1 at step {at}")
    job = EngineJob(boxes, tmp_path, "skypilot", ENGINES_RUN, remote)
    job.wait_for_step(at)
    os.killpg(job.procs[1].pid, signal.SIGTERM)
    assert job.wait() == [75, 75], job.outputs()
    assert "node 1 of 2 (SkyPilot)" in job.output(1), job.outputs()
    for node in (0, 1):
        shutil.rmtree(job.run_dir(node), ignore_errors=True)  # new machines: the run comes back from the remote
    again = EngineJob(boxes, tmp_path, "kubernetes", ENGINES_RUN, remote, tag="-again")
    assert again.wait() == [0, 0], again.outputs()
    assert "node 1 of 2 (Kubernetes)" in again.output(1), again.outputs()
    assert "remote: resuming from" in again.output(0)
    assert_bitwise_equal(final_weights(again.run_dir(0)), final_weights(reference.run_dir(0)))
