"""deploy/slurm/launch.py without a cluster: where each worker goes (DP rank, EP group, rendezvous), what
the head passes to srun and the workers, and the systemd examples' command lines against the daemons' parsers."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.daemon import build_parser as coordinator_parser
from infer.coordinator.daemon import config_from_args
from infer.protocol.options import given, to_argv
from infer.worker.service.cli import build_parser as worker_daemon_parser

REPO = Path(__file__).resolve().parents[2]


def _load_launcher():
    """deploy/slurm/launch.py is a script, not part of the package: load it from its path."""
    spec = importlib.util.spec_from_file_location("infer_slurm_launch", REPO / "deploy" / "slurm" / "launch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


launch = _load_launcher()


@pytest.mark.parametrize(
    "spec, counts", [("1", [1]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("4,1(x2)", [4, 1, 1])]
)
def test_slurm_count_lists_expand(spec, counts):
    assert launch.expand_counts(spec) == counts


@pytest.mark.parametrize("spec", ["", "2(3)", "x", "2(x)"])
def test_a_bad_count_list_is_refused(spec):
    with pytest.raises(ValueError, match="per-node count list"):
        launch.expand_counts(spec)


def _plans(nodes, per_node, ep_size, dist_port=29500):
    return [launch.plan_worker(i, nodes, per_node, ep_size, dist_port) for i in range(sum(per_node))]


def test_dense_workers_get_their_dp_rank_and_no_ep_flags():
    plans = _plans(["n1", "n2"], [1, 1], ep_size=1)
    assert [p.flags() for p in plans] == [["--dp-rank", "0"], ["--dp-rank", "1"]]


def test_ep_groups_of_two_on_two_nodes_of_two_rendezvous_on_their_own_node():
    plans = _plans(["n1", "n2"], [2, 2], ep_size=2, dist_port=7000)
    assert [(p.group, p.ep_rank, p.group_master) for p in plans] == [
        (0, 0, "n1"),
        (0, 1, "n1"),
        (1, 0, "n2"),
        (1, 1, "n2"),
    ]
    assert plans[3].flags() == [
        "--dp-rank",
        "3",
        "--group-id",
        "ep1",
        "--ep-size",
        "2",
        "--ep-rank",
        "1",
        "--dist-init",
        "tcp://n2:7001",
    ]


def test_a_group_spanning_nodes_rendezvouses_on_its_rank_0s_node():
    # 3 + 1 tasks: group 1 = tasks 2 (on n1) and 3 (on n2); both meet on n1, port base + 1
    plans = _plans(["n1", "n2"], [3, 1], ep_size=2)
    assert [(p.index, p.group, p.ep_rank, p.group_master) for p in plans[2:]] == [(2, 1, 0, "n1"), (3, 1, 1, "n1")]
    assert plans[3].flags()[-1] == "tcp://n1:29501"
    everyone = _plans(["a", "b", "c"], [2, 2, 2], ep_size=6)
    assert {p.flags()[-1] for p in everyone} == {"tcp://a:29500"} and [p.ep_rank for p in everyone] == list(range(6))


def test_tp_groups_take_adjacent_tasks_and_rendezvous_on_their_rank_0s_node():
    # TP=2 on 2 nodes x 1 task: one DP rank whose two processes sit on two nodes
    across = [launch.plan_worker(i, ["n1", "n2"], [1, 1], 1, 7000, tp_size=2) for i in range(2)]
    assert [p.flags() for p in across] == [
        ["--dp-rank", "0", "--tp-size", "2", "--tp-rank", str(r), "--dist-init", "tcp://n1:7000"] for r in range(2)
    ]
    # TP=2 x EP=2 on 2 nodes x 4 tasks: two worlds of 4 tasks, one per node
    plans = [launch.plan_worker(i, ["n1", "n2"], [4, 4], 2, 7000, tp_size=2) for i in range(8)]
    assert [(p.dp_rank, p.ep_rank, p.tp_rank, p.group, p.group_master) for p in plans[4:]] == [
        (2, 0, 0, 1, "n2"),
        (2, 0, 1, 1, "n2"),
        (3, 1, 0, 1, "n2"),
        (3, 1, 1, 1, "n2"),
    ]
    assert plans[7].flags() == [
        "--dp-rank",
        "3",
        "--group-id",
        "ep1",
        "--tp-size",
        "2",
        "--tp-rank",
        "1",
        "--ep-size",
        "2",
        "--ep-rank",
        "1",
        "--dist-init",
        "tcp://n2:7001",
    ]
    with pytest.raises(ValueError, match="TP x EP groups of 4"):
        launch.plan_worker(0, ["n1", "n2", "n3"], [2, 2, 2], 2, tp_size=2)
    _, plan = _head(["--tp-size", "2", "--workers-per-node", "1"])
    assert plan.num_workers == 1 and "--ntasks=2" in plan.srun
    daemon = worker_daemon_parser().parse_args(_worker_command(plan, 1, ["localhost", "n2"])[3:])
    assert (daemon.dp_rank, daemon.tp_size, daemon.tp_rank, daemon.dist_init) == (0, 2, 1, "tcp://localhost:29500")
    from infer.client.serve import build_parser as serve_parser
    from infer.client.serve import worker_args

    served = worker_args(serve_parser().parse_args(["--tp-size", "2"]), [])  # infer-serve --tp-size
    assert worker_daemon_parser().parse_args(["--coordinator", "tcp://h:1", *served]).tp_size == 2


def test_workers_that_do_not_fill_whole_groups_are_refused():
    with pytest.raises(ValueError, match="EP groups of 2"):
        launch.plan_worker(0, ["n1", "n2", "n3"], [1, 1, 1], ep_size=2)
    with pytest.raises(ValueError, match="beyond"):
        launch.node_of(4, ["n1", "n2"], [2, 2])


def _env(**overrides) -> object:
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "localhost,n2", "SLURMD_NODENAME": "localhost"}
    return launch.SlurmEnv.from_environ({**env, **overrides})


ADDRESSES = {"localhost": "127.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}


def _resolve(node: str) -> str:
    """The test's name service: ADDRESSES, any other name unknown (as socket.gethostbyname says it)."""
    if node not in ADDRESSES:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return ADDRESSES[node]


