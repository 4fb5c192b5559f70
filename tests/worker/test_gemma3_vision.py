"""Gemma 3 with images (transformers' Gemma3ForConditionalGeneration) against transformers on a tiny random checkpoint
(tests/gemma3_vision_models.py): our preprocessing equals Gemma3ImageProcessor's (PIL backend) and pan-and-scan is
refused by name; prompts expand as Gemma3Processor's do (text, token ids, the chat template's rendering); greedy fp32
tokens equal transformers' `generate` with its two-way mask over each image (the model's local layers have a window of
8, shorter than an image's 16 tokens): one image, two images, a batch mixing image and text requests, prefill chunks
of a few tokens (an image never split: the scheduler keeps its tokens in one chunk), a prefix-cache hit that ends
inside an image, preemption by recompute; a second turn hits the encoder and prefix caches; fp32 logits within 1e-4 of
transformers' and bf16 as close to fp32 as transformers' bf16; every checkpoint layout loads; hostile input is refused by
name; the text-only Gemma 3 still refuses images. (Tensor parallelism: tests/worker/test_images_tensor_parallel.py;
speculative decoding: tests/worker/test_images_speculative.py.)"""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
import torch
from gemma3_vision_models import (
    BOI,
    EOI,
    IMAGE_SIZE,
    IMAGE_TOKEN,
    TOKENS_PER_IMAGE,
    gemma3_vision_checkpoint,
    transformers_gemma3_greedy,
)
from llava_models import bomb, png

from infer import LLM, SamplingParams
from infer.worker.engine.images import ImageLimits, load_image, to_rgb
from infer.worker.engine.vision import Gemma3Preprocessor

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1, block_size=4)
ONE = f"Describe {BOI} now."
TWO = f"Compare {BOI} with{BOI}: which?"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2_tokenizer):
    return gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3-vision"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def processor(gemma3):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(gemma3))


@pytest.fixture(scope="module")
def llm(gemma3):
    engine = LLM(model=str(gemma3), **OPTIONS)
    yield engine
    engine.close()


def _pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


def _processed(processor, text: str, *images: bytes) -> tuple[list[int], torch.Tensor]:
    """Gemma3Processor's ids and pixels for a text prompt."""
    out = processor(text=text, images=[_pil(i) for i in images], return_tensors="pt")
    return out["input_ids"][0].tolist(), out["pixel_values"]


def test_preprocessing_equals_gemma3_image_processor(tmp_path):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    reference = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    ours = Gemma3Preprocessor(64, 64)
    for width, height, mode in ((320, 240, "RGB"), (150, 259, "RGBA"), (30, 30, "L"), (64, 333, "RGB")):
        image = _pil(png(width, height, seed=width, mode=mode))
        expected = reference(image, return_tensors="pt")["pixel_values"][0]
        got = ours(to_rgb(image))
        assert got.shape == expected.shape == (3, 64, 64)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    config = tmp_path / "preprocessor_config.json"
    config.write_text(json.dumps({"size": {"height": 64, "width": 64}, "do_pan_and_scan": True}))
    with pytest.raises(NotImplementedError, match="do_pan_and_scan"):
        Gemma3Preprocessor.for_model(tmp_path, 64)
    config.write_text(json.dumps({"size": {"height": 48, "width": 64}, "do_pan_and_scan": None, "resample": 2}))
    assert Gemma3Preprocessor.for_model(tmp_path, 64) == Gemma3Preprocessor(48, 64)


def test_prompts_expand_as_gemma3_processor(llm, processor):
    """A text prompt (expanded as text: exactly the processor's ids), token ids with one boi per image (expanded in
    ids, the newlines merged), already expanded ids; and the chat template's rendering."""
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    image = png(20, 20, seed=9)
    for text in (ONE, TWO, f"Q:{BOI} ok"):
        count = text.count(BOI)
        want, _ = _processed(processor, text, *[image] * count)
        request, _ = engine.intake.request("r", text, GREEDY, (), 0, [image] * count, 0)
        assert request.prompt_token_ids == want
        bois = [k for k, t in enumerate(want) if t == tokenizer.convert_tokens_to_ids(BOI)]
        assert [(i.offset, i.length) for i in request.images] == [(k + 1, TOKENS_PER_IMAGE) for k in bois]
        placed, _ = engine.intake.request("r", want, GREEDY, (), 0, [image] * count, 0)
        assert placed.prompt_token_ids == want  # already expanded: as it is
    # ids holding one boi per image: the "\n\n" merged with the newline before it into one token, as the text gives
    want, _ = _processed(processor, f"Q:\n{BOI} ok", image)
    ids = tokenizer(f"Q:\n{BOI} ok", add_special_tokens=False)["input_ids"]
    assert engine.intake.request("r", ids, GREEDY, (), 0, [image], 0)[0].prompt_token_ids == want
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.count(BOI) == 1
    want, _ = _processed(processor, rendered, image)
    assert engine.intake.request("r", rendered, GREEDY, (), 0, [image], 0)[0].prompt_token_ids == want


