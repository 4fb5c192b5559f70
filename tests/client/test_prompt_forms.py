"""vLLM's explicit encoder-decoder prompt taken apart (client/prompt_forms.py), torch-free: each part as text, ids or
a prompt dict; other prompts pass through; malformed dicts refused naming what is wrong."""

from __future__ import annotations

import pytest

from infer.client.prompt_forms import split_encoder_decoder


def test_parts_as_text_ids_or_prompt_dicts():
    assert split_encoder_decoder({"encoder_prompt": "a b", "decoder_prompt": [4, 5]}) == ("a b", [4, 5])
    assert split_encoder_decoder({"encoder_prompt": {"prompt_token_ids": (1, 2)}}) == ([1, 2], None)
    assert split_encoder_decoder({"encoder_prompt": [3], "decoder_prompt": {"prompt": "x"}}) == ([3], "x")
    assert split_encoder_decoder({"encoder_prompt": "e", "decoder_prompt": None}) == ("e", None)


def test_other_prompts_pass_through():
    image = {"prompt": "<image>", "multi_modal_data": {"image": b"png"}}
    for prompt in ("text", [1, 2], image):
        assert split_encoder_decoder(prompt) == (prompt, None)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"decoder_prompt": [1]}, "needs 'encoder_prompt'"),
        ({"encoder_prompt": "e", "prompt": "p"}, "got also ['prompt']"),
        (
            {"encoder_prompt": {"prompt": "e", "prompt_token_ids": [1]}},
            "exactly one of 'prompt' and 'prompt_token_ids'",
        ),
        ({"encoder_prompt": 5}, "encoder_prompt must be text, token ids or a prompt dict, got int"),
        ({"encoder_prompt": "e", "decoder_prompt": 2.5}, "decoder_prompt must be text"),
    ],
)
def test_malformed_dicts_refused_by_name(prompt, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_encoder_decoder(prompt)
