"""A chat's image_url parts at the HTTP front, without a cluster (client/api/images.py, client/chat_encoding.py): which
URLs give bytes and which a 400 naming why; each image part becomes the image token where it was, while an image token
a caller typed stays text; a tokenizer without an image token marks a text-only model; a front over direct mode with
a llava-hf-style (LLaVA, LLaVA-NeXT: its image's token count follows from its size) or Qwen2-VL-style template
(content parts: it writes the image token) answers as direct mode does, and a text-only model's front refuses images
with a 400; AsyncLLM's direct mode takes vLLM's multimodal prompt."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import os

import pytest
from front_harness import MODEL, error_of

from infer.client.api.images import image_bytes_of
from infer.client.api.schemas import ApiError, ChatMessage
from infer.client.api.tokenization import Tokenization
from infer.client.chat_encoding import ChatEncoder, ImageSlot
from infer.client.multimodal import wire_images
from infer.protocol.messages import MAX_IMAGE_BYTES, MAX_REQUEST_IMAGE_BYTES


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
    os.mkfifo(media / "pipe.png")  # opening it would wait for a writer forever
    assert "names no regular file" in _refusal([f"file://{media}/pipe.png"], media)
    assert "names no regular file" in _refusal([f"file://{media}"], media)  # the directory itself
    assert "names no other host" in _refusal([f"file://elsewhere{media}/a.png"], media)
    assert "unsupported URL scheme 'ftp'" in _refusal(["ftp://h/x.png"])
    big = "data:image/png;base64," + "A" * (MAX_IMAGE_BYTES // 3 * 4 + 8)
    assert f"more than the limit of {MAX_IMAGE_BYTES} bytes" in _refusal([big])
    assert "17 images exceed the limit of 16" in _refusal([data] * 17)
    large = "data:image/png;base64," + base64.b64encode(b"\0" * (MAX_IMAGE_BYTES - 1)).decode()
    assert f"more than {MAX_REQUEST_IMAGE_BYTES} a request" in _refusal([large, large])
    with pytest.raises(ValueError, match=f"more than the limit of {MAX_REQUEST_IMAGE_BYTES} a request"):
        wire_images([b"\0" * (MAX_IMAGE_BYTES - 1)] * 2)  # InferenceClient's check: the frame keeps its room


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


# llava-hf's chat template (content parts: the images first, then the texts)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


# Qwen2-VL's chat template, cut to what it does with content parts: each image part becomes its vision tokens
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# each family: its template, what it renders for _chat_body (text, then the image), and its image token
FAMILIES = {
    "llava": (LLAVA_TEMPLATE, "USER: <image>\nWhat is this? ASSISTANT:", "<image>"),
    # llava-hf's LLaVA-NeXT checkpoints ship the same form of template; the image's token count follows its size
    "llava_next": (LLAVA_TEMPLATE, "USER: <image>\nWhat is this? ASSISTANT:", "<image>"),
    # Idefics3's and SmolVLM's templates write `<image>` for an image part too; the worker expands it into the tiles'
    "idefics3": (LLAVA_TEMPLATE, "USER: <image>\nWhat is this? ASSISTANT:", "<image>"),
    "qwen2_vl": (
        QWEN2_VL_TEMPLATE,
        "<|im_start|>user\nWhat is this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n",
        "<|image_pad|>",
    ),
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory, smollm2_tokenizer):
    from llava_models import llava_checkpoint

    return llava_checkpoint(tmp_path_factory.mktemp("llava"), smollm2_tokenizer)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vision_family(request, tmp_path_factory, smollm2_tokenizer):
    """(name, checkpoint) of each vision family."""
    if request.param == "llava":
        return "llava", request.getfixturevalue("llava")
    if request.param == "llava_next":
        from llava_next_models import llava_next_checkpoint

        return request.param, llava_next_checkpoint(tmp_path_factory.mktemp(request.param), smollm2_tokenizer)
    if request.param == "idefics3":
        from idefics3_models import idefics3_checkpoint

        return request.param, idefics3_checkpoint(tmp_path_factory.mktemp(request.param), smollm2_tokenizer)
    from qwen2_vl_models import qwen2_vl_checkpoint

    return request.param, qwen2_vl_checkpoint(tmp_path_factory.mktemp(request.param), smollm2_tokenizer)


def _chat_body(data: bytes, text: str = "What is this?") -> dict:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0,
                ignore_eos=True)  # fmt: skip


def _direct_answer(path, ids: list[int], image: bytes):
    """Direct mode's greedy 6 tokens for `ids` with `image` (the Completion): what the front must answer."""
    from infer import LLM, SamplingParams

    direct = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        return direct.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, params, False)[0]
    finally:
        direct.close()


