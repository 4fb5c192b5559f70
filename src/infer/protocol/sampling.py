"""SamplingParams: how one request is decoded. vLLM's field names, validated on construction.

Torch-free. A msgspec Struct (as vLLM's is): it travels over the wire nested in a RequestSpec (protocol/messages.py)
as a map of the fields that differ from the defaults, whose types the decoder checks in C; its ranges are stated
here, once (`__post_init__`, which runs when params are made and when a frame is decoded). Every complaint is a
`FieldError` naming its field, so a frame's error points at it ("field 'spec.sampling.top_p': ...").
"""

from __future__ import annotations

import copy
import math
import struct
from typing import Any

import msgspec
from msgspec.structs import force_setattr

from infer.protocol.bounds import Many
from infer.protocol.lora import check_lora_name
from infer.protocol.structured import StructuredOutputsParams

MAX_LOGPROBS = 20
# The detokenizer holds back up to the longest stop string's length of text and searches every delta for
# each one: a hostile request must not make that unbounded (OpenAI allows 4 stop sequences).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# The sampler divides positive logits by the repetition penalty and multiplies the others by it (float32):
# within these bounds a logit of any size a model produces stays finite and keeps its sign.
MIN_REPETITION_PENALTY = 1e-3
MAX_REPETITION_PENALTY = 1e3
MAX_TOP_K = 2**31 - 1  # larger is "off" anyway (k >= vocabulary size); bounded so it fits an int32
# Per-request token lists are validated in Python by every component they cross: bounded so a request
# cannot make that (or the per-step masks built from them) arbitrarily slow.
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: [-100, 100]
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256
POOLING_TYPES = ("last", "mean", "cls")  # worker/engine/pooling.py
MAX_N = 256  # samples per prompt (LLM / AsyncLLM expand them into that many engine requests)
MAX_BEAM_WIDTH = 32  # beams of one beam search (each beam is a sequence of the batch, 2 x width candidates)
EARLY_STOPPING = (False, True, "never")  # transformers' values (worker/engine/beam_search.py says what each does)
# Options a beam search refuses by name (its beams are ranked by the model's own log-probabilities): each with the
# value that means "not given".
_NOT_WITH_BEAMS = (
    ("structured_outputs", None),
    ("logit_bias", None),
    ("allowed_token_ids", None),
    ("bad_words", ()),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("logprobs", None),
    ("prompt_logprobs", None),
    ("pooling", None),
)


