"""A chat's image_url parts at the HTTP front, without a cluster (client/api/images.py, client/chat_encoding.py): which
URLs give bytes and which a 400 naming why; each image part becomes the image token where it was, while an image token
a caller typed stays text; a tokenizer without an image token marks a text-only model; AsyncLLM's direct mode takes
vLLM's multimodal prompt."""

from __future__ import annotations

import base64
import copy
import os

import pytest

from infer.client.api.images import image_bytes_of
from infer.client.api.schemas import ApiError, ChatMessage
from infer.client.api.tokenization import Tokenization
from infer.client.chat_encoding import ChatEncoder, ImageSlot
from infer.protocol.messages import MAX_IMAGE_BYTES


def _refusal(urls, allowed=None) -> str:
    with pytest.raises(ApiError) as refused:
        image_bytes_of(urls, allowed)
    assert refused.value.status == 400 and refused.value.param == "messages"
    return refused.value.message


def test_urls(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(b"png bytes")
    (tmp_path / "secret.png").write_bytes(b"not yours")
    os.symlink(tmp_path / "secret.png", media / "link.png")
    data = "data:image/png;base64," + base64.b64encode(b"inline").decode()
    assert image_bytes_of([data, f"file://{media}/a.png"], media) == [b"inline", b"png bytes"]
    assert "http URLs are not fetched" in _refusal(["http://h/x.png"], media)
    assert "https URLs are not fetched" in _refusal(["https://h/x.png"], media)
    assert "unless the server runs with --allowed-local-media-path" in _refusal([f"file://{media}/a.png"])
    assert "image 1: the file is outside" in _refusal([data, f"file://{media}/../secret.png"], media)
    assert "the file is outside" in _refusal([f"file://{media}/link.png"], media)  # links resolved first
    assert "cannot read the file" in _refusal([f"file://{media}/missing.png"], media)
    assert "names no other host" in _refusal([f"file://elsewhere{media}/a.png"], media)
    assert "unsupported URL scheme 'ftp'" in _refusal(["ftp://h/x.png"])
    big = "data:image/png;base64," + "A" * (MAX_IMAGE_BYTES // 3 * 4 + 8)
    assert f"more than the limit of {MAX_IMAGE_BYTES} bytes" in _refusal([big])
    assert "17 images exceed the limit of 16" in _refusal([data] * 17)


def test_image_parts_become_the_image_token_where_they_were(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert Tokenization(tokenizer, "hermes").image_token == ("<image>", image_id)
    assert Tokenization(smollm2_tokenizer, "hermes").image_token is None  # a text-only model
    message = ChatMessage(
        role="user",
        content=[
            {"type": "text", "text": "one <image> typed, "},
            {"type": "image_url", "image_url": {"url": "data:,"}},
            {"type": "text", "text": " then text"},
        ],
    )
    assert message.image_urls == ["data:,"]
    slot = ImageSlot.new(image_id, "<image>")
    messages = [message.as_template_message(slot.marker)]

    def render(chat):
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    text, ids = ChatEncoder(tokenizer).encode(messages, render, image=slot)
    assert ids.count(image_id) == 1  # the typed "<image>" stayed text
    assert "one <image> typed, <image> then text" in text
    typed = tokenizer("one <image> typed, ", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    at = ids.index(image_id)
    assert ids[at - len(typed) : at] == typed


async def test_async_llm_direct_takes_multimodal_prompts(tmp_path_factory, smollm2_tokenizer):
    from llava_models import llava_checkpoint, png

    from infer import AsyncLLM, SamplingParams

    path = llava_checkpoint(tmp_path_factory.mktemp("llava"), smollm2_tokenizer)
    options = dict(dtype="float32", max_model_len=128, kv_cache_memory=4_000_000, num_threads=1)
    async with AsyncLLM(model=str(path), **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        prompt = {"prompt": "look: <image>", "multi_modal_data": {"image": png(9, 9, seed=1)}}
        deltas = [d async for d in llm.generate(prompt, params)]
        assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 4
        bad = {"prompt": "look: <image>", "multi_modal_data": {"video": b"x"}}
        deltas = [d async for d in llm.generate(bad, params)]
        assert deltas[-1].finish_reason == "error" and "modality 'video' is not supported" in deltas[-1].error
