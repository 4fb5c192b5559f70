"""infer-worker's flags in process: built from WorkerOptions, WorkerFlags and EngineConfig (each field declares its
flag), parsed back into them, and every bad value refused with exit 2 and a message naming it. test_daemon.py runs
some of the same through a real process."""

from __future__ import annotations

import dataclasses

import pytest

from infer.protocol.options import cli_fields, given, to_argv
from infer.worker.service import cli
from infer.worker.service.options import WorkerFlags, WorkerOptions

COORDINATOR = ["--coordinator", "tcp://127.0.0.1:9"]


@pytest.fixture(autouse=True)
def no_launcher_environment(monkeypatch):
    """Ranks and rendezvous come from the flags here, not from a torchrun or Slurm environment."""
    for name in ("RANK", "SLURM_PROCID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("cls", [WorkerOptions, WorkerFlags])
def test_every_flag_has_help(cls):
    assert cli_fields(cls) and all(f.metadata["help"] for f in cli_fields(cls))
    assert {f.name for f in dataclasses.fields(cls)} - {f.name for f in cli_fields(cls)} <= {"ep", "tp", "curve"}


def test_omitted_flags_keep_the_dataclass_defaults():
    args = cli.build_parser().parse_args([*COORDINATOR, "--worker-id", "w"])
    flags = cli.worker_flags(args)
    assert flags == WorkerFlags() and flags.groups() == (None, None)
    assert cli.worker_options(args, flags) == WorkerOptions(coordinator="tcp://127.0.0.1:9", worker_id="w")


def test_options_survive_argv_and_back():
    options = WorkerOptions(
        coordinator="tcp://h:1",
        worker_id="w",
        dp_rank=3,
        group_id="g",
        heartbeat_interval=0.5,
        drain_timeout=0.0,
        max_waiting_requests=0,
        max_queue_time=0.0,
        benchmark_mode=True,
        benchmark_step_time=0.25,
    )
    args = cli.build_parser().parse_args(to_argv(WorkerOptions, options))
    assert cli.worker_options(args, cli.worker_flags(args)) == options
    flags = WorkerFlags(tp_size=2, tp_rank=1, ep_size=2, ep_rank=0, dist_init="tcp://h:2", ep_timeout=5.0)
    assert WorkerFlags(**given(WorkerFlags, cli.build_parser().parse_args(to_argv(WorkerFlags, flags)))) == flags


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--coordinator is required"),
        (["--coordinator", "127.0.0.1:9"], "--coordinator must be tcp://HOST:PORT"),
        ([*COORDINATOR, "--heartbeat-interval", "soon"], "invalid float value"),
        ([*COORDINATOR, "--dp-rank", "-1"], "dp_rank must be in [0, "),
        ([*COORDINATOR, "--worker-id", "w" * 300], "worker_id must be 1.."),
        ([*COORDINATOR, "--connect-timeout", "0"], "connect_timeout must be > 0, got 0.0"),
        ([*COORDINATOR, "--drain-timeout", "-1"], "drain_timeout must be >= 0, got -1.0"),
        ([*COORDINATOR, "--max-waiting-requests", "-1"], "max_waiting_requests must be >= 0, got -1"),
        (
            [*COORDINATOR, "--benchmark-step-time", "1"],
            "--benchmark-step-time must be in [0, 3600] s and needs --benchmark-mode, got 1.0",
        ),
        ([*COORDINATOR, "--tp-size", "0"], "--tp-size must be >= 1, got 0"),
        ([*COORDINATOR, "--tp-rank", "1"], "--tp-rank needs --tp-size > 1"),
        (
            [*COORDINATOR, "--tp-size", "2", "--tp-rank", "2", "--dist-init", "tcp://127.0.0.1:9"],
            "--tp-rank must be in [0, 2), got 2",
        ),
        (
            [*COORDINATOR, "--tp-size", "2", "--tp-rank", "0", "--dist-init", "tcp://127.0.0.1:9", "--tp-timeout", "0"],
            "--tp-timeout must be > 0, got 0.0",
        ),
        (
            [*COORDINATOR, "--tp-size", "2", "--tp-rank", "0", "--dist-init", "tcp://127.0.0.1:9", "--benchmark-mode"],
            "--benchmark-mode has no model, so no TP group",
        ),
        (
            [*COORDINATOR, "--ep-size", "2", "--ep-rank", "0", "--dist-init", "tcp://127.0.0.1:9", "--ep-timeout", "0"],
            "--ep-timeout must be > 0, got 0.0",
        ),
        ([*COORDINATOR, "--curve-key", "w.key_secret"], "--curve-key and --coordinator-key go together"),
        ([*COORDINATOR, "--max-grammar-step-ms", "0"], "max_grammar_step_ms must be a number of milliseconds in (0, "),
        ([*COORDINATOR, "--max-grammar-compiles", "0"], "max_grammar_compiles must be a positive integer, got 0"),
        (
            [*COORDINATOR, "--max-grammar-compiles-per-client", "-2"],
            "max_grammar_compiles_per_client must be a positive",
        ),
        ([*COORDINATOR, "--kv-offload-dir", "/", "--kv-offload-gb", "0"], "kv_offload_gb must be a number of GiB > 0"),
        ([*COORDINATOR, "--kv-offload-dir", "/nonexistent/kv"], "go together"),
        ([*COORDINATOR, "--kv-offload-host-gb", "0"], "kv_offload_host_gb must be a number of GiB > 0"),
        ([*COORDINATOR, "--kv-offload-host-gb", "much"], "--kv-offloading-size: invalid float value: 'much'"),
        (
            [*COORDINATOR, "--kv-offload-host-gb", "2", "--no-enable-prefix-caching"],
            "kv_offload_host_gb spills prefix-cache blocks: it needs enable_prefix_caching",
        ),
        (
            [*COORDINATOR, "--kv-offload-dir", "/nonexistent/kv", "--kv-offload-gb", "4"],
            "--kv-offload-dir /nonexistent/kv: no such directory",
        ),
    ],
)
def test_bad_values_exit_2_with_the_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
