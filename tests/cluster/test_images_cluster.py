"""Images through real clusters (tests/llava_models.py's tiny LLaVA, tests/qwen2_vl_models.py's tiny Qwen2-VL,
tests/gemma3_vision_models.py's tiny Gemma 3, tests/idefics3_models.py's tiny Idefics3): kill -9 of the worker streaming
an image request ends it exactly as direct mode does, on the other worker, which decodes and encodes the image again
(Qwen2-VL: and gives the resumed tokens their M-RoPE positions again; Gemma 3: its image's two-way attention again;
Idefics3: its tiles cut and placed again; LLaVA-NeXT: its grid chosen from the image's size and its tiles encoded
again; LLaVA-1.5's fixed-size images take no path of their own there, so it is not run again); `infer-serve` with 2 workers (LLaVA, Gemma 3) answers the official `openai` client's chat with a base64 data:
URL image with direct mode's greedy text (Gemma 3: for the chat prompt as its processor renders and expands it), and
answers hostile images with a 400 naming what is wrong while it keeps serving."""

from __future__ import annotations

import base64
import time
import urllib.request

import openai
import pytest
from fault_streams import kill9_the_busiest_worker, streams_through_a_fault
from gemma3_vision_models import BOI, gemma3_vision_checkpoint
from llava_models import IMAGE_TOKEN, TOKENS_PER_IMAGE, llava_checkpoint, png
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import Served

from infer import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1)
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1"]
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
IMAGE = png(48, 36, seed=21)
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def llava(tmp_path_factory, smollm2_tokenizer):
    return llava_checkpoint(tmp_path_factory.mktemp("llava"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2_tokenizer):
    return gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3"), smollm2_tokenizer)


@pytest.fixture(scope="module", params=["qwen2_vl", "gemma3", "idefics3", "llava_next"])
def family(request, tmp_path_factory, smollm2_tokenizer):
    """(checkpoint, a long-story prompt with one image, the image) of the vision families whose resumed request
    differs."""
    if request.param == "gemma3":
        return request.getfixturevalue("gemma3"), f"Tell me a long story about it:{BOI}", IMAGE
    if request.param == "idefics3":
        from idefics3_models import idefics3_checkpoint

        path = idefics3_checkpoint(tmp_path_factory.mktemp("idefics3"), smollm2_tokenizer)
        return path, f"Tell me a long story about it:{IMAGE_TOKEN}", IMAGE
    if request.param == "llava_next":
        from llava_next_models import llava_next_checkpoint

        path = llava_next_checkpoint(tmp_path_factory.mktemp("llava_next"), smollm2_tokenizer)
        # A tall image: a grid of 2x1 tiles, 40 of its tokens, so that the prompt and LONG's tokens fit the context.
        return path, f"Tell me a long story about it:{IMAGE_TOKEN}", png(20, 60, seed=3)
    from qwen2_vl_models import IMAGE as QWEN_IMAGE
    from qwen2_vl_models import qwen2_vl_checkpoint

    path = qwen2_vl_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), smollm2_tokenizer)
    return path, f"User: {QWEN_IMAGE}\nTell me a long story about it. Assistant:", IMAGE


@pytest.fixture(scope="module")
def long_stream(family):
    """Direct mode's answer to the family's long prompt."""
    path, prompt, image = family
    llm = LLM(model=str(path), **ENGINE)
    try:
        return llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, LONG, use_tqdm=False)[0]
    finally:
        llm.close()


@pytest.fixture(scope="module", params=["llava", "gemma3"])
def chat_model(request):
    """(name, checkpoint) of each family the chat tests serve."""
    return request.param, request.getfixturevalue(request.param)


def _chat_ids(name: str, path, tokenizer) -> list[int]:
    """The chat prompt's ids as the front renders them (Gemma 3: expanded as its processor does)."""
    if name == "gemma3":
        import io

        from PIL import Image
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(path))
        content = [{"type": "text", "text": QUESTION}, {"type": "image"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        return processor(text=text, images=[Image.open(io.BytesIO(IMAGE))])["input_ids"][0]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION + IMAGE_TOKEN}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def direct(chat_model):
    """Direct mode's answer to the chat prompt's ids (as the front renders them)."""
    name, path = chat_model
    llm = LLM(model=str(path), **ENGINE)
    try:
        ids = _chat_ids(name, path, llm.get_tokenizer())
        chat = llm.generate(
            {"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGE}},
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )[0]
        return chat
    finally:
        llm.close()


async def test_kill_9_of_the_worker_streaming_an_image_request(model_cluster, family, long_stream):
    want = long_stream
    path, text, image = family
    cluster = model_cluster(workers=2, model=path)
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    (stream,), stats = await streams_through_a_fault(
        cluster, [prompt], LONG, lambda client: kill9_the_busiest_worker(cluster, client), finish_timeout=240
    )
    assert stats.requests_redispatched == 1
    assert want.finish_reason == "length" and len(want.token_ids) == LONG.max_tokens
    assert [t for delta in stream for t in delta.token_ids] == want.token_ids


@pytest.fixture(scope="module")
def served(chat_model, tmp_path_factory):
    name, path = chat_model
    server = Served(path, tmp_path_factory.mktemp("serve") / "serve.log", name, ENGINE_FLAGS)
    yield server
    server.stop()


def _chat(client: openai.OpenAI, url: str, **extra):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}],
            }
        ],
        temperature=0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
        **extra,
    )


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_openai_chat_with_a_data_url_image_equals_direct_mode(served, direct):
    """Twice in one session (X-Session-ID: the same worker), the second time from its prefix cache: the image's
    tokens are not computed again, so it is not encoded again either."""
    want = direct
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    encoded = _metric(served.url, "infer:mm_images_encoded_total")
    hits = _metric(served.url, "infer:prefix_cache_hits_total")
    for _ in range(2):
        answer = _chat(client, _data_url(IMAGE), extra_headers={"X-Session-ID": "one conversation"})
        assert answer.choices[0].message.content == want.text
        assert answer.usage.prompt_tokens == len(want.prompt_token_ids) > TOKENS_PER_IMAGE
    deadline = time.monotonic() + 30  # the workers' loads reach the coordinator with their steps and heartbeats
    while _metric(served.url, "infer:prefix_cache_hits_total") < hits + TOKENS_PER_IMAGE:
        assert time.monotonic() < deadline, "no prefix-cache hit reported"
        time.sleep(0.2)
    assert _metric(served.url, "infer:mm_images_encoded_total") == encoded + 1


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://example.invalid/cat.png", "http URLs are not fetched"),
        ("file:///etc/passwd", "file: URLs are refused unless the server runs with --allowed-local-media-path"),
        ("data:image/png;base64,@@@@", "the data: URL's data is not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain' is not an image"),
        (_data_url(b"GIF89a but not really"), "image 0: not an image Pillow can read"),
        (_data_url(IMAGE[: len(IMAGE) // 2]), "image 0: cannot decode its pixels (PNG)"),
    ],
)
def test_hostile_images_get_a_400_naming_the_problem(served, url, message):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, url)
    assert message in str(refused.value), refused.value
    assert _chat(client, _data_url(IMAGE)).choices[0].finish_reason == "length"  # still serving