def test_a_content_parts_template_writes_the_image_token(vision_family):
    """llava-hf's template and Qwen2-VL's (which writes each image between its vision start and end tokens)."""
    from front_harness import http, local_engine, serving
    from llava_models import png
    from transformers import AutoTokenizer

    name, path = vision_family
    template, text, image_token = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    image = png(33, 21, seed=8)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    want = _direct_answer(path, ids, image)
    assert want.error is None
    local = local_engine(path)
    try:
        with serving(local, tokenizer, chat_template=template) as url:
            status, _, body = http(f"{url}/v1/chat/completions", _chat_body(image))
            assert status == 200, body
            answer = json.loads(body)
            assert answer["choices"][0]["message"]["content"] == want.text
            assert answer["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
            typed = _chat_body(image, f"a typed {image_token} token")
            status, _, body = http(f"{url}/v1/chat/completions", typed)
            assert status == 400 and "content parts hold special-token text" in error_of(body)["message"]
    finally:
        asyncio.run(local.close())


def test_a_gemma3_chat_expands_its_images_as_gemma3_processor(tmp_path_factory, smollm2_tokenizer):
    """Gemma 3's template writes `<start_of_image>` for an image part; the front expands it in the rendered text as
    Gemma3Processor does, so the prompt is the processor's ids and the answer direct mode's for them."""
    from front_harness import http, local_engine, serving
    from gemma3_vision_models import BOI, gemma3_vision_checkpoint
    from llava_models import png
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer

    path = gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3-vision"), smollm2_tokenizer)
    processor, tokenizer = AutoProcessor.from_pretrained(str(path)), AutoTokenizer.from_pretrained(str(path))
    image = png(33, 21, seed=8)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text.count(BOI) == 1
    ids = processor(text=text, images=[Image.open(io.BytesIO(image))])["input_ids"][0]
    assert Tokenization(tokenizer, "hermes").image_token == (BOI, tokenizer.convert_tokens_to_ids(BOI))
    want = _direct_answer(path, ids, image)
    local = local_engine(path)
    try:
        with serving(local, tokenizer) as url:
            status, _, body = http(f"{url}/v1/chat/completions", _chat_body(image))
            assert status == 200, body
            answer = json.loads(body)
            assert answer["choices"][0]["message"]["content"] == want.text
            assert answer["usage"]["prompt_tokens"] == len(ids) == len(want.prompt_token_ids)
    finally:
        asyncio.run(local.close())


def test_a_text_only_models_front_refuses_images(tiny_model_dir, smollm2_tokenizer):
    from front_harness import http, local_engine, serving
    from llava_models import png

    local = local_engine(tiny_model_dir("llama"))
    try:
        with serving(local, smollm2_tokenizer) as url:
            status, _, body = http(f"{url}/v1/chat/completions", _chat_body(png(8, 8, seed=1)))
            assert status == 400 and "takes no images" in error_of(body)["message"], body
    finally:
        asyncio.run(local.close())


async def test_async_llm_direct_takes_multimodal_prompts(llava):
    from llava_models import png

    from infer import AsyncLLM, SamplingParams

    path = llava
    options = dict(dtype="float32", max_model_len=128, kv_cache_memory=4_000_000, num_threads=1)
    async with AsyncLLM(model=str(path), **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        prompt = {"prompt": "look: <image>", "multi_modal_data": {"image": png(9, 9, seed=1)}}
        deltas = [d async for d in llm.generate(prompt, params)]
        assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 4
        bad = {"prompt": "look: <image>", "multi_modal_data": {"video": b"x"}}
        deltas = [d async for d in llm.generate(bad, params)]
        assert deltas[-1].finish_reason == "error" and "modality 'video' is not supported" in deltas[-1].error
