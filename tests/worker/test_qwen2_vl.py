"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints (tests/qwen2_vl_models.py): our
preprocessing equals Qwen2VLImageProcessor's on images of odd sizes; a prompt's expansion equals Qwen2VLProcessor's;
greedy fp32 tokens equal transformers' `generate` with one image, two images of different sizes, and a text-only
request in the same batch; with prefill chunks that split an image (M-RoPE positions per chunk); through preemption by
recompute; a second turn with the same image hits the encoder and prefix caches; bf16 stays as close to fp32 as
transformers' own bf16; hostile input and what is not supported are refused by name."""

from __future__ import annotations

import io

import pytest
import torch
from llava_models import bomb, png
from qwen2_vl_models import (
    IMAGE,
    IMAGE_PAD,
    MAX_PIXELS,
    MIN_PIXELS,
    image_processor,
    qwen2_vl_checkpoint,
    transformers_greedy,
    transformers_inputs,
)

from infer import LLM, SamplingParams
from infer.kernels import cpu_kernels
from infer.worker.engine.images import to_rgb
from infer.worker.engine.vision import Qwen2VLPreprocessor

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1, block_size=4)
TYPES = ("qwen2_vl", "qwen2_5_vl")
ONE = f"Look: {IMAGE} what is it?"
TWO = f"A {IMAGE} and B {IMAGE}: which?"
TEXT = "Only words here, no picture."
WIDE, TALL = png(40, 30, seed=1), png(90, 150, seed=2)  # 2x3 and 5x3 tokens (Qwen2.5: windows of 2x2 cut the 2nd)