def _head(argv: list[str], nodes=("localhost", "n2"), **env):
    own, extra = launch.split_extra(argv)
    args, unknown = launch.head_parser().parse_known_args(own)
    return args, launch.plan_head(args, unknown + extra, list(nodes), _env(**env), resolve=_resolve)


def _worker_command(plan, index: int, nodes: list[str]) -> list[str]:
    """What srun task `index` would exec, parsing the head's srun command the way the task does."""
    worker = plan.srun[plan.srun.index("worker") + 1 :]
    own, extra = launch.split_extra(worker)
    args, unknown = launch.worker_parser().parse_known_args(own)
    return launch.worker_argv(args, unknown + extra, index, nodes, [plan.workers_per_node] * len(nodes))


def test_the_head_runs_one_srun_step_and_passes_unknown_options_to_every_worker():
    _, plan = _head(
        [
            "--ep-size",
            "2",
            "--workers-per-node",
            "2",
            "--model",
            "/m",
            "--dtype",
            "float32",
            "--worker-timeout",
            "3",
            "--port",
            "8123",
            "--",
            "--drain-timeout",
            "5",
        ]
    )
    assert plan.num_workers == 4 and plan.coordinator_port == 5555
    assert plan.coordinator_host == "0.0.0.0" == plan.http_host  # localhost is loopback: bind every interface
    assert plan.srun[:5] == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--distribution=block"]
    command = _worker_command(plan, 2, ["localhost", "n2"])
    assert command[1:5] == ["-m", "infer.worker.service.daemon", "--coordinator", "tcp://localhost:5555"]
    daemon = worker_daemon_parser().parse_args(command[3:])  # infer-worker accepts all of it
    assert (daemon.model, daemon.dtype, daemon.drain_timeout) == ("/m", "float32", 5.0)
    assert (daemon.dp_rank, daemon.ep_size, daemon.ep_rank, daemon.group_id, daemon.dist_init) == (
        2,
        2,
        0,
        "ep1",
        "tcp://n2:29501",
    )
    assert "--worker-timeout" not in command  # a coordinator option stays with the coordinator


def test_an_explicit_coordinator_address_reaches_the_workers():
    _, plan = _head(["--coordinator-host", "10.1.2.3", "--host", "0.0.0.0"])
    assert (plan.coordinator_host, plan.http_host, plan.workers_per_node) == ("10.1.2.3", "0.0.0.0", 1)
    assert _worker_command(plan, 1, ["localhost", "n2"])[4] == "tcp://10.1.2.3:5555"


