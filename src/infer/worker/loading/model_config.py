"""A model directory's config.json as the model classes read it, without importing transformers where we can.

Every transformers `configuration_<model>.py` imports `transformers.activations`, which drags in
`torch.distributed.tensor`, accelerate and sympy (~60 MiB of resident memory in a worker, measured with
transformers 5.24). For the dense Llama family (LIGHT_DEFAULTS: the embedded model's and every GGUF's type) the
config is read here instead: config.json's values over the defaults of transformers' class, then the derivations
its `__post_init__` makes (head_dim, num_key_value_heads, Qwen's sliding window and layer types, and the rope
parameters as transformers standardizes them). tests/worker/test_model_config.py holds the two equal, field for
field, for the fields our models read. Other model types, and checkpoints that bring their own code (`auto_map`),
still go through transformers' AutoConfig, imported then. Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers 5.24's class defaults for the fields a config.json may leave out, per model type.
_BASE_DEFAULTS: dict[str, Any] = {"architectures": None}
_LLAMA_DEFAULTS: dict[str, Any] = {
    **_BASE_DEFAULTS,
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "attention_bias": False,
    "mlp_bias": False,
    "head_dim": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
_MISTRAL_DEFAULTS: dict[str, Any] = {
    **_BASE_DEFAULTS,
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "sliding_window": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
_QWEN2_DEFAULTS: dict[str, Any] = {
    **_BASE_DEFAULTS,
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
LIGHT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": _MISTRAL_DEFAULTS,
    "qwen2": _QWEN2_DEFAULTS,
    "qwen3": {**_QWEN2_DEFAULTS, "head_dim": 128, "attention_bias": False},
}
DEFAULT_ROPE_THETA = 10_000.0  # transformers' default_theta
# Rope types whose parameters carry the pretraining context (transformers fills it from max_position_embeddings).
_ROPE_TYPES_WITH_ORIGINAL_LEN = ("llama3", "yarn", "longrope")


class ModelConfig:
    """A read-only view of a model's config, attribute by attribute as transformers' config object has them
    (`getattr(config, name, default)` works as with one). Build it with `read_model_config`."""

    def __init__(self, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only (tried to set {name!r})")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._values))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._values!r})"


def read_model_config(path: Path) -> Any:
    """The config of model directory `path`: a ModelConfig for the model types of LIGHT_DEFAULTS, else (other
    types, or a checkpoint with its own code) transformers' AutoConfig, imported here."""
    values = json.loads((Path(path) / "config.json").read_text())
    if values.get("model_type") in LIGHT_DEFAULTS and "auto_map" not in values:
        return ModelConfig(light_config_values(values))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def light_config_values(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's values `raw` (of a LIGHT_DEFAULTS type) completed as transformers' config class completes
    them."""
    values = {**LIGHT_DEFAULTS[raw["model_type"]], **raw}
    if values["model_type"] in ("llama", "mistral") and values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["model_type"] in ("qwen2", "qwen3"):
        _qwen_windows(values)
    values["rope_parameters"] = _rope_parameters(values)
    values.pop("rope_scaling", None)
    values.pop("rope_theta", None)
    values.pop("partial_rotary_factor", None)
    return values


def _qwen_windows(values: dict[str, Any]) -> None:
    """Qwen2 / Qwen3: the window only with use_sliding_window, on the layers from max_window_layers on."""
    if not values["use_sliding_window"]:
        values["sliding_window"] = None
    if values["layer_types"] is None:
        values["layer_types"] = [
            "sliding_attention"
            if values["sliding_window"] is not None and i >= values["max_window_layers"]
            else "full_attention"
            for i in range(values["num_hidden_layers"])
        ]


def _rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    """transformers' standardized rope_parameters: rope_scaling (or rope_parameters) with rope_type, rope_theta
    (default 10000), partial_rotary_factor where given, and the pretraining length for the scaled types. Nested
    (per layer type) parameters are left as they are (our models refuse them)."""
    params = values.get("rope_scaling") or values.get("rope_parameters") or {}
    params = json.loads(json.dumps(params))  # a copy, nested dicts included
    theta = values.get("rope_theta", DEFAULT_ROPE_THETA)
    partial = values.get("partial_rotary_factor")
    labels = values.get("layer_types") or ()
    if any(key in labels for key in params):
        return params
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", theta)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in _ROPE_TYPES_WITH_ORIGINAL_LEN:
        params.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    return params