@pytest.fixture(scope="module", params=TYPES)
def checkpoint(request, tmp_path_factory, smollm2_tokenizer):
    return request.param, qwen2_vl_checkpoint(tmp_path_factory.mktemp(request.param), smollm2_tokenizer, request.param)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(model=str(checkpoint[1]), **OPTIONS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def expected(checkpoint):
    """transformers' fp32 greedy tokens of the prompts, by name."""
    path = checkpoint[1]
    return {
        "one": transformers_greedy(path, ONE, [WIDE], MAX_NEW, torch.float32),
        "two": transformers_greedy(path, TWO, [WIDE, TALL], MAX_NEW, torch.float32),
        "text": transformers_greedy(path, TEXT, [], MAX_NEW, torch.float32),
    }


def _image(width: int, height: int, seed: int, mode: str) -> object:
    from PIL import Image

    return Image.open(io.BytesIO(png(width, height, seed=seed, mode=mode)))


@pytest.mark.parametrize(
    "width, height, mode, bounds",
    [
        (40, 30, "RGB", (MIN_PIXELS, MAX_PIXELS)),  # scaled up to min_pixels
        (150, 90, "RGBA", (MIN_PIXELS, MAX_PIXELS)),  # scaled down to max_pixels
        (17, 203, "L", (MIN_PIXELS, MAX_PIXELS)),
        (333, 251, "RGB", (56 * 56, 28 * 28 * 1280)),  # the processor's defaults: rounded to multiples of 28
    ],
)
def test_preprocessing_equals_qwen2vl_image_processor(width, height, mode, bounds):
    image = _image(width, height, width, mode)
    reference = image_processor(*bounds)(image, return_tensors="pt")
    got = Qwen2VLPreprocessor(*bounds)(to_rgb(image))
    rows, cols = got.shape[:2]
    assert reference["image_grid_thw"].tolist() == [[1, 2 * rows, 2 * cols]]
    torch.testing.assert_close(got.reshape(-1, got.shape[-1]), reference["pixel_values"], atol=1e-5, rtol=0)


def test_mrope_positions_equal_get_rope_index(checkpoint, llm):
    """The positions of a request with two images, in chunks that cut each image anywhere, equal transformers'
    get_rope_index; decode positions are the place plus its rope delta."""
    from transformers import AutoModelForImageTextToText

    from infer.worker.engine.vision import mrope_positions

    inputs = transformers_inputs(checkpoint[1], TWO, [WIDE, TALL])
    ids = inputs["input_ids"][0].tolist()
    model = AutoModelForImageTextToText.from_pretrained(checkpoint[1]).model
    want, delta = model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    request, _ = llm.engine.intake.request("r", ids, None, (), 0, [WIDE, TALL], 0)  # checked, not queued
    assert request.prompt_token_ids == ids and request.rope_delta == int(delta) < 0
    for cuts in ((0, len(ids)), (0, 5, 9, 17, 30, len(ids)), tuple(range(len(ids) + 1))):
        got = torch.cat([mrope_positions(request, a, b - a) for a, b in zip(cuts, cuts[1:])], dim=1)
        assert got.tolist() == want[:, 0].tolist(), cuts
    after = mrope_positions(request, len(ids), 3)
    assert after.tolist() == [[len(ids) + int(delta) + k for k in range(3)]] * 3


def test_greedy_equals_transformers_in_one_batch(checkpoint, llm, expected):
    """One image, two images of different sizes and a text-only prompt in one batch; the first again as token ids
    with its image's pad already expanded. Each prompt's ids equal Qwen2VLProcessor's expansion."""
    path = checkpoint[1]
    expanded = transformers_inputs(path, ONE, [WIDE])["input_ids"][0].tolist()
    outs = llm.generate(
        [
            {"prompt": ONE, "multi_modal_data": {"image": WIDE}},
            {"prompt": TWO, "multi_modal_data": {"image": [WIDE, TALL]}},
            TEXT,
            {"prompt_token_ids": expanded, "multi_modal_data": {"image": [WIDE]}},
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.error for o in outs] == [None] * 4
    assert outs[0].prompt_token_ids == expanded
    assert outs[1].prompt_token_ids == transformers_inputs(path, TWO, [WIDE, TALL])["input_ids"][0].tolist()
    pad = llm.get_tokenizer().convert_tokens_to_ids(IMAGE_PAD)
    assert outs[1].prompt_token_ids.count(pad) == 6 + 15  # 2x3 and 5x3 merged tokens
    want = [expected["one"], expected["two"], expected["text"], expected["one"]]
    assert [o.token_ids for o in outs] == want


def test_chunked_prefill_splits_the_images(checkpoint, expected):
    """A budget of 5 tokens a step: each image's tokens span chunks, whose M-RoPE positions are the image's grid
    part by part; the images are encoded once each, at their first chunk."""
    small = LLM(model=str(checkpoint[1]), **{**OPTIONS, "max_num_batched_tokens": 5, "enable_prefix_caching": False})
    try:
        out = small.generate({"prompt": TWO, "multi_modal_data": {"image": [WIDE, TALL]}}, GREEDY, use_tqdm=False)[0]
        assert out.error is None and out.token_ids == expected["two"]
        images = small.engine.runner.images
        assert images.encoded == 2 and images.hits >= 3
    finally:
        small.close()


def test_preempted_image_requests_recompute_their_positions(checkpoint, llm):
    """A pool of 16 blocks of 4 tokens for three image prompts of 20 new tokens: preemption by recompute computes
    their images' tokens (and positions) again, and the tokens equal the roomy engine's."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [
        {"prompt": f"q{i}: {IMAGE} describe", "multi_modal_data": {"image": png(40 + 30 * i, 30, seed=30 + i)}}
        for i in range(3)
    ]
    roomy = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    small = LLM(model=str(checkpoint[1]), **{**OPTIONS, "kv_cache_memory": 16 * 2048})
    try:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert [o.error for o in outs] == [None] * 3 and [o.token_ids for o in outs] == roomy
        assert small.engine.scheduler.num_preemptions > 0
    finally:
        small.close()


def test_second_turn_hits_the_encoder_and_prefix_caches(llm):
    engine = llm.engine
    image, other = png(64, 48, seed=4), png(64, 48, seed=5)
    first = f"User: {IMAGE} what is in the picture? Assistant:"
    turn1 = llm.generate({"prompt": first, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    encoded = engine.runner.images.encoded
    cached = engine.scheduler.block_manager.num_hit_tokens
    second = first + turn1.text + " User: and the colours? Assistant:"
    turn2 = llm.generate({"prompt": second, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert turn2.error is None and engine.runner.images.encoded == encoded  # not encoded again
    assert engine.scheduler.block_manager.num_hit_tokens - cached >= len(turn1.prompt_token_ids) - 4
    # the same text with another image of the same size (same token ids): its blocks never hit, it is encoded
    cached = engine.scheduler.block_manager.num_hit_tokens
    alone = llm.generate({"prompt": second, "multi_modal_data": {"image": other}}, GREEDY, use_tqdm=False)[0]
    assert alone.error is None and engine.runner.images.encoded == encoded + 1
    pad = llm.get_tokenizer().convert_tokens_to_ids(IMAGE_PAD)
    assert engine.scheduler.block_manager.num_hit_tokens - cached <= turn1.prompt_token_ids.index(pad)


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(checkpoint, expected):
    """Every next token of two images' prompt and fp32's greedy continuation (teacher-forced), under our bf16 engine
    (prompt logprobs with the top token) and transformers' bf16 forward, against transformers' fp32 forward: the
    log-probability of the actual next token drifts from fp32's at most 1.5x as far as transformers' bf16 does, at the
    largest, and the top token is fp32's at as many positions as transformers' bf16 finds it, less one (figures
    printed)."""
    name, path = checkpoint
    from transformers import AutoModelForImageTextToText

    inputs = transformers_inputs(path, TWO, [WIDE, TALL])
    prompt = inputs["input_ids"][0].tolist()
    ids = torch.tensor([prompt + expected["two"]])
    full = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    full["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, MAX_NEW))
    actual, top = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
        with torch.inference_mode():
            logits = model(**{**full, "pixel_values": inputs["pixel_values"].to(dtype)}).logits[0, :-1].float()
        actual[dtype] = logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        top[dtype] = logits.argmax(-1)
    bf16 = LLM(model=str(path), **{**OPTIONS, "dtype": "bfloat16"})
    try:
        scored = bf16.generate(
            {"prompt_token_ids": ids[0].tolist(), "multi_modal_data": {"image": [WIDE, TALL]}},
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
            use_tqdm=False,
        )[0]
        _assert_decodes_score_as_a_prefill(bf16)
    finally:
        bf16.close()
    rows = scored.prompt_logprobs[1:]
    ours_actual = torch.tensor([row[token] for row, token in zip(rows, ids[0, 1:].tolist(), strict=True)])
    ours_top = torch.tensor([max(row, key=row.__getitem__) for row in rows])
    reference = actual[torch.float32]
    ours, theirs = (ours_actual - reference).abs().max().item(), (actual[torch.bfloat16] - reference).abs().max().item()
    same_ours = int((ours_top == top[torch.float32]).sum())
    same_theirs = int((top[torch.bfloat16] == top[torch.float32]).sum())
    print(
        f"{name} bf16: next-token logprob drift from fp32 ours {ours:.3g}, transformers' {theirs:.3g}; top token as "
        f"fp32's at {same_ours}/{len(rows)} positions, transformers' bf16 at {same_theirs}/{len(rows)}"
    )
    assert ours <= 1.5 * theirs
    assert same_ours >= same_theirs - 1


def _assert_decodes_score_as_a_prefill(bf16: LLM) -> None:
    """bf16 decodes past two images (the CPU's native decode step, at the place plus the rope delta) give each token
    the log-probability a prefill of the same tokens gives it (the M-RoPE positions of its chunks) to 1e-3 (a wrong
    delta moves them by tenths). With AVX512-BF16 the prefill's attention takes its packed bf16 path (probabilities
    rounded to bf16, as transformers does), other arithmetic than a decode's: there to 0.05 (0.015 seen)."""
    images = {"image": [WIDE, TALL]}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    out = bf16.generate({"prompt": TWO, "multi_modal_data": images}, params, use_tqdm=False)[0]
    native = bf16.engine.runner.model.model.native_decode
    assert native and native.steps >= 9
    ids = out.prompt_token_ids + out.token_ids
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    rows = bf16.generate({"prompt_token_ids": ids, "multi_modal_data": images}, score, use_tqdm=False)[0]
    prefilled = rows.prompt_logprobs[len(out.prompt_token_ids) :]
    tolerance = 0.05 if cpu_kernels.gemv_paths() & cpu_kernels.GEMV_BF16_PAIRS else 1e-3
    for decoded, row, token in zip(out.logprobs, prefilled, out.token_ids, strict=True):
        assert abs(decoded[token] - row[token]) <= tolerance, (token, decoded[token], row[token])


@pytest.mark.parametrize(
    "images, prompt, message",
    [
        ([b"not an image at all"], f"x {IMAGE}", "image 0: not an image Pillow can read"),
        (["truncated"], f"x {IMAGE}", "image 0: cannot decode its pixels (PNG)"),
        (["bomb"], f"x {IMAGE}", "5000x5000 = 25000000 pixels exceeds the limit of 16777216 pixels per image"),
        ([b"\x89PNG" + b"\0" * (21 * 1024 * 1024)], f"x {IMAGE}", "exceeds the limit of 20971520 bytes per image"),
        ([12], f"x {IMAGE}", "image 0: expected encoded image bytes or a PIL.Image, got int"),
        (["ok"] * 5, "x" + f" {IMAGE}" * 5, "5 images exceed the limit of 4 per prompt (--limit-mm-per-prompt)"),
        (["ok", "ok"], f"x {IMAGE}", "do not match its 2 image(s): it holds 1 in 1 run(s)"),
        ([], f"x {IMAGE}", "the prompt holds image tokens"),
        (["thin"], f"x {IMAGE}", "image 0: 1x300 pixels: an aspect ratio past 200:1 is refused"),
    ],
)
def test_hostile_images_are_refused_by_name(llm, images, prompt, message):
    good = png(20, 20, seed=6)
    made = {"truncated": good[: len(good) // 2], "bomb": bomb(), "ok": good, "thin": png(1, 300, seed=7)}
    images = [made.get(i, i) if isinstance(i, str) else i for i in images]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "error" and message in out.error, out.error


def test_what_is_not_supported_is_refused_by_name(checkpoint, llm):
    """Videos (the engine takes images); step graphs are off. (Tensor parallelism: test_images_tensor_parallel.)"""
    from infer.worker.models.qwen2_vl import Qwen2VLForConditionalGeneration

    video = llm.generate({"prompt": "x", "multi_modal_data": {"video": [WIDE]}}, GREEDY, use_tqdm=False)[0]
    assert "modality 'video' is not supported; supported: image" in video.error
    pad = "<|vision_start|><|video_pad|><|vision_end|>"
    video = llm.generate({"prompt": f"x {pad}", "multi_modal_data": {"image": []}}, GREEDY, use_tqdm=False)[0]
    assert "the prompt holds video tokens" in video.error and "video inputs are not supported" in video.error
    assert not Qwen2VLForConditionalGeneration.supports_step_graphs