def test_three_coordinators_spread_over_the_nodes_on_consecutive_ports_and_every_worker_gets_the_list():
    _, plan = _head(["--coordinators", "3", "--coordinator-port", "6000", "--heartbeat-interval", "0.5"])
    # coordinator i on node i mod 2, the head first; the head binds every interface (localhost is loopback), so the
    # others reach it by its name; n2's binds its address
    want = "tcp://localhost:6000,tcp://10.0.0.2:6001,tcp://localhost:6002"
    assert plan.coordinators == 3 and plan.address == want
    head, n2 = ("localhost", "0.0.0.0"), ("n2", "10.0.0.2")
    assert [(p.node, p.bind_host) for p in plan.places] == [head, n2, head]
    assert _worker_command(plan, 1, ["localhost", "n2"])[4] == want
    # n2's coordinator is an srun step of one task there, sharing the workers' CPUs, told the list and its place
    [step] = plan.coordinator_steps.values()
    assert step[:6] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=n2", "--overlap", "--kill-on-bad-exit=0"]
    daemon = step[step.index("infer.coordinator.daemon") + 1 :]
    config = config_from_args(coordinator_parser().parse_args(daemon))
    assert (config.host, config.port, config.peers, config.peer_index) == ("10.0.0.2", 6001, want, 1)
    assert config.heartbeat_interval == 0.5  # the coordinator options, as the head's own get them
    assert list(plan.coordinator_steps) == [1]  # the others run on the head

    _, kept = _head(["--coordinators", "3", "--coordinator-port", "6000", "--no-spread-coordinators"])
    assert kept.address == "tcp://localhost:6000,tcp://localhost:6001,tcp://localhost:6002"
    assert kept.coordinator_steps == {}
    _, explicit = _head(["--coordinators", "3", "--coordinator-host", "10.0.0.1"], nodes=("localhost", "n2", "n3"))
    assert explicit.address == "tcp://10.0.0.1:5555,tcp://10.0.0.2:5556,tcp://10.0.0.3:5557"
    with pytest.raises(ValueError, match="cannot resolve node n9 here to place coordinator 1 on it.*--no-spread"):
        _head(["--coordinators", "3"], nodes=("localhost", "n9"))


