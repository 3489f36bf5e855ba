"""The launcher's pure parts: where the nodes meet, the torchrun command line, failure summaries, redaction."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed.run as torchrun

from train.config import load_config
from train.errors import ConfigError
from train.launch import torchrun as torchrun_module
from train.launch.targets import topology_from_environ
from train.launch.targets.slurm import first_slurm_host
from train.launch.torchrun import (
    debug_variables,
    describe_failure,
    exit_code_of,
    stopped_with_checkpoint,
    torchrun_argv,
)
from train.obs.log import redacted_environ
from train.run_dir import RunDir


@pytest.mark.parametrize(
    "nodelist, first",
    [("gpu01", "gpu01"), ("gpu[03-05,9]", "gpu03"), ("gpu[7,2-3],cpu1", "gpu7"), ("a-b-1,a-b-2", "a-b-1")],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_one_node_without_settings():
    topology = topology_from_environ({}, "run")
    assert not topology.multi_node and topology.endpoint is None


def test_explicit_variables():
    env = {"NNODES": "3", "NODE_RANK": "2", "RDZV_ENDPOINT": "head:29400", "RDZV_ID": "exp1"}
    topology = topology_from_environ(env, "run")
    assert (topology.nnodes, topology.node_rank, topology.endpoint, topology.run_id) == (3, 2, "head:29400", "exp1")
    assert topology.source == "environment"


def test_slurm_variables_give_first_host_and_a_port_from_the_job_id():
    env = {"SLURM_JOB_ID": "123456", "SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "n[10-13]"}
    topology = topology_from_environ(env, "run")
    assert topology.endpoint == f"n10:{20000 + 123456 % 10000}"
    assert (topology.nnodes, topology.node_rank, topology.run_id, topology.source) == (4, 3, "123456", "SLURM")
    # Explicit settings win over SLURM's.
    assert topology_from_environ({**env, "RDZV_ENDPOINT": "x:1"}, "run").endpoint == "x:1"


@pytest.mark.parametrize(
    "env, words",
    [
        ({"NNODES": "2"}, "NODE_RANK"),
        ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:1"}, "outside 0..1"),
        ({"NNODES": "2", "NODE_RANK": "0"}, "RDZV_ENDPOINT"),
        ({"NNODES": "2", "NODE_RANK": "0", "RDZV_ENDPOINT": "nohost"}, "host:port"),
        ({"NNODES": "two"}, "NNODES"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_variable(env, words):
    with pytest.raises(ConfigError, match=words):
        topology_from_environ(env, "run")


def test_torchrun_argv_single_and_multi_node(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["dist.max_restarts=2", "dist.timeout_s=45"])
    single = torchrun_argv(topology_from_environ({}, "r"), 4, cfg, tmp_path, "train.worker", ["--x"], debug=False)
    assert "--standalone" in single and "--nproc-per-node=4" in single and "--max-restarts=2" in single
    assert "--local-ranks-filter=0" in single and "SIGUSR1" in next(a for a in single if a.startswith("--signals"))
    assert single[-3:] == ["--module", "train.worker", "--x"]
    env = {"NNODES": "2", "NODE_RANK": "1", "RDZV_ENDPOINT": "head:29400", "RDZV_ID": "j"}
    multi = torchrun_argv(topology_from_environ(env, "r"), 8, cfg, tmp_path, "train.worker", [], debug=True)
    assert "--standalone" not in multi
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", "--rdzv-id=j"} <= set(multi)
    assert "--rdzv-conf=join_timeout=45,is_host=false" in multi
    assert not any(a.startswith("--local-ranks-filter") for a in multi), "DEBUG shows every rank"


def test_flags_an_older_torchrun_lacks_are_left_out(tmp_path, monkeypatch, caplog):
    """torch 2.11's torchrun (a GPU image's own build) has no --shutdown-timeout and refuses the whole command
    on it: the launch goes on without it, saying so."""
    cfg = load_config("configs/tiny.yaml")
    argv = torchrun_argv(topology_from_environ({}, "r"), 1, cfg, tmp_path, "train.worker", [], debug=False)
    known = torchrun.get_args_parser().parse_known_args(argv)[1]
    assert known == [], f"today's torchrun takes every flag: {known}"
    assert any(a.startswith("--shutdown-timeout") for a in argv)
    older = torchrun_module._torchrun_options() - {"--shutdown-timeout", "--shutdown_timeout"}
    monkeypatch.setattr(torchrun_module, "_torchrun_options", lambda: older)
    argv = torchrun_argv(topology_from_environ({}, "r"), 1, cfg, tmp_path, "train.worker", [], debug=False)
    assert not any(a.startswith("--shutdown-timeout") for a in argv)
    assert any(a.startswith("--signals-to-handle") for a in argv)
    assert "has no --shutdown-timeout" in caplog.text


def test_debug_variables_point_the_flight_recorder_into_the_run(tmp_path):
    variables = debug_variables(RunDir(tmp_path))
    assert variables["NCCL_DEBUG"] == "INFO" and variables["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert Path(variables["TORCH_FR_DUMP_TEMP_FILE"]).parent == tmp_path / "flight_recorder"


def failure(exitcode: int, message: str = "", error_file: str = "/nonexistent"):
    return SimpleNamespace(exitcode=exitcode, message=message, error_file=error_file, timestamp=0)


@pytest.mark.parametrize(
    "sig, words, code",
    [(signal.SIGBUS, "/dev/shm", 135), (signal.SIGKILL, "out-of-memory", 137), (signal.SIGSEGV, "native", 139)],
)
def test_signals_get_a_hint_and_the_shells_exit_code(sig, words, code):
    f = failure(-int(sig))
    assert f"rank 3 was killed by {sig.name}" in describe_failure(3, f) and words in describe_failure(3, f)
    assert exit_code_of(f) == code


def test_an_error_keeps_its_code_and_message_and_timeouts_get_a_hint():
    f = failure(3, {"message": "DataError: no checkpoint in runs/x"})
    assert describe_failure(0, f) == "rank 0 exited with code 3: DataError: no checkpoint in runs/x"
    assert exit_code_of(f) == 3
    timeout = describe_failure(1, failure(5, "rank 1: joining the process group failed within 30s: timed out"))
    assert "hint: a rank never arrived" in timeout


@pytest.mark.parametrize(
    "codes, stopped",
    [
        ([75, 75], True),
        # the agent SIGTERMs a rank still tearing down after the barrier that follows the checkpoint
        ([75, -int(signal.SIGTERM)], True),
        ([-int(signal.SIGTERM), -int(signal.SIGTERM)], False),  # none reached the barrier's far side
        ([75, 1], False),
        ([75, -int(signal.SIGKILL)], False),
    ],
)
def test_ranks_stopped_with_a_checkpoint_even_when_the_agent_terminated_one_tearing_down(codes, stopped):
    assert stopped_with_checkpoint([failure(code) for code in codes]) is stopped


def test_secrets_are_redacted_by_name():
    env = {"B2_APPLICATION_KEY": "s1", "HF_TOKEN": "s2", "db_password": "s3", "MY_SECRET_X": "s4", "PATH": "/bin"}
    redacted = redacted_environ(env)
    assert redacted["PATH"] == "/bin"
    assert not {"s1", "s2", "s3", "s4"} & set(redacted.values())
    assert set(redacted) == set(env)


@pytest.mark.parametrize(
    "name",
    [
        "DB_PASSWD",
        "DB_PWD",
        "MYSQL_PWD",
        "GH_PAT",
        "HTTP_AUTH",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "SMTP_PASS",
        "DB_PW",
        "SSH_PRIVATE",
        "SESSION_COOKIE",
        "APP_SESSION",
        "URL_SIGNATURE",
        "GPG_PASSPHRASE",
        "githubPat",
    ],
)
def test_credential_like_names_are_redacted(name):
    assert redacted_environ({name: "hunter2hunter2"}) == {name: "<redacted>"}


@pytest.mark.parametrize(
    "name", ["PATH", "PYTHONPATH", "PWD", "OLDPWD", "SSH_AUTH_SOCK", "SSH_ASKPASS", "GIT_AUTHOR_NAME", "PASSTHROUGH"]
)
def test_ordinary_names_stay_readable(name):
    assert redacted_environ({name: "/home/me/work"}) == {name: "/home/me/work"}


@pytest.mark.parametrize(
    "value, expected",
    [
        ("postgres://user:pass@host/db", "postgres://user:<redacted>@host/db"),
        ("redis://:pass@host:6379/0", "redis://:<redacted>@host:6379/0"),
        ("--db=postgres://u:p%40ss@h:5432/x --fast", "--db=postgres://u:<redacted>@h:5432/x --fast"),
        (
            "a=https://me:one@x.org/q,b=amqp://you:two@y.org",
            "a=https://me:<redacted>@x.org/q,b=amqp://you:<redacted>@y.org",
        ),
        ("mysql://user:p@ss@host/db", "mysql://user:<redacted>@host/db"),
        ("http://host:8080/path ssh://git@github.com/x", "http://host:8080/path ssh://git@github.com/x"),
    ],
)
def test_the_password_of_a_url_in_any_value_is_redacted(value, expected):
    assert redacted_environ({"DATABASE_URL": value}) == {"DATABASE_URL": expected}


def test_a_known_credential_under_an_innocent_name_is_redacted():
    env = {
        "B2_APPLICATION_KEY_ID": "0025a1b2c3d4",
        "B2_APPLICATION_KEY": "K002abcdefSECRET",
        "BACKUP_ARGS": "--id 0025a1b2c3d4 --key K002abcdefSECRET --fast",
        "KEY": "1",
        "WORKERS": "1",
        "PGPASSWORD": "hunter2hunter2",
        "NOTES": "see postgres://u:hunter2hunter2@h/db; same as hunter2hunter2",
    }
    redacted = redacted_environ(env)
    assert redacted["BACKUP_ARGS"] == "--id <redacted> --key <redacted> --fast"
    assert redacted["WORKERS"] == "1", "short values are too common to count as known credentials"
    assert redacted["NOTES"] == "see postgres://u:<redacted>@h/db; same as <redacted>"
    assert list(redacted) == sorted(env)


def test_a_password_seen_in_a_url_is_a_known_credential_elsewhere():
    env = {"DATABASE_URL": "postgres://u:s3cretpw@h/db", "PGOPTS": "-p s3cretpw"}
    assert redacted_environ(env)["PGOPTS"] == "-p <redacted>"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=c2VjcmV0a2V5MTIz==;EndpointSuffix=core.net",
            "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=<redacted>;EndpointSuffix=core.net",
        ),
        (
            "BlobEndpoint=https://a.blob.core.net/;SharedAccessSignature=sv=2022&ss=b&sig=AbC%2Fd3f",
            "BlobEndpoint=https://a.blob.core.net/;SharedAccessSignature=<redacted>",
        ),
        ("Server=db;User Id=me;Password=hunter2hunter2;", "Server=db;User Id=me;Password=<redacted>;"),
        ("https://b.net/c/x.h5?sv=2022&sig=AbCdEf%3D&se=2027", "https://b.net/c/x.h5?sv=2022&sig=<redacted>&se=2027"),
    ],
)
def test_the_secret_parts_of_a_connection_string_or_signed_url_are_redacted(value, expected):
    env = {"AZURE_STORAGE_CONNECTION_STRING": value, "NOTES": f"copied: {value}"}
    redacted = redacted_environ(env)
    assert redacted["AZURE_STORAGE_CONNECTION_STRING"] == expected
    assert "hunter2" not in redacted["NOTES"] and "c2VjcmV0" not in redacted["NOTES"] and "AbC" not in redacted["NOTES"]


def test_rendezvous_events_are_named_as_torch_names_them_without_inspecting_the_stack(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)  # put back after the test

    def outer(name_of):
        def rendezvous_step():  # as torch calls it: the name of the method that called the caller
            return name_of()

        return rendezvous_step()

    torchrun_module._name_rendezvous_events_cheaply()
    assert dynamic_rendezvous.get_method_name is torchrun_module._caller_name
    assert outer(torchrun_module._caller_name) == outer(original) == "outer"
    assert torchrun_module._caller_name(10_000) == original(10_000) == "no_method_name"
