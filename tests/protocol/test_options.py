"""Options declared once (protocol/options.py): flags built from the config dataclasses, parsed flags back into
configs, configs into argv; and the one registry of INFER_ environment variables (protocol/env.py)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from infer.coordinator.config import CoordinatorConfig
from infer.protocol import env
from infer.protocol.options import add_options, cli_fields, given, to_argv
from infer.worker.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def parser_for(cls: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_options(p, cls)
    return p


@pytest.mark.parametrize("cls", [EngineConfig, CoordinatorConfig])
def test_every_field_has_a_flag_with_help(cls):
    assert [f.name for f in cli_fields(cls)] == [f.name for f in dataclasses.fields(cls)]
    assert all(f.metadata.get("help") for f in dataclasses.fields(cls))


def test_flags_parse_into_the_fields_given_and_the_rest_keep_defaults():
    args = parser_for(EngineConfig).parse_args(
        [
            "--max-num-seqs",
            "3",
            "--no-enable-prefix-caching",
            "--threads",
            "2",
            "--dtype",
            "float32",
            "--kv-cache-memory-fraction",
            "0.2",
        ]
    )
    options = given(EngineConfig, args)
    assert options == {
        "max_num_seqs": 3,
        "enable_prefix_caching": False,
        "num_threads": 2,
        "dtype": "float32",
        "kv_cache_memory_fraction": 0.2,
    }
    config = EngineConfig.from_options(**options)
    assert config.block_size == EngineConfig().block_size and config.enforce_eager is None  # None: by device


def test_choices_come_from_the_field():
    with pytest.raises(SystemExit):
        parser_for(EngineConfig).parse_args(["--dtype", "int3"])


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(
            model="/m",
            dtype="bfloat16",
            max_model_len=128,
            enable_chunked_prefill=False,
            max_num_batched_tokens=256,
            long_prefill_token_threshold=0,  # differs from the default (None: by role), so it is written
            num_threads=4,
            enforce_eager=False,
            suspend_weights="reload",
        ),
        EngineConfig(),
    ],
)
def test_a_config_survives_argv_and_back(config):
    argv = to_argv(EngineConfig, config)
    assert EngineConfig.from_options(**given(EngineConfig, parser_for(EngineConfig).parse_args(argv))) == config


def test_to_argv_writes_only_what_differs_from_the_defaults():
    assert to_argv(EngineConfig, {"num_threads": 2, "max_num_seqs": 256, "enforce_eager": False}) == [
        "--threads",
        "2",
        "--no-enforce-eager",
    ]
    assert to_argv(CoordinatorConfig, CoordinatorConfig(port=7, trusted_network=True)) == [
        "--port",
        "7",
        "--trusted-network",
    ]


def test_a_launcher_may_take_the_fields_defaults_as_its_flags_defaults():
    p = argparse.ArgumentParser()
    add_options(p, CoordinatorConfig, names=("port", "model_id", "trusted_network"), defaults=True)
    assert vars(p.parse_args([])) == {"port": 5555, "model_id": None, "trusted_network": False}
    assert vars(p.parse_args(["--port", "7"]))["port"] == 7


def test_coordinator_flags_build_its_config():
    from infer.coordinator.daemon import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["--port", "0", "--max-retries", "1", "--drain-timeout", "2"]))
    assert config == CoordinatorConfig(port=0, max_retries=1, drain_timeout=2.0)


def test_infer_variables_are_read_in_protocol_env_only():
    readers = []
    for path in ROOT.glob("*/**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "benchmarks", "examples", ".venv") or rel == Path("src/infer/protocol/env.py"):
            continue
        if re.search(r"environ[^\n]*[\"']INFER_|getenv\([\"']INFER_", path.read_text()):
            readers.append(str(rel))
    assert readers == []
    assert {v.name for v in env.VARIABLES} >= {
        "INFER_MODEL_CACHE",
        "INFER_COMPILE_CACHE",
        "INFER_KERNELS",
        "INFER_API_KEY",
        "INFER_COORDINATOR_PORT",
    }
    assert env.read(env.KERNELS, {"INFER_KERNELS": "  torch "}) == "torch"
    assert env.read(env.KERNELS, {"INFER_KERNELS": "  "}) is None and env.read(env.KERNELS, {}) is None