def test_a_pipelines_stages_take_adjacent_tasks_and_rendezvous_on_its_stage_0s_node():
    # PP=3 on 2 nodes x 3 tasks: tasks 0..2 on n1 are DP rank 0, tasks 3..5 on n2 DP rank 1
    plans = [launch.plan_worker(i, ["n1", "n2"], [3, 3], 1, 7000, pp_size=3) for i in range(6)]
    assert [(p.dp_rank, p.pp_rank, p.group_master) for p in plans] == [
        (0, 0, "n1"),
        (0, 1, "n1"),
        (0, 2, "n1"),
        (1, 0, "n2"),
        (1, 1, "n2"),
        (1, 2, "n2"),
    ]
    assert plans[4].flags() == ["--dp-rank", "1", "--pp-size", "3", "--pp-rank", "1", "--dist-init", "tcp://n2:7001"]
    # PP=2 on 2 nodes x 1 task: one DP rank across the nodes, its rendezvous on stage 0's node
    across = [launch.plan_worker(i, ["n1", "n2"], [1, 1], 1, 7000, pp_size=2) for i in range(2)]
    assert [p.flags() for p in across] == [
        ["--dp-rank", "0", "--pp-size", "2", "--pp-rank", str(r), "--dist-init", "tcp://n1:7000"] for r in range(2)
    ]
    with pytest.raises(ValueError, match="do not split into pipelines of 2 stages"):
        launch.plan_worker(0, ["n1", "n2", "n3"], [1, 1, 1], 1, pp_size=2)
    # TP 2 x PP 2 on 2 nodes x 2 tasks: each node a stage (its TP group), one DP rank, its rendezvous on n1
    composed = [launch.plan_worker(i, ["n1", "n2"], [2, 2], 1, 7000, tp_size=2, pp_size=2) for i in range(4)]
    assert [(p.dp_rank, p.pp_rank, p.tp_rank, p.group_master) for p in composed] == [
        (0, 0, 0, "n1"),
        (0, 0, 1, "n1"),
        (0, 1, 0, "n1"),
        (0, 1, 1, "n1"),
    ]
    assert composed[2].flags() == [
        "--dp-rank",
        "0",
        "--tp-size",
        "2",
        "--tp-rank",
        "0",
        "--pp-size",
        "2",
        "--pp-rank",
        "1",
        "--dist-init",
        "tcp://n1:7000",
    ]
    # PP 2 with EP 2 on 2 nodes x 2 tasks: DP ranks 0 (n1) and 1 (n2) are one EP group, one world
    ep = [launch.plan_worker(i, ["n1", "n2"], [2, 2], 2, 7000, pp_size=2) for i in range(4)]
    assert [(p.dp_rank, p.ep_rank, p.pp_rank, p.group_master) for p in ep] == [
        (0, 0, 0, "n1"),
        (0, 0, 1, "n1"),
        (1, 1, 0, "n1"),
        (1, 1, 1, "n1"),
    ]
    with pytest.raises(ValueError, match=r"do not split into pipelines of 2 stages \(x TP 2 x EP 1\)"):
        launch.plan_worker(0, ["n1", "n2", "n3"], [2, 2, 2], 1, tp_size=2, pp_size=2)
    _, plan = _head(["--pp-size", "2", "--workers-per-node", "1"])
    assert plan.num_workers == 1 and "--ntasks=2" in plan.srun
    daemon = worker_daemon_parser().parse_args(_worker_command(plan, 1, ["localhost", "n2"])[3:])
    assert (daemon.dp_rank, daemon.pp_size, daemon.pp_rank, daemon.dist_init) == (0, 2, 1, "tcp://localhost:29500")
    from infer.client.serve import build_parser as serve_parser
    from infer.client.serve import worker_args

    for flag in ("--pp-size", "--pipeline-parallel-size"):  # infer-serve --pp-size
        served = worker_args(serve_parser().parse_args([flag, "3"]), [])
        assert worker_daemon_parser().parse_args(["--coordinator", "tcp://h:1", *served]).pp_size == 3
    assert (
        worker_daemon_parser().parse_args(["--coordinator", "tcp://h:1", "--pipeline-parallel-size", "2"]).pp_size == 2
    )
    served = worker_args(serve_parser().parse_args(["--pp-size", "2", "--tp-size", "2"]), [])  # PP x TP
    daemon = worker_daemon_parser().parse_args(["--coordinator", "tcp://h:1", *served])
    assert (daemon.pp_size, daemon.tp_size, daemon.pp_rank, daemon.tp_rank) == (2, 2, None, None)  # supervises 4


def test_kv_roles_give_each_dp_rank_its_kv_transfer_config():
    """--kv-roles (infer-serve's, per DP rank in rank order): each task's infer-worker gets its role's flag."""
    _, plan = _head(["--workers-per-node", "2", "--kv-roles", "kv_producer,kv_consumer,kv_consumer,kv_both"])
    nodes = ["localhost", "n2"]
    for index, role in enumerate(["kv_producer", "kv_consumer", "kv_consumer", "kv_both"]):
        daemon = worker_daemon_parser().parse_args(_worker_command(plan, index, nodes)[3:])
        assert daemon.kv_transfer_config.kv_role == role
    _, plain = _head(["--workers-per-node", "2"])
    assert worker_daemon_parser().parse_args(_worker_command(plain, 0, nodes)[3:]).kv_transfer_config is None


def test_the_workers_per_node_default_is_sbatchs_ntasks_per_node():
    assert _head([], SLURM_NTASKS_PER_NODE="3")[1].num_workers == 6


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--ep-size", "4"], {}, "EP groups of 4"),
        (["--coordinator-port", "0"], {}, "--coordinator-port must be"),
        ([], {"SLURMD_NODENAME": "n2"}, "first node localhost"),
        (["--workers-per-node", "-1"], {}, "--workers-per-node must be >= 1, got -1"),
        (["--tp-size", "3"], {}, "do not split into TP groups of 3"),
        (["--pp-size", "3"], {}, "do not split into pipelines of 3 stages"),
        (["--pp-size", "2", "--tp-size", "2"], {}, r"pipelines of 2 stages \(x TP groups of 2"),
        (["--dist-port", "70000"], {}, "--dist-port must be in 1..65535"),
        (["--coordinators", "2"], {}, "--coordinators must be 1, or 3 to 15"),
        (["--coordinators", "3", "--coordinator-port", "65534"], {}, "leaves no room for 3 ports"),
        (["--kv-roles", "kv_producer"], {}, r"--kv-roles names 1 role\(s\) for 2 DP rank\(s\)"),
        (["--kv-roles", "kv_producer,decoder"], {}, "--kv-roles: 'decoder' is not one of kv_both"),
        (["--kv-roles", "kv_producer,kv_consumer", "--tp-size", "2"], {}, "not supported with --tp-size"),
        (
            ["--kv-roles", "kv_producer,kv_consumer", "--", "--kv-transfer-config", "{}"],
            {},
            "pass one or the other",
        ),
    ],
)
def test_the_head_refuses_a_plan_that_cannot_work(argv, env, message):
    with pytest.raises(ValueError, match=message):
        _head(argv, **env)


