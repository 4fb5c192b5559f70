"""The HTTP front's flags, declared once (FrontFlags): what infer-serve was given reaches its infer-api child as
the same values, less the bind address and the API key; what is not given keeps the defaults."""

from __future__ import annotations

import dataclasses

from infer.client.api.server import FrontFlags, build_parser, front_argv, front_config

GIVEN = [
    "--host",
    "0.0.0.0",
    "--port",
    "9000",
    "--api-key",
    "k",
    "--served-model-name",
    "m",
    "--max-concurrent-requests",
    "7",
    "--max-body-bytes",
    "4096",
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser",
    "qwen3",
    "--generation-config",
    "vllm",
    "--trusted-network",
    "--admin-api-key-file",
    "/dev/null",
]


def _flags(args) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(FrontFlags)}


def test_an_infer_api_child_gets_the_flags_given_less_the_socket_and_the_key():
    parser = build_parser()
    given = parser.parse_args(["--coordinator", "tcp://h:1", *GIVEN])
    child = parser.parse_args(["--coordinator", "tcp://h:1", *front_argv(given)])
    passed_on = {
        name: value for name, value in _flags(given).items() if name not in ("host", "port", "api_key", "api_key_file")
    }
    assert {name: _flags(child)[name] for name in passed_on} == passed_on
    assert (child.host, child.port, child.api_key) == ("127.0.0.1", 8000, None)
    assert "k" not in front_argv(given)


def test_flags_left_out_keep_the_defaults_and_the_config_says_so():
    args = build_parser().parse_args(["--coordinator", "tcp://h:1"])
    assert _flags(args) == dataclasses.asdict(FrontFlags()) and front_argv(args) == []
    config = front_config(args, "served")
    assert (config.served_model_name, config.max_concurrent_requests, config.max_body_bytes) == (
        "served",
        FrontFlags.max_concurrent_requests,
        FrontFlags.max_body_bytes,
    )
