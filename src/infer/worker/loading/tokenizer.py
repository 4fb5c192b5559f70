"""The engine's tokenizer without transformers: the Rust `tokenizers` library reading tokenizer.json, where that is
provably what transformers' AutoTokenizer gives (`rust_tokenizer_refusal`); AutoTokenizer otherwise.

Importing transformers costs a worker ~1.75 s of CPU at start (its lazy-module scan of every model module) and
~60-70 MiB of RSS. A worker needs its tokenizer for prompts (encode), output text (ids to tokens to
text, special ids) and EOS ids; transformers' generic backend (`TokenizersBackend`, alias
`PreTrainedTokenizerFast`) does exactly that through the same Rust tokenizer, plus what tokenizer_config.json
adds: special tokens (added to the vocabulary when tokenizer.json lacks them), a post-processor rebuilt from
add_bos_token / add_eos_token, truncation and padding, clean-up of decoded spaces, split_special_tokens, a patched
pre-tokenizer for some Mistral checkpoints. A directory is read here only when none of that changes anything
(checked key by key, transformers 5.24's source; any key not known to be harmless refuses), and
tests/worker/test_rust_tokenizer.py holds it equal to AutoTokenizer's on the vocabularies we ship.

What only transformers does (xgrammar's TokenizerInfo, chat templates, a user's `LLM.get_tokenizer()`) asks
`RustTokenizer.transformers()`, which loads AutoTokenizer's tokenizer once, on first use, in the thread asking.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# tokenizer_config.json's classes that are transformers' generic backend (a tokenizer.json as it is).
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types for which AutoTokenizer keeps a tokenizer_config.json's generic class (not in transformers'
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, not registered to MistralCommonBackend: checked against transformers by
# tests/worker/test_rust_tokenizer.py). Others: transformers.
MODEL_TYPES = ("llama", "qwen2_moe", "qwen3", "qwen3_moe")
# transformers' named special tokens, in the order of its all_special_tokens.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing the engine reads of a generic tokenizer whose tokenizer.json holds
# every special token: bookkeeping, chat templates, padding / truncation sides and lengths (the engine neither pads
# nor truncates), add_bos_token / add_eos_token (dropped by transformers when a tokenizer.json is given).
HARMLESS_KEYS = frozenset(
    {
        "tokenizer_class",
        "backend",
        "is_local",
        "local_files_only",
        "name_or_path",
        "chat_template",
        "model_max_length",
        "padding_side",
        "truncation_side",
        "model_input_names",
        "add_bos_token",
        "add_eos_token",
        "added_tokens_decoder",  # checked: each id must be tokenizer.json's own added token
        "additional_special_tokens",  # checked: a list of tokenizer.json's special tokens
        "extra_special_tokens",  # the same
        "clean_up_tokenization_spaces",  # checked: off, or ignored by transformers (a BPE model)
        "split_special_tokens",  # checked: off
        *NAMED_SPECIAL_TOKENS,  # checked: tokenizer.json's special tokens
    }
)
# Files transformers merges into a tokenizer's special or added tokens (none of our formats writes them).
LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
# The added-token flags of a special token as transformers adds it when it is not in tokenizer.json yet.
_PLAIN_SPECIAL = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}


def rust_tokenizer_refusal(path: Path) -> str | None:
    """Why model directory `path` may tokenize differently through the Rust tokenizer alone than through
    transformers' AutoTokenizer (None: it cannot)."""
    files = {name: path / name for name in ("config.json", "tokenizer_config.json", "tokenizer.json")}
    missing = [name for name, file in files.items() if not file.is_file()]
    if missing:
        return f"no {', '.join(missing)}"
    legacy = [name for name in LEGACY_FILES if (path / name).exists()]
    if legacy:
        return f"{', '.join(legacy)} present"
    config, tok_config, tok_json = (json.loads(file.read_text(encoding="utf-8")) for file in files.values())
    return _config_refusal(config) or _tokenizer_config_refusal(tok_config, tok_json) or _backend_refusal(tok_json)


def _config_refusal(config: dict[str, Any]) -> str | None:
    if "auto_map" in config:
        return "config.json has auto_map (the checkpoint's own code)"
    if config.get("model_type") not in MODEL_TYPES:
        return f"model type {config.get('model_type')!r} is not one of {MODEL_TYPES}"
    if "model_name" in config or "tokenizer_class" in config:
        return "config.json names a model or tokenizer class"
    return None