def test_the_launchers_own_options_are_declared_once_on_their_dataclasses():
    assert launch.JobOptions(**given(launch.JobOptions, launch.head_parser().parse_args([]))) == launch.JobOptions()
    task = launch.TaskOptions(
        coordinator="tcp://10.0.0.1:6000,tcp://n2:6001", ep_size=2, tp_size=2, pp_size=3, dist_port=7000
    )
    parsed = launch.worker_parser().parse_args(to_argv(launch.TaskOptions, task))
    assert launch.TaskOptions(**given(launch.TaskOptions, parsed)) == task


def test_the_restart_flags_reach_every_task_and_bad_ones_are_refused_before_anything_starts():
    _, plan = _head(["--max-restarts", "2", "--restart-backoff", "0.5"])
    worker = plan.srun[plan.srun.index("worker") + 1 :]
    own, _ = launch.split_extra(worker)
    args, unknown = launch.worker_parser().parse_known_args(own)
    assert launch.RestartPolicy(**given(launch.RestartPolicy, args)) == launch.RestartPolicy(
        max_restarts=2, restart_backoff=0.5
    )
    assert not unknown
    with pytest.raises(ValueError, match="restart_backoff_max"):
        _head(["--restart-backoff", "60"])


def _task(tmp_path: Path, script: str, policy, *argv: str) -> subprocess.Popen:
    """`keep_running` of a child that runs `script` (Python; its runs counted in tmp_path/runs), in a process
    of its own as an srun task is."""
    (tmp_path / "child.py").write_text(
        "import pathlib, sys\nruns = pathlib.Path(sys.argv[1]) / 'runs'\n"
        "runs.write_text(runs.read_text() + 'x' if runs.exists() else 'x')\n" + script
    )
    code = (
        "import sys, importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('l', {str(REPO / 'deploy' / 'slurm' / 'launch.py')!r})\n"
        "launch = importlib.util.module_from_spec(spec); sys.modules['l'] = launch; spec.loader.exec_module(launch)\n"
        f"policy = launch.RestartPolicy(**{policy!r})\n"
        f"sys.exit(launch.keep_running([sys.executable, {str(tmp_path / 'child.py')!r}, {str(tmp_path)!r}], "
        "policy, 'task 0'))\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, start_new_session=True)


def _runs(tmp_path: Path) -> int:
    runs = tmp_path / "runs"
    return len(runs.read_text()) if runs.exists() else 0


def test_a_task_restarts_its_worker_until_it_exits_0(tmp_path):
    task = _task(tmp_path, "sys.exit(0 if len(runs.read_text()) == 3 else 1)", {"restart_backoff": 0.05})
    _, err = task.communicate(timeout=60)
    assert task.returncode == 0 and _runs(tmp_path) == 3, err
    assert err.count("exited with code 1; restarting it in") == 2
    assert "restart 2 of at most 5 within 300 s" in err


def test_a_task_gives_its_crash_looping_worker_up_and_says_why(tmp_path):
    task = _task(
        tmp_path,
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        {"restart_backoff": 0.01, "max_restarts": 2},
    )
    _, err = task.communicate(timeout=60)
    assert task.returncode == 128 + 9 and _runs(tmp_path) == 3, err
    assert "is not restarted: it was killed by SIGKILL after 2 restarts within 300 s" in err


def test_a_task_told_to_stop_restarts_nothing(tmp_path):
    """SIGTERM reaches the task and its worker together (one process group, as Slurm signals a task): the
    worker's end, whatever its code, is not followed by a restart."""
    task = _task(tmp_path, "import time; time.sleep(60)", {"restart_backoff": 0.01})
    deadline = time.monotonic() + 30
    while _runs(tmp_path) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(task.pid, signal.SIGTERM)
    _, err = task.communicate(timeout=30)
    assert task.returncode == 128 + signal.SIGTERM and _runs(tmp_path) == 1, err
    assert "restarting" not in err


def test_the_coordinator_and_the_workers_get_the_heads_options_for_them():
    args, _ = launch.head_parser().parse_known_args(
        [
            "--policy",
            "round-robin",
            "--heartbeat-interval",
            "0.5",
            "--worker-timeout",
            "3",
            "--log-level",
            "debug",
            "--dtype",
            "f32",
        ]
    )
    coordinator = config_from_args(coordinator_parser().parse_args(launch.coordinator_flags(args)))
    assert coordinator == CoordinatorConfig(
        policy="round-robin", heartbeat_interval=0.5, worker_timeout=3.0, drain_timeout=15.0
    )  # the job's drain timeout
    worker = worker_daemon_parser().parse_args(["--coordinator", "tcp://h:1", *launch.worker_flags(args)])
    assert (worker.heartbeat_interval, worker.drain_timeout, worker.log_level) == (0.5, 15.0, "DEBUG")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policy", "random"], "invalid choice: 'random'"),
        (["--ep-size", "two"], "invalid int value: 'two'"),
        (["--drain-timeout", "soon"], "invalid float value: 'soon'"),
    ],
)
def test_the_head_refuses_bad_values_with_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        launch.head_parser().parse_known_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_infer_serve_hands_its_coordinator_and_worker_options_on():
    from infer.client.serve import build_parser as serve_parser
    from infer.client.serve import coordinator_args, worker_args

    args = serve_parser().parse_args(
        [
            "--policy",
            "round-robin",
            "--heartbeat-interval",
            "0.5",
            "--max-retries",
            "1",
            "--benchmark-mode",
            "--tp-size",
            "2",
        ]
    )
    coordinator = config_from_args(coordinator_parser().parse_args(coordinator_args(args)))
    assert coordinator == CoordinatorConfig(policy="round-robin", heartbeat_interval=0.5, max_retries=1)
    worker = worker_daemon_parser().parse_args(["--coordinator", "tcp://h:1", *worker_args(args, ["--seed", "3"])])
    assert (worker.benchmark_mode, worker.heartbeat_interval, worker.tp_size, worker.seed) == (True, 0.5, 2, 3)


