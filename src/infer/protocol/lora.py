"""LoRA adapters on the wire and in options, torch-free: vLLM's `LoRARequest`, adapter names, `--lora-modules`
entries, and PEFT's adapter_config.json read and checked (what the engine computes, and the rest refused by name).

A request names its adapter by `SamplingParams.lora_name` (so it travels with the request's params on every
Submit, Dispatch and failover re-dispatch); the engine holds the adapters themselves (worker/engine/lora.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_LORA_NAME_LEN = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The checkpoint module names an adapter may target (the Llama family's linear layers; worker/engine/lora.py maps the
# fused ones onto qkv_proj / gate_up_proj)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_lora_name(name: Any, what: str = "lora_name") -> str:
    """An adapter name: 1-128 characters of letters, digits and `._:/@+-`, starting with a letter or digit (it is
    the `model` of HTTP requests and goes into logs)."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME_LEN or not _NAME.fullmatch(name):
        raise ValueError(
            f"{what} must be 1-{MAX_LORA_NAME_LEN} characters of letters, digits and ._:/@+- "
            f"(starting with a letter or digit), got {str(name)[:80]!r}"
        )
    return name


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name, a positive integer id and the folder of its PEFT files
    (adapter_config.json + adapter_model.safetensors). `LLM.generate(..., lora_request=...)` loads it on first use.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise ValueError(f"lora_path must be a folder path, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_module(text: Any) -> tuple[str, str]:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form `{"name": ..., "path": ...}` (a
    "base_model_name" in it is allowed and ignored), or a (name, path) pair."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        name, path = text[0], str(text[1]) if isinstance(text[1], Path) else text[1]
    elif isinstance(text, str) and text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: not JSON: {e}") from None
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown or "name" not in entry or "path" not in entry:
            raise ValueError(
                f'--lora-modules: JSON entries take "name" and "path" (and "base_model_name"), got {sorted(entry)}'
            )
        name, path = entry["name"], entry["path"]
    elif isinstance(text, str) and "=" in text:
        name, path = text.split("=", 1)
    else:
        raise ValueError(f"--lora-modules entries are name=path, got {str(text)[:80]!r}")
    if not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {name}: the path is empty")
    return check_lora_name(name, "a --lora-modules name"), path


def lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """`--lora-modules` as (name, path) pairs: from a mapping, or entries `parse_lora_module` takes; a name given
    twice is refused."""
    entries = list(value.items()) if isinstance(value, dict) else list(value or ())
    pairs = tuple(parse_lora_module(entry) for entry in entries)
    names = [name for name, _ in pairs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--lora-modules: adapter name(s) given twice: {', '.join(twice)}")
    return pairs


@dataclass(frozen=True)
class LoraConfig:
    """What the engine takes from a PEFT adapter_config.json: the rank, the scale of B A, the targets.
    `rank_pattern` (a rank per module) is taken from the tensors' shapes; the scale is alpha / r (alpha / sqrt(r)
    with rsLoRA) with each module's own r."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    def scaling(self, rank: int) -> float:
        """The scale of a module of rank `rank` (ValueError below 1: a module's rank is read from its tensors)."""
        if rank < 1:
            raise ValueError(f"rank (r) must be >= 1, got {rank}")
        return self.lora_alpha / (rank**0.5 if self.use_rslora else rank)


# adapter_config.json keys this engine does not compute: (the values that mean "off", what it is); a key set to
# anything else is refused by name. Other keys (dropout, init, layers_to_transform, rank_pattern ...) change nothing
# at inference or are read from the tensors themselves.
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_dora": ((False, None), "DoRA (weight-decomposed LoRA)"),
    "modules_to_save": ((None, []), "modules_to_save (whole modules trained beside the adapter)"),
    "bias": (("none", None), "trained biases (bias other than 'none')"),
    "lora_bias": ((False, None), "lora_bias (a bias on lora_B)"),
    "fan_in_fan_out": ((False, None), "fan_in_fan_out (Conv1D layers)"),
    "alpha_pattern": (({}, None), "alpha_pattern (a lora_alpha per module)"),
    "layer_replication": ((None, []), "layer_replication"),
    "target_parameters": ((None, []), "target_parameters (LoRA on parameters, not modules)"),
    "use_qalora": ((False, None), "QA-LoRA"),
    "arrow_config": ((None,), "Arrow routing"),
    "ensure_weight_tying": ((False, None), "ensure_weight_tying"),
}


def read_lora_config(folder: str | Path) -> LoraConfig:
    """The adapter_config.json of a PEFT LoRA folder, checked: ValueError naming the file or key otherwise."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise ValueError(
            f"{path}: no such file (a PEFT LoRA adapter folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{path}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, value in config.items():
        if key in _REFUSED and value not in _REFUSED[key][0]:
            raise ValueError(f"{path}: {_REFUSED[key][1]} is not supported ({key}={value!r})")
    r, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{path}: rank (r) must be an integer >= 1, got {r!r}")
    # JSON as Python reads it allows Infinity and NaN; a huge finite alpha is judged by the scaled weights it makes
    # (worker/engine/lora.py)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise ValueError(f"{path}: lora_alpha must be a finite positive number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"{path}: use_rslora must be true or false, got {rslora!r}")
    targets = config.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return LoraConfig(r=r, lora_alpha=float(alpha), use_rslora=rslora, target_modules=targets)