class FieldError(ValueError):
    """A value SamplingParams cannot take; `field` names it (a field of SamplingParams, or "priority")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Decoding options of one request. `temperature=0` is greedy.

    `top_k` of -1 (or 0) disables top-k; `max_tokens=None` means "up to the context length";
    `logprobs=N` returns the sampled token's logprob plus the top N (0: only the sampled one);
    `prompt_logprobs=N` the same for every prompt token after the first (with the first output; such a request
    does not use the prefix cache, whose tokens have no logits).
    `logit_bias` ({token id: bias in [-100, 100]}, added to the logits; stored as sorted (id, bias) pairs so
    that params stay hashable), `allowed_token_ids` (only these may be sampled) and `bad_words` (words whose
    last token is banned once the output ends with the rest of it, tokenized with and without a leading
    space) are applied before sampling; token ids are checked against the vocabulary by the
    engine. `structured_outputs` (protocol/structured.py; a dict of its fields is taken too) constrains the
    output to a JSON schema, a regex, a choice, an EBNF grammar or any JSON object.
    `disable_speculative_decoding` (ours; vLLM has no per-request switch): this request never speculates, on an
    engine with a `speculative_config` (its output is the same either way; this trades its speed for the batch's).
    `n` (vLLM's): samples per prompt. `LLM` / `AsyncLLM` (and the HTTP front, from the body's `n`) run them as n
    engine requests (`samples()`): with a seed, sample i gets seed + i (vLLM's rule), so the n differ and the set
    is reproducible; without one, each draws its own. An engine runs one sample per request and refuses n > 1.
    `beam_width` (ours on the wire; vLLM's BeamSearchParams name): a beam search of that many beams instead of
    sampling (worker/engine/beam_search.py), returning the best `n` of them (n <= beam_width) in one request, all at its
    end; `length_penalty` and `early_stopping` rank and stop the beams as transformers' generate does. A beam
    search is deterministic (temperature 0) and refuses the options that would change its scores by name.
    `lora_name` (ours; vLLM passes a LoRARequest beside the params): the LoRA adapter the request runs with (None:
    the base model). `LLM.generate(lora_request=...)` and the HTTP front's `model` set it; it travels with the params,
    so a request moved to another worker keeps its adapter.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: Many[str] = ()
    stop_token_ids: Many[int] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Many[tuple[int, float]] | None = None
    allowed_token_ids: Many[int] | None = None
    bad_words: Many[str] = ()
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    disable_speculative_decoding: bool = False
    n: int = 1
    pooling: str | None = None
    normalize: bool = True
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    lora_name: str | None = None

    def __post_init__(self) -> None:
        # Accept the forms users write (a single stop string, lists) and store tuples (hashable, frozen).
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        force_setattr(self, "stop", _tuple("stop", stop))
        force_setattr(self, "stop_token_ids", _tuple("stop_token_ids", self.stop_token_ids or ()))
        force_setattr(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            force_setattr(self, "allowed_token_ids", _tuple("allowed_token_ids", self.allowed_token_ids))
        force_setattr(self, "bad_words", _tuple("bad_words", self.bad_words or ()))
        if self.structured_outputs is not None:
            try:
                spec = StructuredOutputsParams.from_dict(self.structured_outputs)
            except (TypeError, ValueError) as e:  # its messages name the part ("structured_outputs.regex ...")
                raise FieldError("structured_outputs", str(e)) from None
            force_setattr(self, "structured_outputs", spec)
        self._validate()
        self._validate_token_lists()

    def _validate(self) -> None:
        """Floats are checked as the float32 values the sampler computes with (module `_float32`)."""
        if _float32("temperature", self.temperature) < 0:
            raise FieldError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < _float32("top_p", self.top_p) <= 1:
            raise FieldError(
                "top_p", f"top_p must be in (0, 1] as a float32 (values below 1.4e-45 round to 0), got {self.top_p}"
            )
        _integer("top_k", self.top_k)
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise FieldError("top_k", f"top_k must be -1 (disabled) or in [0, {MAX_TOP_K}], got {self.top_k}")
        if not 0 <= _float32("min_p", self.min_p) <= 1:
            raise FieldError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise FieldError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        _integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise FieldError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise FieldError("stop", f"stop must hold non-empty strings, got {str(s)[:40]!r}")
            if len(s) > MAX_STOP_CHARS:
                raise FieldError("stop", f"each stop string may be at most {MAX_STOP_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise FieldError(
                "stop_token_ids",
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t)
            if t < 0:
                raise FieldError("stop_token_ids", f"stop_token_ids must be >= 0, got {t}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "disable_speculative_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None:
            _integer("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise FieldError("seed", f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= _float32(name, value) <= 2:
                raise FieldError(name, f"{name} must be in [-2, 2], got {value}")
        if (
            not MIN_REPETITION_PENALTY
            <= _float32("repetition_penalty", self.repetition_penalty)
            <= MAX_REPETITION_PENALTY
        ):
            raise FieldError(
                "repetition_penalty",
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 is off), got "
                f"{self.repetition_penalty}",
            )
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise FieldError(
                "pooling",
                f"pooling must be one of {', '.join(POOLING_TYPES)} (or None to generate), got {self.pooling!r}",
            )
        if self.lora_name is not None:
            try:
                check_lora_name(self.lora_name)
            except ValueError as e:
                raise FieldError("lora_name", str(e)) from None
        if not isinstance(self.normalize, bool):
            raise FieldError("normalize", f"normalize must be a bool, got {self.normalize!r}")
        _integer("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise FieldError("n", f"n must be in [1, {MAX_N}], got {self.n}")
        self._validate_beam_search()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _integer(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise FieldError(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def _validate_beam_search(self) -> None:
        _float32("length_penalty", self.length_penalty)
        if self.early_stopping not in EARLY_STOPPING or type(self.early_stopping) not in (bool, str):
            raise FieldError(
                "early_stopping", f'early_stopping must be true, false or "never", got {self.early_stopping!r:.40}'
            )
        if self.beam_width is None:
            return
        _integer("beam_width", self.beam_width)
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise FieldError("beam_width", f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.n > self.beam_width:
            raise FieldError(
                "n", f"n ({self.n}) must be <= beam_width ({self.beam_width}): a beam search returns its best n beams"
            )
        if self.temperature != 0:
            raise FieldError(
                "temperature",
                f"beam search is deterministic: temperature must be 0, got "
                f"{self.temperature} (beam sampling is not supported)",
            )
        for name, off in _NOT_WITH_BEAMS:
            if getattr(self, name) != off:
                raise FieldError(
                    name,
                    f"{name} is not supported with beam search (beams are ranked by the model's own log-probabilities)",
                )

    @property
    def beam_search(self) -> bool:
        return self.beam_width is not None

    def _validate_token_lists(self) -> None:
        bias = self.logit_bias or ()
        if len(bias) > MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for token_id, value in bias:
            _token_id("logit_bias", token_id)
            if not -MAX_LOGIT_BIAS_VALUE <= _float32("logit_bias", value) <= MAX_LOGIT_BIAS_VALUE:
                raise FieldError(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} for token {token_id}"
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise FieldError(
                    "allowed_token_ids", "allowed_token_ids must not be empty (leave it out to allow every token)"
                )
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise FieldError(
                    "allowed_token_ids",
                    f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} "
                    f"ids, got {len(self.allowed_token_ids)}",
                )
            for token_id in self.allowed_token_ids:
                _token_id("allowed_token_ids", token_id)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise FieldError(
                "bad_words", f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}"
            )
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise FieldError("bad_words", f"bad_words must hold non-blank strings, got {str(word)[:40]!r}")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise FieldError(
                    "bad_words", f"each bad word may be at most {MAX_BAD_WORD_CHARS} characters, got {len(word)}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def with_seed(self, seed: int) -> SamplingParams:
        """These params with `seed` (a seed assigned to a sampled request that came without one, or the one a
        re-attached stream runs with). Only the seed is checked: the rest was validated when these were made."""
        _integer("seed", seed)
        if not 0 <= seed < 2**63:
            raise FieldError("seed", f"seed must be in [0, 2**63), got {seed}")
        params = copy.copy(self)  # not msgspec.structs.replace: that would validate every field again
        force_setattr(params, "seed", seed)
        return params

    def samples(self) -> list[SamplingParams]:
        """The n engine requests these params stand for: n = 1 each; sample i seeded seed + i when seeded."""
        if self.n == 1 or self.beam_search:  # a beam search returns its n best beams itself
            return [self]
        one = msgspec.structs.replace(self, n=1)
        return [one if self.seed is None else one.with_seed((self.seed + i) % 2**63) for i in range(self.n)]

    def to_dict(self) -> dict[str, Any]:
        """Every field, named, in JSON / msgpack types; `from_dict(to_dict())` round-trips. (Frames carry only
        the fields that differ from the defaults: protocol/messages.py.)"""
        d = msgspec.structs.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["bad_words"] = list(self.bad_words)
        if self.logit_bias is not None:  # pairs: msgpack maps take string keys only
            d["logit_bias"] = [[token_id, bias] for token_id, bias in self.logit_bias]
        if self.allowed_token_ids is not None:
            d["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from named fields; an unknown name is a ValueError that names it, a bad value a FieldError."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be a mapping, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _FIELD_NAMES)  # str: keys off the wire may be of any type
        if unknown:
            raise ValueError(
                f"unknown sampling option(s): {', '.join(unknown)}; known: {', '.join(sorted(_FIELD_NAMES))}"
            )
        return cls(**d)


_FIELD_NAMES = frozenset(SamplingParams.__struct_fields__)


def _tuple(name: str, values: Any) -> tuple:
    if type(values) is tuple:
        return values
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise FieldError(name, f"{name} must be a list, got {type(values).__name__}")
    return tuple(values)


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...] | None:
    """logit_bias as sorted (token id, bias) pairs: from a mapping (vLLM's, OpenAI's form) or pairs (the wire's).
    Keys that are decimal strings (JSON's) are taken as ids."""
    if bias is None:
        return None
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias):
        items = [tuple(p) for p in bias]
    else:
        raise FieldError("logit_bias", f"logit_bias must map token ids to biases, got {type(bias).__name__}")
    if len(items) > MAX_LOGIT_BIAS:
        raise FieldError("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    pairs = {}
    for key, value in items:
        if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 20:
            key = int(key)
        _token_id("logit_bias", key)
        pairs[key] = value
    return tuple(sorted(pairs.items()))


def _token_id(name: str, value: Any) -> None:
    _integer(name, value)
    if value < 0:
        raise FieldError(name, f"{name} token ids must be >= 0, got {value}")


def check_priority(priority: Any) -> int:
    """A request's priority (lower is served first, vLLM's convention): an integer within 64 bits, else
    ValueError naming `priority`."""
    _integer("priority", priority)
    return priority


def _number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise FieldError(name, f"{name} must be a number, got {value!r}")


_EXACT_IN_FLOAT32 = frozenset({0.0, 1.0})


def _float32(name: str, value: Any) -> float:
    """`value` rounded to float32, as the sampler holds it; ValueError unless it is a finite number there
    (1e39 is inf in float32, NaN and inf are refused too)."""
    if type(value) is float and value in _EXACT_IN_FLOAT32:  # the defaults: nothing to round (most fields)
        return value
    _number(name, value)
    try:
        rounded = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range (or an int beyond float64's)
        rounded = math.inf
    if not math.isfinite(rounded):
        raise FieldError(name, f"{name} must be a finite number within float32's range (|x| <= 3.4e38), got {value!r}")
    return rounded


def _integer(name: str, value: Any) -> None:
    """An int within 64 bits (the wire carries no more; torch would overflow on it)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(name, f"{name} must be an integer, got {value!r}")
    if not -(2**63) <= value < 2**63:
        raise FieldError(name, f"{name} must fit in 64 bits, got an integer of {value.bit_length()} bits")