def test_both_launchers_hand_the_traces_endpoint_to_the_coordinator_the_workers_and_the_front():
    from infer.client.api.server import front_argv
    from infer.client.serve import build_parser as serve_parser
    from infer.client.serve import coordinator_args, worker_args

    url = "http://collector:4317"
    serve = serve_parser().parse_args(["--otlp-traces-endpoint", url])
    head, _ = launch.head_parser().parse_known_args(["--otlp-traces-endpoint", url])
    for coordinator_argv, worker_argv in [
        (coordinator_args(serve), worker_args(serve, [])),
        (launch.coordinator_flags(head), launch.worker_flags(head)),
    ]:
        coordinator = config_from_args(coordinator_parser().parse_args(coordinator_argv))
        assert coordinator.otlp_traces_endpoint == url
        worker = worker_daemon_parser().parse_args(["--coordinator", "tcp://h:1", *worker_argv])
        assert worker.otlp_traces_endpoint == url
    front = front_argv(serve)
    assert front[front.index("--otlp-traces-endpoint") + 1] == url
    assert "--otlp-traces-endpoint" not in coordinator_args(serve_parser().parse_args([]))


def test_outside_a_slurm_job_the_launcher_says_so():
    with pytest.raises(ValueError, match="not inside a Slurm job"):
        launch.SlurmEnv.from_environ({})
    assert launch.main(["nonsense"]) == 2


def _exec_start(unit: Path) -> list[str]:
    line = next(ln for ln in unit.read_text().splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart=").replace("%i", "0").replace("%H", "host"))


@pytest.mark.parametrize(
    "unit, parser", [("infer-coordinator.service", coordinator_parser), ("infer-worker@.service", worker_daemon_parser)]
)
def test_the_systemd_examples_run_commands_the_daemons_accept(unit, parser: argparse.ArgumentParser):
    argv = _exec_start(REPO / "deploy" / "local" / "systemd" / unit)
    assert Path(argv[0]).name == unit.split("@")[0].split(".")[0]
    parser().parse_args(argv[1:])
