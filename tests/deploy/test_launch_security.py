"""deploy/slurm/launch.py's keys without a cluster: a job with neither --keys-dir nor --trusted-network gets
a fresh private key set in the submit directory (role folders: workers/, clients/, admins/), the workers'
srun command carries the worker key, the coordinator the role folders, the HTTP front a client key and the
head the admin key; the HTTP front on a non-loopback address needs an API key unless the network is trusted."""

from __future__ import annotations

import importlib.util
import stat
import sys
from pathlib import Path

import pytest

from infer.client.api.server import check_front_exposure, front_config
from infer.coordinator.daemon import build_parser as coordinator_parser
from infer.protocol.keys import ClusterKeyDir
from infer.worker.service.cli import build_parser as worker_daemon_parser

REPO = Path(__file__).resolve().parents[2]


def _load_launcher():
    path = REPO / "deploy" / "slurm" / "launch.py"
    spec = importlib.util.spec_from_file_location("infer_slurm_launch_security", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


launch = _load_launcher()


def _env(tmp_path: Path, **overrides):
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "localhost,n2",
        "SLURMD_NODENAME": "localhost",
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    return launch.SlurmEnv.from_environ({**env, **overrides})


def _args(*argv: str):
    return launch.head_parser().parse_known_args(list(argv))[0]


def test_a_job_without_keys_gets_a_fresh_private_set_in_the_submit_directory(tmp_path):
    keys, made = launch.job_keys(_args(), _env(tmp_path))
    assert made == tmp_path / ".infer-keys-42" == keys.path
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(keys.secret("worker").stat().st_mode) == 0o600
    assert [keys.secret(n).parent.name for n in ("worker", "client", "admin")] == ["workers", "clients", "admins"]
    assert stat.S_IMODE((made / "admins").stat().st_mode) == 0o700
    with pytest.raises(ValueError, match="exists"):  # never reuses (or overwrites) another job's keys
        launch.job_keys(_args(), _env(tmp_path))
    with pytest.raises(ValueError, match="SLURM_SUBMIT_DIR is unset"):
        launch.job_keys(_args(), _env(tmp_path, SLURM_SUBMIT_DIR=""))


def test_given_keys_are_used_and_a_trusted_network_needs_none(tmp_path):
    ClusterKeyDir.create(tmp_path / "mine")
    keys, made = launch.job_keys(_args("--keys-dir", str(tmp_path / "mine")), _env(tmp_path))
    assert keys.path == (tmp_path / "mine").resolve() and made is None
    assert launch.job_keys(_args("--trusted-network"), _env(tmp_path)) == (None, None)
    with pytest.raises(ValueError, match="does not exist"):
        launch.job_keys(_args("--keys-dir", str(tmp_path / "none")), _env(tmp_path))


def test_the_workers_and_the_coordinator_get_their_key_files(tmp_path):
    keys = ClusterKeyDir.create(tmp_path / "k")
    args = _args("--api-key", "secret")
    plan = launch.plan_head(args, ["--dtype", "float32"], ["localhost", "n2"], _env(tmp_path), keys)
    worker = plan.srun[plan.srun.index("worker") + 1 :]
    own, extra = launch.split_extra(worker)
    wargs, unknown = launch.worker_parser().parse_known_args(own)
    command = launch.worker_argv(wargs, unknown + extra, 1, ["localhost", "n2"], [1, 1])
    daemon = worker_daemon_parser().parse_args(command[3:])
    assert daemon.curve_key == str(keys.secret("worker")) == str(keys.path / "workers" / "worker.key_secret")
    assert daemon.coordinator_key == str(keys.public("coordinator"))
    cluster = launch.SrunCluster(num_workers=2, host=plan.coordinator_host, keys=keys, srun=plan.srun)
    coordinator = coordinator_parser().parse_args(cluster.security_args("coordinator"))
    assert (coordinator.curve_secret_key, coordinator.authorized_keys) == (
        str(keys.secret("coordinator")),
        str(keys.path),
    )
    assert cluster.client_options == keys.client_options()  # the HTTP front: a client
    assert cluster.admin_options["curve_key"] == str(keys.path / "admins" / "admin.key_secret")  # the head
    # a coordinator on another node than the head (its srun step) holds the same key as the head's
    spread = launch.plan_head(
        _args("--coordinators", "3"),
        [],
        ["localhost", "n2"],
        _env(tmp_path),
        keys,
        resolve={"localhost": "127.0.0.1", "n2": "10.0.0.2"}.get,
    )
    [step] = spread.coordinator_steps.values()
    remote = coordinator_parser().parse_args(step[step.index("infer.coordinator.daemon") + 1 :])
    assert (remote.curve_secret_key, remote.authorized_keys) == (coordinator.curve_secret_key, str(keys.path))


def test_the_http_front_off_loopback_needs_an_api_key_or_a_trusted_network(monkeypatch, tmp_path):
    monkeypatch.delenv("INFER_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"the HTTP front on 0\.0\.0\.0.*--api-key-file FILE"):
        check_front_exposure("0.0.0.0", front_config(_args(), None), False)
    check_front_exposure("0.0.0.0", front_config(_args(), None), True)
    check_front_exposure("0.0.0.0", front_config(_args("--api-key", "k"), None), False)
    check_front_exposure("127.0.0.1", front_config(_args(), None), False)
    monkeypatch.setenv("INFER_API_KEY", "from-the-environment")  # sbatch passes the submitter's environment
    check_front_exposure("0.0.0.0", front_config(_args(), None), False)
