"""Idefics3 and SmolVLM (transformers' Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration) against
transformers on tiny random checkpoints (tests/idefics3_models.py): our preprocessing equals Idefics3ImageProcessor's
(PIL backend: the Lanczos resizes, the tiles, the global image); prompts expand as Idefics3Processor's do (text, token
ids with one `<image>` per image, already expanded ids); greedy fp32 tokens equal transformers' `generate` for one
image (2x2 tiles and the global one), two images, a wide image (1x2 tiles), a text-only prompt, all in one batch;
for prefill chunks that end inside a tile; under preemption by recompute; a second turn encodes no tile again and hits
the prefix cache, another image never hits; fp32 logits within 1e-4 of transformers' and bf16 as close to fp32 as
transformers' bf16; hostile input is refused by name. (Tensor parallelism: tests/worker/test_images_tensor_parallel.py;
speculative decoding: tests/worker/test_images_speculative.py; kill -9: tests/cluster/test_images_cluster.py.)"""

from __future__ import annotations

import io
import json

import pytest
import torch
from idefics3_models import (
    FAKE,
    IMAGE_TOKEN,
    LONGEST_EDGE,
    TILE,
    TOKENS_PER_TILE,
    idefics3_checkpoint,
    transformers_idefics3_greedy,
)
from llava_models import png

from infer import LLM, SamplingParams
from infer.worker.engine.images import to_rgb
from infer.worker.engine.vision import Idefics3Preprocessor

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1, block_size=4)
ONE = f"Describe {IMAGE_TOKEN} now."
TWO = f"Compare {IMAGE_TOKEN} with{IMAGE_TOKEN}: which?"


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def checkpoint(request, tmp_path_factory, smollm2_tokenizer):
    return idefics3_checkpoint(tmp_path_factory.mktemp(request.param), smollm2_tokenizer, request.param)


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import Idefics3Processor

    return Idefics3Processor.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(model=str(checkpoint), **OPTIONS)
    yield engine
    engine.close()


def _pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


def _processed(processor, text: str, *images: bytes) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Idefics3Processor's ids, pixel_values and pixel_attention_mask for a text prompt."""
    out = processor(text=text, images=[_pil(i) for i in images] or None, return_tensors="pt")
    return out["input_ids"][0].tolist(), out.get("pixel_values"), out.get("pixel_attention_mask")


