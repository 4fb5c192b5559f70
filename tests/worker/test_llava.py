"""LLaVA-1.5 against transformers on a tiny random checkpoint (tests/llava_models.py): our preprocessing equals
CLIPImageProcessor's (PIL backend); greedy tokens equal transformers' `generate` in fp32 through `LLM.generate` with
vLLM's prompt form (one `<image>` per image, or the image's tokens already expanded), with two images in one prompt
and with prefill chunks that split an image's tokens, and through preemption by recompute; a second turn with the same
image neither encodes nor prefills it again, and another image with the same token ids never hits; every checkpoint
layout loads; hostile images are refused by name."""

from __future__ import annotations

import io

import pytest
import torch
from llava_models import (
    IMAGE_SIZE,
    IMAGE_TOKEN,
    TOKENS_PER_IMAGE,
    bomb,
    llava_checkpoint,
    png,
    transformers_llava_greedy,
)

from infer import LLM, SamplingParams
from infer.worker.engine.images import ImageLimits, load_image, to_rgb
from infer.worker.engine.vision import ClipPreprocessor

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1, block_size=4)


@pytest.fixture(scope="module")
def llava(tmp_path_factory, smollm2_tokenizer):
    return llava_checkpoint(tmp_path_factory.mktemp("llava"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def llm(llava):
    engine = LLM(model=str(llava), **OPTIONS)
    yield engine
    engine.close()


def _pixels(*images: bytes) -> torch.Tensor:
    pre = ClipPreprocessor(IMAGE_SIZE, IMAGE_SIZE, IMAGE_SIZE)
    return torch.stack([pre(load_image(b, ImageLimits())[0]) for b in images])


def test_preprocessing_equals_clip_image_processor():
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    reference = CLIPImageProcessorPil(size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112})
    ours = ClipPreprocessor(112, 112, 112)
    for width, height, mode in ((320, 240, "RGB"), (150, 259, "RGBA"), (100, 100, "L"), (112, 333, "RGB")):
        image = Image.open(io.BytesIO(png(width, height, seed=width, mode=mode)))
        expected = reference(image, return_tensors="pt")["pixel_values"][0]
        got = ours(to_rgb(image))
        assert got.shape == expected.shape == (3, 112, 112)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_the_settings_a_saved_processor_holds_are_read(llava, tmp_path):
    """transformers 5 saves a processor's image settings in processor_config.json (no preprocessor_config.json):
    they are read, not replaced by the defaults; a preprocessor_config.json, where there is one, is read first."""
    import json

    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    images = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 56, "width": 48}, image_mean=[0.5] * 3)
    tokenizer = AutoTokenizer.from_pretrained(str(llava))
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14).save_pretrained(str(tmp_path))
    assert not (tmp_path / "preprocessor_config.json").exists()
    got = ClipPreprocessor.for_model(tmp_path, IMAGE_SIZE)
    assert (got.shortest_edge, got.crop_height, got.crop_width, got.mean) == (64, 56, 48, (0.5, 0.5, 0.5))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 80}, "crop_size": 72}))
    got = ClipPreprocessor.for_model(tmp_path, IMAGE_SIZE)
    assert (got.shortest_edge, got.crop_height, got.crop_width) == (80, 72, 72)


