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