def test_preprocessing_equals_idefics3_image_processor(tmp_path):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    for longest, split in ((LONGEST_EDGE, True), (3 * TILE, True), (LONGEST_EDGE, False)):
        reference = Idefics3ImageProcessorPil(
            size={"longest_edge": longest}, max_image_size={"longest_edge": TILE}, do_image_splitting=split
        )
        ours = Idefics3Preprocessor(TILE, longest, split)
        for width, height, mode in (
            (40, 30, "RGB"),
            (150, 259, "RGBA"),
            (30, 30, "L"),
            (64, 13, "RGB"),
            (17, 95, "RGB"),
        ):
            image = _pil(png(width, height, seed=width, mode=mode))
            expected = reference(image, return_tensors="pt", return_row_col_info=True)
            got = ours(to_rgb(image))
            assert (got.rows, got.cols) == (expected["rows"][0][0], expected["cols"][0][0])
            assert got.tiles.shape == expected["pixel_values"][0].shape
            torch.testing.assert_close(got.tiles, expected["pixel_values"][0], atol=1e-5, rtol=0)
    config = tmp_path / "preprocessor_config.json"
    config.write_text(json.dumps({"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 48}}))
    with pytest.raises(ValueError, match="max_image_size 48 differs from the vision tower's image_size 32"):
        Idefics3Preprocessor.for_model(tmp_path, TILE)
    config.write_text(json.dumps({"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}}))
    assert Idefics3Preprocessor.for_model(tmp_path, TILE) == Idefics3Preprocessor(TILE, 96)


def test_prompts_expand_as_idefics3_processor(llm, processor):
    """A text prompt (expanded as text: exactly the processor's ids), token ids with one `<image>` per image (expanded
    in ids), already expanded ids; each tile's run of image tokens is placed as an image of its own."""
    tokenizer = llm.get_tokenizer()
    engine = llm.engine
    image, wide = png(40, 30, seed=9), png(64, 13, seed=10)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for text, images in ((ONE, [image]), (TWO, [image, wide]), (f"Q:\n{IMAGE_TOKEN}\nok", [wide])):
        want, _, _ = _processed(processor, text, *images)
        request, _ = engine.intake.request("r", text, GREEDY, (), 0, images, 0)
        assert request.prompt_token_ids == want
        starts = [k for k, t in enumerate(want) if t == image_id and (k == 0 or want[k - 1] != image_id)]
        assert [(i.offset, i.length) for i in request.images] == [(k, TOKENS_PER_TILE) for k in starts]
        placed, _ = engine.intake.request("r", want, GREEDY, (), 0, images, 0)
        assert placed.prompt_token_ids == want  # already expanded: as it is
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert engine.intake.request("r", ids, GREEDY, (), 0, images, 0)[0].prompt_token_ids == want


def test_greedy_equals_transformers(checkpoint, llm, processor):
    """One image (2x2 tiles and the global one), two images, a thin image (1x2 tiles), a text-only prompt, all in one
    batch."""
    red, blue, thin = png(40, 30, seed=1), png(30, 64, seed=2), png(64, 13, seed=3)
    one = _processed(processor, ONE, red)
    two = _processed(processor, TWO, red, blue)
    wide = _processed(processor, ONE, thin)
    text_only = llm.get_tokenizer()("A plain question: why?", add_special_tokens=False)["input_ids"]
    want = [transformers_idefics3_greedy(checkpoint, *p, MAX_NEW) for p in (one, two, wide)]
    want_text = transformers_idefics3_greedy(checkpoint, text_only, None, None, MAX_NEW)
    outs = llm.generate(
        [
            {"prompt": ONE, "multi_modal_data": {"image": red}},
            text_only,
            {"prompt": TWO, "multi_modal_data": {"image": [red, blue]}},
            {"prompt_token_ids": wide[0], "multi_modal_data": {"image": [thin]}},
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.error for o in outs] == [None] * 4
    assert outs[0].prompt_token_ids == one[0] and outs[2].prompt_token_ids == two[0]
    assert [o.token_ids for o in outs] == [want[0], want_text, want[1], want[2]]
    assert len(set(map(tuple, want))) > 1  # the images matter


def test_second_turn_hits_the_encoder_and_prefix_caches(llm):
    engine = llm.engine
    image, other = png(64, 48, seed=5), png(64, 48, seed=6)
    first = f"Look:{IMAGE_TOKEN} What is in the picture?"
    turn1 = llm.generate({"prompt": first, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert turn1.error is None
    encoded = engine.runner.images.encoded
    cached = engine.scheduler.block_manager.num_hit_tokens
    second = first + turn1.text + " And the colours?"
    turn2 = llm.generate({"prompt": second, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert turn2.error is None
    assert engine.runner.images.encoded == encoded  # no tile encoded again
    assert engine.scheduler.block_manager.num_hit_tokens - cached >= len(turn1.prompt_token_ids) - 4
    cached = engine.scheduler.block_manager.num_hit_tokens
    alone = llm.generate({"prompt": second, "multi_modal_data": {"image": other}}, GREEDY, use_tqdm=False)[0]
    assert alone.error is None and engine.runner.images.encoded == encoded + 5  # 2x2 tiles and the global one
    image_start = turn1.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids(FAKE))
    assert engine.scheduler.block_manager.num_hit_tokens - cached <= image_start + 2  # another image never hits


def test_chunked_prefill_splits_tiles_and_keeps_the_tokens(checkpoint, processor):
    """A budget of 6 tokens a step: chunks end inside tiles (the text model is causal over images: a chunk takes the
    part of a tile's features it covers) and the tokens equal transformers'."""
    red, blue = png(50, 50, seed=3), png(33, 40, seed=4)
    small = LLM(model=str(checkpoint), **{**OPTIONS, "max_num_batched_tokens": 6, "enable_prefix_caching": False})
    try:
        engine = small.engine
        ids, pixels, mask = _processed(processor, TWO, red, blue)
        chunks: list[tuple[int, int]] = []
        schedule = engine.scheduler.schedule

        def recording(*args, **kwargs):
            out = schedule(*args, **kwargs)
            chunks.extend((c.start, c.end) for c in out.chunks if not c.is_decode)
            return out

        engine.scheduler.schedule = recording
        out = small.generate({"prompt": TWO, "multi_modal_data": {"image": [red, blue]}}, GREEDY, use_tqdm=False)[0]
        assert out.error is None and out.token_ids == transformers_idefics3_greedy(
            checkpoint, ids, pixels, mask, MAX_NEW
        )
        image_id = small.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN)
        image_rows = {k for k, t in enumerate(ids) if t == image_id}
        assert any(s in image_rows and s - 1 in image_rows for s, _ in chunks)  # a chunk starts inside a tile
    finally:
        small.close()


def test_preempted_image_requests_recompute_their_tiles(checkpoint, llm):
    """A pool of 20 blocks of 4 tokens for three image prompts of ~40 tokens and 24 new tokens each: preemption by
    recompute places their tiles again (from the encoder cache) and the tokens equal the roomy engine's."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [
        {"prompt": f"q{i}:{IMAGE_TOKEN} describe it", "multi_modal_data": {"image": png(20 + i, 20, seed=30 + i)}}
        for i in range(3)
    ]
    roomy = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    bytes_per_block = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 KV heads, head_dim 16, fp32
    small = LLM(model=str(checkpoint), **{**OPTIONS, "kv_cache_memory": 20 * bytes_per_block})
    try:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert [o.error for o in outs] == [None] * 3 and [o.token_ids for o in outs] == roomy
        assert small.engine.scheduler.num_preemptions > 0
    finally:
        small.close()


@pytest.mark.parametrize(
    "images, prompt, message",
    [
        ([b"not an image at all"], ONE, "image 0: not an image Pillow can read"),
        (["ok", "ok"], ONE, f"the prompt holds 1 {IMAGE_TOKEN} token(s) for its 2 image(s): give one per image"),
        ([], f"x {IMAGE_TOKEN}", "the prompt holds image tokens"),
        (["ok"] * 5, "x" + IMAGE_TOKEN * 5, "5 images exceed the limit of 4 per prompt (--limit-mm-per-prompt)"),
    ],
)
def test_hostile_input_is_refused_by_name(llm, images, prompt, message):
    good = png(20, 20, seed=6)
    images = [good if i == "ok" else i for i in images]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "error" and message in out.error, out.error


def test_token_ids_that_fit_no_form_are_refused(llm):
    tokenizer = llm.get_tokenizer()
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    image = png(20, 20, seed=7)
    short = [5, 6, image_id, image_id, 7]  # a run of 2 image tokens for an image of 3 tiles of 4
    out = llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "error" and "it holds 2 in 1 run(s)" in out.error, out.error


def test_logits_equal_transformers_and_bf16_is_as_close_as_its_bf16(checkpoint, processor):
    """The logits of a two-image prompt and its fp32 greedy continuation, position by position, one paged forward:
    fp32 within 1e-4 of transformers'; bf16 drifts from transformers' fp32 no more than 1.5x transformers' own bf16
    does (the largest error per position relative to the largest fp32 logit, the maximum over positions), and picks
    fp32's next token at 80% of the positions or more."""
    from transformers import AutoModelForImageTextToText

    ids, pixels, mask = _processed(processor, TWO, png(40, 30, seed=1), png(30, 64, seed=2))
    ids = ids + transformers_idefics3_greedy(checkpoint, ids, pixels, mask, 12)
    x = torch.tensor([ids])
    with torch.inference_mode():
        theirs = {}
        for dtype in (torch.float32, torch.bfloat16):
            hf = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=dtype).eval()
            theirs[dtype] = hf(x, pixel_values=pixels.to(dtype), pixel_attention_mask=mask).logits[0].float()
    reference = theirs[torch.float32]
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert (_our_logits(checkpoint, ids, pixels[0], image_id, torch.float32) - reference).abs().max() <= 1e-4

    def drift(values: torch.Tensor) -> float:
        return ((values - reference).abs().amax(-1) / reference.abs().max()).max().item()

    ours = _our_logits(checkpoint, ids, pixels[0], image_id, torch.bfloat16)
    same = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    bound = 1.5 * drift(theirs[torch.bfloat16])
    print(f"idefics3 bf16 (max): ours {drift(ours):.3g}, bound {bound:.3g}; {same:.0%} of fp32's next tokens")
    assert drift(ours) <= bound
    assert same >= 0.8


def _our_logits(path, ids: list[int], tiles: torch.Tensor, image_id: int, dtype: torch.dtype) -> torch.Tensor:
    """Our logits [len(ids), vocab] of one prefill of `ids` over a paged pool, each tile's features at its image
    tokens' rows (the tiles in the prompt's order), as the model runner gives them."""
    from dataclasses import replace

    from model_batches import Pager, new_cache

    from infer.worker.loading.loader import load_model

    model = load_model(path, dtype, torch.device("cpu"))
    rows = torch.nonzero(torch.tensor(ids) == image_id).flatten()
    batch = replace(
        Pager(num_blocks=64, block_size=4).batch([("s", ids, 0, len(ids))]),
        image_rows=rows,
        image_embeds=torch.cat([model.encode_image(tile) for tile in tiles]),
    )
    with torch.inference_mode():
        return model.compute_logits(model(batch, new_cache(model, 64, 4)))