def test_greedy_equals_transformers(llava, llm):
    tokenizer = llm.get_tokenizer()
    red, blue = png(40, 30, seed=1), png(30, 64, seed=2)
    text = f"USER: {IMAGE_TOKEN}\nWhat is this? ASSISTANT:"
    one = tokenizer(text)["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    at = one.index(image_id)
    expanded = one[:at] + [image_id] * TOKENS_PER_IMAGE + one[at + 1 :]
    two_text = f"USER: {IMAGE_TOKEN} and {IMAGE_TOKEN}: which? ASSISTANT:"
    two = tokenizer(two_text)["input_ids"]
    two_expanded = [t for i in two for t in ([i] * TOKENS_PER_IMAGE if i == image_id else [i])]
    want_one = transformers_llava_greedy(llava, expanded, _pixels(red), MAX_NEW)
    want_two = transformers_llava_greedy(llava, two_expanded, _pixels(red, blue), MAX_NEW)
    outs = llm.generate(
        [
            {"prompt": text, "multi_modal_data": {"image": red}},
            {"prompt_token_ids": expanded, "multi_modal_data": {"image": [red]}},
            {"prompt": two_text, "multi_modal_data": {"image": [red, blue]}},
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.error for o in outs] == [None] * 3
    assert outs[0].prompt_token_ids == expanded
    assert [o.token_ids for o in outs] == [want_one, want_one, want_two]


def test_chunked_prefill_splits_an_image(llava):
    """A budget of 6 tokens a step: each image's 16 tokens span several chunks (encoded once, at the first)."""
    image = png(50, 50, seed=3)
    text = f"USER: {IMAGE_TOKEN}\nDescribe. ASSISTANT:"
    small = LLM(model=str(llava), **{**OPTIONS, "max_num_batched_tokens": 6, "enable_prefix_caching": False})
    try:
        tokenizer = small.get_tokenizer()
        ids = tokenizer(text)["input_ids"]
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        expanded = [t for i in ids for t in ([i] * TOKENS_PER_IMAGE if i == image_id else [i])]
        out = small.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
        assert out.token_ids == transformers_llava_greedy(llava, expanded, _pixels(image), MAX_NEW)
        images = small.engine.runner.images
        assert images.encoded == 1 and images.hits >= 2  # the image's later chunks take the cached features
    finally:
        small.close()


def test_second_turn_hits_the_encoder_and_prefix_caches(llm):
    engine = llm.engine
    image, other = png(64, 48, seed=4), png(64, 48, seed=5)
    first = f"USER: {IMAGE_TOKEN}\nWhat is in the picture? ASSISTANT:"
    turn1 = llm.generate({"prompt": first, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    encoded, hits = engine.runner.images.encoded, engine.runner.images.hits
    cached = engine.scheduler.block_manager.num_hit_tokens
    second = first + turn1.text + " USER: and the colours? ASSISTANT:"
    turn2 = llm.generate({"prompt": second, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert turn2.error is None
    assert engine.runner.images.encoded == encoded  # not encoded again
    hit = engine.scheduler.block_manager.num_hit_tokens - cached
    assert hit >= len(turn1.prompt_token_ids) - 4  # the first turn's prompt, image included, from the prefix cache
    cached = engine.scheduler.block_manager.num_hit_tokens
    # the same tokens with another image: the image's blocks never hit, and it is encoded
    alone = llm.generate({"prompt": second, "multi_modal_data": {"image": other}}, GREEDY, use_tqdm=False)[0]
    assert alone.error is None and engine.runner.images.encoded == encoded + 1
    image_start = turn1.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN))
    assert engine.scheduler.block_manager.num_hit_tokens - cached <= image_start
    # the first image after other text: its tokens are computed, its features come from the encoder cache
    other_text = llm.generate(
        {"prompt": f"Q: {IMAGE_TOKEN} colours?", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False
    )
    assert other_text[0].error is None
    assert engine.runner.images.encoded == encoded + 1 and engine.runner.images.hits == hits + 1


@pytest.mark.parametrize(
    "images, prompt, message",
    [
        ([b"not an image at all"], "x <image>", "image 0: not an image Pillow can read"),
        (["truncated"], "x <image>", "image 0: cannot decode its pixels (PNG)"),
        (
            ["bomb"],
            "x <image>",
            "5000x5000 = 25000000 pixels exceeds the limit of 16777216 pixels per image (checked before decoding)",
        ),
        ([b"\x89PNG" + b"\0" * (21 * 1024 * 1024)], "x <image>", "exceeds the limit of 20971520 bytes per image"),
        (["ok"] * 5, "x" + " <image>" * 5, "5 images exceed the limit of 4 per prompt (--limit-mm-per-prompt)"),
        (["ok", "ok"], "x <image>", "do not match its 2 image(s): it holds 1 in 1 run(s)"),
        ([], "x <image>", "the prompt holds image tokens"),
        ([12], "x <image>", "image 0: expected encoded image bytes or a PIL.Image, got int"),
        (["thin"], "x <image>", "image 0: 1x3000 pixels: an aspect ratio past 64:1 is refused"),
    ],
)
def test_hostile_images_are_refused_by_name(llm, images, prompt, message):
    good = png(20, 20, seed=6)
    made = {"truncated": good[: len(good) // 2], "bomb": bomb(), "ok": good, "thin": png(1, 3000, seed=7)}
    images = [made.get(i, i) if isinstance(i, str) else i for i in images]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "error" and message in out.error, out.error
    # and the engine still serves
    ok = llm.generate({"prompt": "x <image>", "multi_modal_data": {"image": good}}, GREEDY, use_tqdm=False)[0]
    assert ok.error is None and len(ok.token_ids) == MAX_NEW


def test_a_text_model_refuses_images(tiny_model_dir):
    text_llm = LLM(model=str(tiny_model_dir("llama")), **OPTIONS)
    try:
        out = text_llm.generate({"prompt": "hi", "multi_modal_data": {"image": png(8, 8, 0)}}, use_tqdm=False)[0]
        assert out.finish_reason == "error" and "takes no images: it is a text-only model" in out.error
    finally:
        text_llm.close()


@pytest.mark.parametrize(
    "renames",
    [
        # published LLaVA checkpoints: the CLIP tower under vision_model
        (("vision_tower.", "vision_tower.vision_model."),),
        # transformers 5's module names, unconverted
        (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ),
    ],
    ids=["published", "transformers5-modules"],
)
def test_every_checkpoint_layout_loads_the_same_weights(llava, tmp_path, renames):
    """transformers 5 saves `language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
    `multi_modal_projector.*`; the other layouts load into the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from infer.worker.loading.loader import load_model

    other = tmp_path / "other"
    shutil.copytree(llava, other)

    def renamed(key: str) -> str:
        return next((new + key[len(old) :] for old, new in renames if key.startswith(old)), key)

    tensors = load_file(other / "model.safetensors")
    save_file({renamed(k): v for k, v in tensors.items()}, other / "model.safetensors")
    cpu = torch.device("cpu")
    saved, moved = load_model(llava, torch.float32, cpu), load_model(other, torch.float32, cpu)
    assert type(saved).__name__ == "LlavaForConditionalGeneration" and saved.num_vision_layers == 2
    for (name, a), (_, b) in zip(saved.state_dict().items(), moved.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_preempted_image_requests_recompute_their_images(llava, llm):
    """A pool of 14 blocks of 4 tokens for three 30-token image prompts of 24 new tokens: preemption by recompute
    runs their images' tokens again (from the encoder cache) and the tokens equal the roomy engine's."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [
        {"prompt": f"q{i}: {IMAGE_TOKEN} describe it", "multi_modal_data": {"image": png(20 + i, 20, seed=30 + i)}}
        for i in range(3)
    ]
    roomy = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    small = LLM(model=str(llava), **{**OPTIONS, "kv_cache_memory": 14 * 2048})
    try:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert [o.error for o in outs] == [None] * 3 and [o.token_ids for o in outs] == roomy
        assert small.engine.scheduler.num_preemptions > 0
    finally:
        small.close()
