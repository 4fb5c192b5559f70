"""The untokenized prompt bound: sound for the embedded model's tokenizer (a prompt refused by it really has
at least max_model_len tokens), cheap, and absent where a tokenizer gives no bound."""

from __future__ import annotations

import pytest

from infer.protocol.prompt_limits import max_prompt_bytes, max_token_bytes, prompt_size_error

AWKWARD = [
    "#" * 5000,
    " " * 5000,
    "\n" + " " * 5000,
    "a" * 5000,
    "é" * 3000,
    "😀" * 2000,
    "<|im_start|>" * 300,
    "hello world " * 500,
    "".join(chr(c) for c in range(32, 3000)),
]


@pytest.mark.parametrize("text", AWKWARD, ids=range(len(AWKWARD)))
def test_no_token_covers_more_bytes_than_the_bound(smollm2_tokenizer, text):
    token_bytes = max_token_bytes(smollm2_tokenizer)
    num_tokens = len(smollm2_tokenizer(text)["input_ids"])
    assert num_tokens * token_bytes >= len(text.encode())
    # so the check never refuses a prompt that fits: with one more token of context it lets this one by
    assert prompt_size_error(text, num_tokens + 1, token_bytes) is None


def test_a_prompt_at_the_bound_is_refused_and_one_below_is_left_to_the_tokenizer(smollm2_tokenizer):
    token_bytes = max_token_bytes(smollm2_tokenizer)
    limit = max_prompt_bytes(256, token_bytes)
    assert prompt_size_error("a" * (limit - 1), 256, token_bytes) is None
    error = prompt_size_error("a" * limit, 256, token_bytes)
    assert error is not None and f"{limit} characters" in error and "256 tokens" in error
    wide = "é" * (limit // 2)  # under the limit in characters, at it in bytes
    assert "bytes long" in prompt_size_error(wide, 256, token_bytes)


def test_a_tokenizer_without_a_bound_refuses_nothing():
    assert max_token_bytes(object()) is None
    assert prompt_size_error("x" * 10_000_000, 256, None) is None


def _tokenizers() -> dict[str, object]:
    """Rust tokenizers of each kind the bound reads, built in place: byte-level BPE with an added token, BPE with
    byte fallback behind a normalizer, Unigram with and without byte fallback, and WordPiece (no bound)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    byte_level = Tokenizer(models.BPE({"a": 0, "Ġb": 1, "abc": 2}, []))
    byte_level.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()])
    byte_level.add_special_tokens([AddedToken("<|a much longer special token|>", special=True)])
    fallback = Tokenizer(models.BPE({"▁": 0, "é": 1, "<0x41>": 2, "▁hello": 3}, [], byte_fallback=True))
    fallback.normalizer = normalizers.NFKC()
    fallback.decoder = decoders.ByteFallback()
    pieces = [("<unk>", 0.0), ("▁x", -1.0), ("ééé", -2.0)]
    return {
        "byte-level BPE": byte_level,
        "byte-fallback BPE": fallback,
        "Unigram, byte fallback": Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True)),
        "Unigram": Tokenizer(models.Unigram(pieces, unk_id=0)),
        "WordPiece": Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")),
    }


@pytest.mark.parametrize("kind", list(_tokenizers()))
def test_the_bound_from_the_tokenizer_s_parts_equals_the_bound_from_its_description(kind):
    """The bound is read from the Rust tokenizer's parts (cheap) where it exposes them; it must equal the bound read
    from the whole JSON description, which says everything (and is what a tokenizer.json holds)."""
    import json
    import types

    from infer.protocol.prompt_limits import _from_description

    backend = _tokenizers()[kind]
    want = _from_description(json.loads(backend.to_str()))
    assert max_token_bytes(types.SimpleNamespace(backend_tokenizer=backend)) == want
    assert (want is None) == (kind in ("WordPiece", "Unigram"))


def test_the_bound_of_the_embedded_tokenizer_equals_its_description_s(smollm2_tokenizer):
    import json

    from infer.protocol.prompt_limits import _from_description

    want = _from_description(json.loads(smollm2_tokenizer.backend_tokenizer.to_str()))
    assert want is not None and max_token_bytes(smollm2_tokenizer) == want
