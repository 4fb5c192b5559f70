"""How long a text prompt can be and still fit a context, decided without tokenizing it.

Tokenizing is linear in the prompt, and a 30 MB prompt takes seconds; the context holds a few thousand
tokens. A prompt is refused before tokenization when it cannot possibly fit: every token covers at most
`max_token_bytes` bytes of the (normalized) input, so a prompt of B bytes has at least B / max_token_bytes
tokens, and one of `max_model_len * max_token_bytes` bytes or more has at least `max_model_len` (no room
left for a generated token). Characters never outnumber bytes, so the same number bounds `len(prompt)`,
which costs nothing to read.

`max_token_bytes(tokenizer)` derives the per-token bound from a Hugging Face fast tokenizer's own
description (`backend_tokenizer.to_str()`):
- byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen): every input byte is one character of a vocabulary
  entry, so the longest entry's length in characters; added tokens are matched on their literal text,
  so their length in UTF-8 bytes;
- a model with byte fallback (SentencePiece-style Llama, Mistral): an input byte becomes a byte token when
  no piece covers it, and a piece covers at most its own UTF-8 bytes (a space is the 3-byte "▁");
- a normalizer may shrink the input (Unicode composition merges up to three code points into one
  3-byte character), so where there is one the bound is `NORMALIZER_SLACK` times looser;
- anything else (WordPiece, an unknown token that swallows whole runs of unknown text, a slow tokenizer):
  None, no bound; those prompts are tokenized in full (off the event loop on the HTTP front).

Torch-free: the HTTP front and the worker's engine both use it.
"""

from __future__ import annotations

import json
from typing import Any

NORMALIZER_SLACK = 4


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most input bytes one token of `tokenizer` can cover (see the module docstring); None when the
    tokenizer gives no such bound. Reads the Rust tokenizer's parts where it exposes them (a BPE or WordPiece
    model: its vocabulary, pre-tokenizer and normalizer; ~60 ms for a 49k vocabulary), and its whole description
    only where it does not (a Unigram model's byte fallback): serializing and parsing the description of a 49k
    vocabulary costs ~0.2 s of every worker's and HTTP front's start."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        model = backend.model
        byte_fallback = getattr(model, "byte_fallback", None)
        if byte_fallback is None:  # a Unigram model says it only in its description
            return _from_description(json.loads(backend.to_str()))
        pre_tokenizer = backend.pre_tokenizer
        pre = json.loads(pre_tokenizer.__getstate__()) if pre_tokenizer is not None else None
        pieces = list(backend.get_vocab(with_added_tokens=False))
        added = [token.content for token in backend.get_added_tokens_decoder().values()]
        normalized = backend.normalizer is not None
    except (AttributeError, TypeError, ValueError):
        return None
    return _bound(pieces, pre, bool(byte_fallback), added, normalized)


def _from_description(spec: dict[str, Any]) -> int | None:
    """max_token_bytes from the tokenizer's whole JSON description (tokenizer.json's form)."""
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, (dict, list)):
        return None
    pieces = list(vocab) if isinstance(vocab, dict) else [entry[0] for entry in vocab]
    added = [token.get("content", "") for token in spec.get("added_tokens") or []]
    return _bound(
        pieces, spec.get("pre_tokenizer"), bool(model.get("byte_fallback")), added, bool(spec.get("normalizer"))
    )


def _bound(
    pieces: list[str], pre_tokenizer: Any, byte_fallback: bool, added: list[str], normalized: bool
) -> int | None:
    """The bound from the vocabulary's pieces, the pre-tokenizer's description, the model's byte fallback, the added
    tokens' texts and whether a normalizer runs first (the module docstring's rules)."""
    if not pieces:
        return None
    if _has_byte_level(pre_tokenizer):
        longest = max(len(piece) for piece in pieces)
    elif byte_fallback:
        longest = max(len(piece.encode("utf-8", "surrogatepass")) for piece in pieces)
    else:
        return None
    longest = max([longest, *(len(text.encode("utf-8", "surrogatepass")) for text in added)])
    return longest * (NORMALIZER_SLACK if normalized else 1)


def max_prompt_bytes(max_model_len: int, token_bytes: int) -> int:
    """The size (bytes, or characters) from which a prompt has at least `max_model_len` tokens."""
    return max_model_len * token_bytes


def prompt_size_error(prompt: str, max_model_len: int, token_bytes: int | None) -> str | None:
    """Why `prompt` cannot fit a context of `max_model_len` tokens, or None if it may (tokenize it to
    know). Reads `len(prompt)` first, and encodes at most `max_prompt_bytes` characters."""
    if token_bytes is None:
        return None
    limit = max_prompt_bytes(max_model_len, token_bytes)
    size = len(prompt)
    what = f"{size} characters"
    if size < limit:
        size = len(prompt.encode("utf-8", "surrogatepass"))
        what = f"{size} bytes"
    if size < limit:
        return None
    return (
        f"the prompt is {what} long; the context of {max_model_len} tokens cannot hold {limit} bytes or "
        f"more of text (a token of this tokenizer covers at most {token_bytes} bytes), so it was refused "
        f"without tokenizing it"
    )


def _has_byte_level(pre_tokenizer: Any) -> bool:
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers") or [])