def test_greedy_equals_transformers(gemma3, llm, processor):
    """One image, two images, and a batch of image and text requests (one step prefills them all)."""
    red, blue = png(40, 30, seed=1), png(30, 64, seed=2)
    one, one_pixels = _processed(processor, ONE, red)
    two, two_pixels = _processed(processor, TWO, red, blue)
    text_only = llm.get_tokenizer()("A plain question: why?", add_special_tokens=False)["input_ids"]
    want_one = transformers_gemma3_greedy(gemma3, one, one_pixels, MAX_NEW)
    want_two = transformers_gemma3_greedy(gemma3, two, two_pixels, MAX_NEW)
    want_text = transformers_gemma3_greedy(gemma3, text_only, None, MAX_NEW)
    outs = llm.generate(
        [
            {"prompt": ONE, "multi_modal_data": {"image": red}},
            text_only,
            {"prompt_token_ids": one, "multi_modal_data": {"image": [red]}},
            {"prompt": TWO, "multi_modal_data": {"image": [red, blue]}},
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.error for o in outs] == [None] * 4
    assert outs[0].prompt_token_ids == one and outs[3].prompt_token_ids == two
    assert [o.token_ids for o in outs] == [want_one, want_text, want_one, want_two]


def test_chunked_prefill_keeps_each_image_in_one_chunk(gemma3, processor):
    """A budget of 20 tokens a step: the chunks stop before an image and take its 16 tokens whole (the image's two-way
    attention needs them together); the tokens equal transformers'. An image past the budget is refused by name."""
    red, blue = png(50, 50, seed=3), png(33, 40, seed=4)
    small = LLM(model=str(gemma3), **{**OPTIONS, "max_num_batched_tokens": 20, "enable_prefix_caching": False})
    try:
        engine = small.engine
        ids, pixels = _processed(processor, TWO, red, blue)
        chunks: list[tuple[int, int]] = []
        schedule = engine.scheduler.schedule

        def recording(*args, **kwargs):
            out = schedule(*args, **kwargs)
            chunks.extend((c.start, c.end) for c in out.chunks if not c.is_decode)
            return out

        engine.scheduler.schedule = recording
        out = small.generate({"prompt": TWO, "multi_modal_data": {"image": [red, blue]}}, GREEDY, use_tqdm=False)[0]
        assert out.error is None and out.token_ids == transformers_gemma3_greedy(gemma3, ids, pixels, MAX_NEW)
        images = [i for i, t in enumerate(ids) if t == small.get_tokenizer().convert_tokens_to_ids(BOI)]
        assert len(chunks) >= 3 and chunks[-1][1] == len(ids)
        for start in (b + 1 for b in images):  # each image's tokens in one chunk
            assert any(s <= start and start + TOKENS_PER_IMAGE <= e for s, e in chunks), chunks
    finally:
        small.close()
    tight = LLM(model=str(gemma3), **{**OPTIONS, "max_num_batched_tokens": 12})
    try:
        refused = tight.generate({"prompt": ONE, "multi_modal_data": {"image": red}}, GREEDY, use_tqdm=False)[0]
        assert refused.finish_reason == "error"
        assert "an image takes 16 tokens, more than max_num_batched_tokens (12)" in refused.error
    finally:
        tight.close()


def test_second_turn_hits_the_encoder_and_prefix_caches(llm):
    engine = llm.engine
    image, other = png(64, 48, seed=5), png(64, 48, seed=6)
    first = f"Look:{BOI} What is in the picture?"
    turn1 = llm.generate({"prompt": first, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    encoded = engine.runner.images.encoded
    cached = engine.scheduler.block_manager.num_hit_tokens
    second = first + turn1.text + " And the colours?"
    turn2 = llm.generate({"prompt": second, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert turn2.error is None
    assert engine.runner.images.encoded == encoded  # not encoded again
    assert engine.scheduler.block_manager.num_hit_tokens - cached >= len(turn1.prompt_token_ids) - 4
    cached = engine.scheduler.block_manager.num_hit_tokens
    alone = llm.generate({"prompt": second, "multi_modal_data": {"image": other}}, GREEDY, use_tqdm=False)[0]
    assert alone.error is None and engine.runner.images.encoded == encoded + 1
    image_start = turn1.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN))
    assert engine.scheduler.block_manager.num_hit_tokens - cached <= image_start  # another image never hits


def test_a_prefix_cache_hit_that_ends_inside_an_image(gemma3, llm, processor):
    """The cache keeps only the first blocks of an earlier request (the later ones evicted, as the pool's LRU takes
    a freed request's tail first), ending inside its image: the next request with the same image takes those blocks
    (computed with the whole image) and computes the image's rest in one chunk; the tokens equal transformers'."""
    image = png(36, 44, seed=12)
    text = f"Look closely:{BOI} What is in the picture?"
    ids, pixels = _processed(processor, text, image)
    start = ids.index(processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    keep = start // 4 + 2  # blocks of 4 tokens: the cache ends 5-8 tokens into the image
    assert start < keep * 4 < start + TOKENS_PER_IMAGE
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].error is None
    blocks = llm.engine.scheduler.block_manager
    taken = []
    while blocks.num_cached_blocks > keep:  # evict from the front of the free queue: the oldest, this request's last
        taken.append(blocks._take_free_block())
    for block_id in taken:
        blocks._unref(block_id)
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == keep * 4
    assert again.token_ids == transformers_gemma3_greedy(gemma3, ids, pixels, MAX_NEW)


def test_preempted_image_requests_recompute_their_images(gemma3, llm):
    """A pool of 16 blocks of 4 tokens for three image prompts of ~28 tokens and 24 new tokens each: preemption by
    recompute runs their images again (from the encoder cache) and the tokens equal the roomy engine's."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [
        {"prompt": f"q{i}:{BOI} describe it", "multi_modal_data": {"image": png(20 + i, 20, seed=30 + i)}}
        for i in range(3)
    ]
    roomy = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    bytes_per_block = 2 * 4 * 4 * 2 * 32 * 4  # K and V, 4 layers, 4 tokens, 2 KV heads, head_dim 32, fp32
    small = LLM(model=str(gemma3), **{**OPTIONS, "kv_cache_memory": 16 * bytes_per_block})
    try:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert [o.error for o in outs] == [None] * 3 and [o.token_ids for o in outs] == roomy
        assert small.engine.scheduler.num_preemptions > 0
    finally:
        small.close()


def test_logits_equal_transformers_and_bf16_is_as_close_as_its_bf16(gemma3, processor):
    """The logits of a two-image prompt and its fp32 greedy continuation, position by position, one paged forward:
    fp32 within 1e-4 of transformers' (and not without the images' two-way attention: a causal mask alone is 1e-2
    off or more); bf16 drifts from transformers' fp32 no more than 1.5x transformers' own bf16 does (the largest error
    per position relative to the largest fp32 logit, the maximum over positions), and picks fp32's next token at 80%
    of the positions or more."""
    from transformers import Gemma3ForConditionalGeneration

    ids, pixels = _processed(processor, TWO, png(40, 30, seed=1), png(30, 64, seed=2))
    ids = ids + transformers_gemma3_greedy(gemma3, ids, pixels, 12)
    x = torch.tensor([ids])
    types = (x == processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)).long()
    with torch.inference_mode():
        theirs = {}
        for dtype in (torch.float32, torch.bfloat16):
            hf = Gemma3ForConditionalGeneration.from_pretrained(gemma3, dtype=dtype).eval()
            theirs[dtype] = hf(x, pixel_values=pixels.to(dtype), token_type_ids=types).logits[0].float()
    reference = theirs[torch.float32]
    assert (_our_logits(gemma3, ids, pixels, types[0], torch.float32) - reference).abs().max() <= 1e-4
    causal = _our_logits(gemma3, ids, pixels, types[0], torch.float32, two_way=False)
    assert (causal - reference).abs().max() >= 1e-2

    def drift(values: torch.Tensor) -> float:
        return ((values - reference).abs().amax(-1) / reference.abs().max()).max().item()

    ours = _our_logits(gemma3, ids, pixels, types[0], torch.bfloat16)
    same = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    bound = 1.5 * drift(theirs[torch.bfloat16])
    print(f"gemma3 with images bf16 (max): ours {drift(ours):.3g}, bound {bound:.3g}; {same:.0%} of fp32's next tokens")
    assert drift(ours) <= bound
    assert same >= 0.8


def _our_logits(
    path, ids: list[int], pixels: torch.Tensor, types: torch.Tensor, dtype: torch.dtype, two_way: bool = True
) -> torch.Tensor:
    """Our logits [len(ids), vocab] of one prefill of `ids` over a paged pool, the images' features at their rows and
    (`two_way`) each image's span for its two-way attention, as the model runner gives them."""
    from model_batches import Pager, new_cache

    from infer.worker.loading.loader import load_model

    model = load_model(path, dtype, torch.device("cpu"))
    rows = torch.nonzero(types).flatten()
    starts = [int(r) for r in rows if r == 0 or not types[r - 1]]
    batch = replace(
        Pager(num_blocks=32, block_size=4).batch([("s", ids, 0, len(ids))]),
        image_rows=rows,
        image_embeds=model.encode_images(pixels).reshape(-1, model.config.hidden_size),
        image_spans=tuple((0, s, s + TOKENS_PER_IMAGE) for s in starts) if two_way else None,
    )
    with torch.inference_mode():
        return model.compute_logits(model(batch, new_cache(model, 32, 4)))


@pytest.mark.parametrize(
    "images, prompt, message",
    [
        ([b"not an image at all"], ONE, "image 0: not an image Pillow can read"),
        (["truncated"], ONE, "image 0: cannot decode its pixels (PNG)"),
        (["bomb"], ONE, "5000x5000 = 25000000 pixels exceeds the limit of 16777216 pixels per image"),
        (["ok"] * 5, "x" + BOI * 5, "5 images exceed the limit of 4 per prompt (--limit-mm-per-prompt)"),
        (["ok", "ok"], ONE, f"the prompt holds 1 {BOI} token(s) for its 2 image(s): give one per image"),
        ([], f"x {IMAGE_TOKEN}", "the prompt holds image tokens"),
        ([12], ONE, "image 0: expected encoded image bytes or a PIL.Image, got int"),
    ],
)
def test_hostile_input_is_refused_by_name(llm, images, prompt, message):
    good = png(20, 20, seed=6)
    made = {"truncated": good[: len(good) // 2], "bomb": bomb(), "ok": good}
    images = [made.get(i, i) if isinstance(i, str) else i for i in images]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "error" and message in out.error, out.error
    ok = llm.generate({"prompt": ONE, "multi_modal_data": {"image": good}}, GREEDY, use_tqdm=False)[0]
    assert ok.error is None and len(ok.token_ids) == MAX_NEW


def test_token_ids_that_fit_no_form_are_refused(llm):
    tokenizer = llm.get_tokenizer()
    image_id, eoi = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), tokenizer.convert_tokens_to_ids(EOI)
    image = png(20, 20, seed=7)
    short = [5, 6, image_id, image_id, eoi, 7]  # a run of 2 image tokens for an image of 16
    out = llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "error" and "it holds 2 in 1 run(s)" in out.error
    none = [5, 6, 7]
    out = llm.generate({"prompt_token_ids": none, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "error" and f"holds 0 {BOI} token(s)" in out.error


def test_the_text_only_gemma3_refuses_images(family_dir):
    text_llm = LLM(model=str(family_dir("gemma3")), **OPTIONS)
    try:
        out = text_llm.generate({"prompt": "hi", "multi_modal_data": {"image": png(8, 8, 0)}}, use_tqdm=False)[0]
        assert out.finish_reason == "error" and "takes no images: it is a text-only model" in out.error
        assert type(text_llm.engine.model).__name__ == "Gemma3ForCausalLM"
    finally:
        text_llm.close()


def test_the_checkpoint_s_image_size_is_the_tests(gemma3):
    from transformers import AutoConfig

    assert IMAGE_SIZE == AutoConfig.from_pretrained(gemma3).vision_config.image_size


def test_image_limits_are_the_engine_s(llm):
    assert llm.engine.image_limits == ImageLimits()
    pixels = llm.engine.preprocess(load_image(png(10, 90, seed=8), ImageLimits())[0])
    assert pixels.shape == (3, IMAGE_SIZE, IMAGE_SIZE)  # resized whole: no aspect-ratio crop


@pytest.mark.parametrize(
    "renames",
    [
        (("vision_tower.", "vision_tower.vision_model."),),  # published Gemma 3 checkpoints
        (  # transformers 5's module names, unconverted
            ("language_model.model.", "model.language_model."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ),
    ],
    ids=["published", "transformers5-modules"],
)
def test_every_checkpoint_layout_loads_the_same_weights(gemma3, tmp_path, renames):
    """transformers 5 saves `language_model.model.*`, `vision_tower.*` (its attention-pooling head too, which Gemma 3
    never runs: skipped), `multi_modal_projector.*`, the LM head tied; the other layouts load into the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from infer.worker.loading.loader import load_model

    other = tmp_path / "other"
    shutil.copytree(gemma3, other)
    tensors = load_file(other / "model.safetensors")
    assert any(k.startswith("vision_tower.head.") for k in tensors) and "lm_head.weight" not in tensors
    renamed = {
        next((new + k[len(old) :] for old, new in renames if k.startswith(old)), k): v for k, v in tensors.items()
    }
    save_file(renamed, other / "model.safetensors")
    cpu = torch.device("cpu")
    saved, moved = load_model(gemma3, torch.float32, cpu), load_model(other, torch.float32, cpu)
    assert type(saved).__name__ == "Gemma3ForConditionalGeneration" and saved.lm_head_tied
    for (name, a), (_, b) in zip(saved.state_dict().items(), moved.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