def _tokenizer_config_refusal(tok_config: dict[str, Any], tok_json: dict[str, Any]) -> str | None:
    if tok_config.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer class {tok_config.get('tokenizer_class')!r} is not transformers' generic backend"
    unknown = sorted(set(tok_config) - HARMLESS_KEYS)
    if unknown:
        return f"tokenizer_config.json has keys that may change the tokenizer: {unknown}"
    if tok_config.get("split_special_tokens"):
        return "split_special_tokens is on"
    force_cleanup = tok_config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    if tok_config.get("clean_up_tokenization_spaces") and (tok_json["model"].get("type") != "BPE" or force_cleanup):
        return "clean_up_tokenization_spaces is on"
    added = {token["id"]: token for token in tok_json.get("added_tokens") or []}
    foreign = [i for i in tok_config.get("added_tokens_decoder") or {} if int(i) not in added]
    if foreign:
        return f"added_tokens_decoder has ids {foreign[:5]} that tokenizer.json does not"
    try:
        specials = special_tokens(tok_config)
    except ValueError as e:
        return str(e)
    plain = {
        token["content"] for token in added.values() if {k: token.get(k) for k in _PLAIN_SPECIAL} == _PLAIN_SPECIAL
    }
    odd = [token for token in specials if token not in plain]
    return f"special tokens {odd[:5]} are not plain special tokens of tokenizer.json" if odd else None


def _backend_refusal(tok_json: dict[str, Any]) -> str | None:
    if tok_json.get("truncation") is not None or tok_json.get("padding") is not None:
        return "tokenizer.json truncates or pads"
    if tok_json.get("post_processor") is None:
        return "tokenizer.json has no post-processor (transformers writes one)"
    return None


def special_tokens(tok_config: dict[str, Any]) -> list[str]:
    """tokenizer_config.json's special tokens in transformers' all_special_tokens order: the named ones, then the
    extra ones, each once. ValueError for a form this does not read (model-specific named tokens)."""
    named = [_content(tok_config[key]) for key in NAMED_SPECIAL_TOKENS if tok_config.get(key) is not None]
    extra = tok_config.get("extra_special_tokens") or tok_config.get("additional_special_tokens") or []
    if not isinstance(extra, list) or (
        tok_config.get("extra_special_tokens") and tok_config.get("additional_special_tokens")
    ):
        raise ValueError("extra_special_tokens is not one plain list")
    return list(dict.fromkeys(named + [_content(token) for token in extra]))


def _content(token: Any) -> str:
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    raise ValueError(f"special token {token!r} is neither a string nor an added token")


class RustTokenizer:
    """The calls the engine makes of a transformers tokenizer, answered by tokenizer.json's Rust tokenizer alone;
    build it with `engine_tokenizer` (only for directories `rust_tokenizer_refusal` accepts). Thread-safe: encoding
    and decoding never change the Rust tokenizer's settings."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.backend_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok_config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.all_special_tokens = special_tokens(tok_config)
        self.all_special_ids: list[int] = [self._token_id(token) for token in self.all_special_tokens]
        eos = tok_config.get("eos_token")
        self.eos_token: str | None = None if eos is None else _content(eos)
        self.eos_token_id: int | None = None if self.eos_token is None else self._token_id(self.eos_token)
        self._transformers: PreTrainedTokenizerBase | None = None
        self._lock = threading.Lock()

    def _token_id(self, token: str) -> int:
        token_id = self.backend_tokenizer.token_to_id(token)
        if token_id is None:  # rust_tokenizer_refusal let through only special tokens tokenizer.json has
            raise ValueError(f"{self.path}/tokenizer.json has no token {token!r}")
        return int(token_id)

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        return str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> Any:
        """A token's string (None for an id outside the vocabulary, as transformers), or a list of them."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skipped]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend_tokenizer.decoder
        return str(decoder.decode(tokens)) if decoder is not None else " ".join(tokens)

    def transformers(self) -> PreTrainedTokenizerBase:
        """AutoTokenizer's tokenizer of the same directory (what xgrammar and chat templates need), loaded on the
        first call (imports transformers: seconds) and kept."""
        with self._lock:
            if self._transformers is None:
                from infer.worker.loading.model_files import load_tokenizer

                self._transformers = load_tokenizer(self.path)
            return self._transformers


def engine_tokenizer(path: Path) -> Any:
    """The engine's tokenizer of model directory `path`: a RustTokenizer where that is AutoTokenizer's exactly, else
    AutoTokenizer's own (worker/loading/model_files.py's load_tokenizer)."""
    if rust_tokenizer_refusal(path) is None:
        return RustTokenizer(path)
    from infer.worker.loading.model_files import load_tokenizer

    return load_tokenizer(path)


def transformers_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` as a transformers tokenizer: a RustTokenizer's (loaded on first use), anything else as it is."""
    return tokenizer.transformers() if isinstance(tokenizer, RustTokenizer) else tokenizer
