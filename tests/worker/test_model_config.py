"""worker/loading/model_config.py against transformers: for the Llama family, our config.json reader gives every field our
models read as transformers' config class does (defaults for what config.json leaves out, the derived head_dim and
KV heads, Qwen's windows, standardized rope parameters), and a model built from either is the same model. Other
model types still come from transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from infer.worker.loading.loader import build_model
from infer.worker.loading.model_config import ModelConfig, read_model_config

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=128)
# Each: (model_type, what config.json says beyond SMALL). Several leave out fields whose default matters.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("llama", {"num_key_value_heads": 2, "head_dim": 8, "attention_bias": True, "mlp_bias": True}),
    ("llama", {"rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}),
    (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 20000.0}}),
    ("llama", {"partial_rotary_factor": 0.5}),
    ("mistral", {}),
    ("mistral", {"sliding_window": None, "num_key_value_heads": 1}),
    ("mistral", {"sliding_window": 16, "head_dim": 32}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 8}),
    ("qwen3", {}),
    ("qwen3", {"head_dim": 16, "num_key_value_heads": 2, "use_sliding_window": True, "max_window_layers": 2}),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention", "full_attention"], "sliding_window": 4}),
    (
        "qwen3",
        {
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            "sliding_window": 4,
            "use_sliding_window": True,
        },
    ),
]
# What our models and engine read of a config (worker/models/llama.py, layers.py, engine.py).
FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "rope_parameters",
    "eos_token_id",
    "bos_token_id",
    "architectures",
)
_MISSING = "<missing>"


def _write(tmp_path: Path, model_type: str, extra: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **SMALL, **extra}))
    return tmp_path


@pytest.mark.parametrize("model_type, extra", CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(CASES)])
def test_fields_equal_transformers(tmp_path: Path, model_type: str, extra: dict[str, Any]) -> None:
    path = _write(tmp_path, model_type, extra)
    ours, theirs = read_model_config(path), AutoConfig.from_pretrained(str(path))
    assert isinstance(ours, ModelConfig)
    for field in FIELDS:
        mine, reference = getattr(ours, field, _MISSING), getattr(theirs, field, _MISSING)
        if field == "layer_types" and reference is not _MISSING and mine is _MISSING:
            continue  # llama / mistral: transformers' classes have none either unless config.json names them
        assert mine == reference, f"{model_type} {field}: ours {mine!r}, transformers {reference!r}"


@pytest.mark.parametrize("model_type, extra", CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(CASES)])
def test_same_model_as_from_transformers(tmp_path: Path, model_type: str, extra: dict[str, Any]) -> None:
    """Built from either config (parameters on the meta device): the same parameters, shapes, layer windows and
    rotary tables, or the same refusal."""
    path = _write(tmp_path, model_type, extra)
    ours, theirs = _build(read_model_config(path)), _build(AutoConfig.from_pretrained(str(path)))
    if isinstance(theirs, Exception) or isinstance(ours, Exception):
        assert (type(ours), str(ours)) == (type(theirs), str(theirs))
        return
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()}
    assert ours.layer_windows == theirs.layer_windows
    assert (ours.head_dim, ours.num_kv_heads, ours.vocab_size) == (
        theirs.head_dim,
        theirs.num_kv_heads,
        theirs.vocab_size,
    )
    for (name, mine), (_, reference) in zip(ours.named_buffers(), theirs.named_buffers(), strict=True):
        if not mine.is_meta:
            assert torch.equal(mine, reference), name


def _build(config: Any) -> Any:
    try:
        return build_model(config, torch.float32, "meta")
    except (ValueError, NotImplementedError) as error:
        return error


def test_other_types_and_remote_code_come_from_transformers(tmp_path: Path) -> None:
    assert not isinstance(read_model_config(_write(tmp_path, "phi3", {})), ModelConfig)
    remote = _write(tmp_path, "llama", {"auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    assert not isinstance(read_model_config(remote), ModelConfig)


def test_read_only(tmp_path: Path) -> None:
    config = read_model_config(_write(tmp_path, "llama", {}))
    with pytest.raises(AttributeError, match="read-only"):
        config.hidden_size = 8
    with pytest.raises(AttributeError, match="no field"):
        _ = config.not_a_field
    assert config.to_dict()["hidden_size"] == 64
