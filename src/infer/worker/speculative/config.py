"""SpeculativeConfig: speculative decoding's options, vLLM's `speculative_config` keys, validated once. No torch.

Given as a dict (`LLM(speculative_config={...})`, `EngineConfig`) or as JSON (`--speculative-config JSON` on
infer-worker, infer-serve and the Slurm launcher); `str()` writes the JSON back (a config into argv).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
PLANNED_METHODS = ("eagle", "eagle3", "mtp", "medusa")  # vLLM's other methods, not built here yet
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's: prompt_lookup_min and _max when neither is given
# Speculation runs in a step only while at most this many requests decode in it. A verification forward
# computes 1 + k rows per request: at batch 1 that is nearly free (the step reads every weight once, whatever
# its rows), but a large batch is compute-bound already and rejected drafts are wasted work there; the native
# CPU decode step takes 1-8 rows, and step graphs one-token decodes only. vLLM's name for the bound.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method`: "ngram" (prompt lookup: drafts copied from where the context's last n-gram occurred before) or
    "draft_model" (a smaller model of the same vocabulary, `model`: its path, run greedily by the same worker with
    a KV pool of its own). `num_speculative_tokens`: k, drafts per request per step. `prompt_lookup_max` /
    `prompt_lookup_min` (ngram): the longest / shortest n-gram matched (vLLM's rule: neither given, both 5; one
    given, the other equals it). `disable_by_batch_size`: no speculation in a step where more requests than this
    decode (default 8)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method in PLANNED_METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not supported yet; supported: {', '.join(METHODS)}"
            )
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config: method 'draft_model' needs 'model': the draft model's path "
                    "(a safetensors directory or a .gguf file)"
                )
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, key) is not None:
                    raise ValueError(f"speculative_config: {key!r} is an option of method 'ngram', not 'draft_model'")
            return
        if self.model is not None:
            raise ValueError("speculative_config: 'model' is an option of method 'draft_model', not 'ngram'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        low = _int_in("prompt_lookup_min", low, 1, MAX_PROMPT_LOOKUP)
        high = _int_in("prompt_lookup_max", high, 1, MAX_PROMPT_LOOKUP)
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def of(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict of vLLM's keys or its JSON text; an unknown key or a bad value is a ValueError naming it."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON text), got {type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config: {key!r} is required")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The keys that are set (None ones left out: a draft model's config has no prompt_lookup keys)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def __str__(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _int_in(name: str, value: object, low: int, high: int) -> int:
    """`value`, checked: an integer in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config: {name} must be an integer in [{low}, {high}], got {value!r}")
    return value
