"""LLaVA-NeXT against transformers on a tiny random checkpoint (tests/llava_next_models.py): the any-resolution
arithmetic (best grid resolution, token count) equals transformers' at LLaVA-1.6's own pinpoints and the checkpoint's;
our preprocessing equals LlavaNextImageProcessor's (PIL backend) pixel values, an image too thin for any grid included;
greedy fp32 tokens equal transformers' `generate` through `LLM.generate` for one image, for two images whose sizes pick
different grids, and for a second turn that adds an image (the first turn from the prefix cache), then that image
after other text (from the encoder cache), each prompt's `<image>` expanded as LlavaNextProcessor expands it; every
checkpoint layout loads; bad images, a preprocessor_config.json we do not compute, the "full" feature strategy and
pinpoints off the tile size are refused by name."""

from __future__ import annotations

import io

import pytest
import torch
from llava_models import IMAGE_TOKEN, png
from llava_next_models import PINPOINTS, llava_next_checkpoint, transformers_greedy

from infer import LLM, SamplingParams
from infer.worker.engine.anyres import AnyresLayout
from infer.worker.engine.images import to_rgb
from infer.worker.engine.vision import LlavaNextPreprocessor

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=320, kv_cache_memory=8_000_000, num_threads=1, block_size=4)
LAYOUT = AnyresLayout.of(28, 4, PINPOINTS)
# LLaVA-1.6's grid resolutions, tiles of 336 pixels of 24 x 24 features
LLAVA_16 = AnyresLayout.of(336, 24, [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])
SQUARE, WIDE, TALL = png(40, 30, seed=1), png(60, 24, seed=2), png(20, 60, seed=3)  # 2x2, 1x2 and 2x1 tiles
ONE = f"USER: {IMAGE_TOKEN}\nWhat is this? ASSISTANT:"
TWO = f"USER: {IMAGE_TOKEN} and {IMAGE_TOKEN}: which? ASSISTANT:"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer):
    return llava_next_checkpoint(tmp_path_factory.mktemp("llava-next"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(model=str(checkpoint), **OPTIONS)
    yield engine
    engine.close()


def _image(data: bytes) -> object:
    from PIL import Image

    return Image.open(io.BytesIO(data))


def test_layout_equals_transformers_arithmetic(checkpoint):
    """The grid resolution and the token count of images of many sizes, at LLaVA-1.6's pinpoints and the tiny
    checkpoint's, equal transformers' select_best_resolution and LlavaNextProcessor's count."""
    from transformers import AutoTokenizer, LlavaNextProcessor
    from transformers.image_processing_utils import select_best_resolution as theirs
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    sizes = [(h, w) for h in (1, 7, 30, 97, 336, 500, 700, 1333) for w in (3, 24, 60, 336, 480, 1000, 2048)]
    for layout, patch in ((LLAVA_16, 14), (LAYOUT, 7)):
        pinpoints = [list(p) for p in layout.pinpoints]
        tile = {"height": layout.tile, "width": layout.tile}
        images = LlavaNextImageProcessorPil(
            size={"shortest_edge": layout.tile}, crop_size=tile, image_grid_pinpoints=pinpoints
        )
        processor = LlavaNextProcessor(
            images, tokenizer, patch_size=patch, vision_feature_select_strategy="default", num_additional_image_tokens=1
        )
        assert [layout.best_resolution(h, w) for h, w in sizes] == [theirs((h, w), pinpoints) for h, w in sizes]
        counts = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
        assert [layout.token_count(h, w) for h, w in sizes] == counts
    assert {LAYOUT.grid(h, w) for h, w in ((30, 40), (24, 60), (60, 20))} == {(2, 2), (1, 2), (2, 1)}
    assert LAYOUT.token_count(300, 1) == 16 + 4  # too thin to keep a column: the newlines alone


@pytest.mark.parametrize(
    "width, height, mode, layout",
    [
        (40, 30, "RGB", LAYOUT),  # scaled up into 2x2 tiles, padded above and below
        (60, 24, "RGBA", LAYOUT),  # 1x2
        (20, 60, "L", LAYOUT),  # 2x1, padded left and right
        (56, 56, "RGB", LAYOUT),  # exactly the grid: no resize, no padding
        (13, 97, "RGB", LAYOUT),
        (1, 300, "RGB", LAYOUT),  # too thin to keep a pixel in any resolution: resized to 1 pixel wide
        (500, 333, "RGB", LLAVA_16),  # LLaVA-1.6's 336-pixel tiles: scaled down into 1x2
    ],
)
def test_preprocessing_equals_llava_next_image_processor(width, height, mode, layout):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    image = _image(png(width, height, seed=width, mode=mode))
    tile = {"height": layout.tile, "width": layout.tile}
    pinpoints = [list(p) for p in layout.pinpoints]
    reference = LlavaNextImageProcessorPil(
        size={"shortest_edge": layout.tile}, crop_size=tile, image_grid_pinpoints=pinpoints
    )(image, return_tensors="pt")
    got = LlavaNextPreprocessor(layout)(to_rgb(image))
    assert reference["image_sizes"].tolist() == [[got.height, got.width]] == [[height, width]]
    rows, cols = layout.grid(height, width)
    assert got.tiles.shape == reference["pixel_values"][0].shape == (1 + rows * cols, 3, layout.tile, layout.tile)
    torch.testing.assert_close(got.tiles, reference["pixel_values"][0], atol=1e-5, rtol=0)


def test_preprocessor_config_is_read_and_what_it_cannot_compute_refused(checkpoint, tmp_path):
    import json

    raw = json.loads((checkpoint / "preprocessor_config.json").read_text())
    assert LlavaNextPreprocessor.for_model(checkpoint, LAYOUT) == LlavaNextPreprocessor(LAYOUT)
    for change, error, message in (
        ({"image_mean": [0.5, 0.5, 0.5]}, None, None),
        ({"image_grid_pinpoints": [[28, 56]]}, ValueError, r"image_grid_pinpoints \[\[28, 56\]\] differ"),
        ({"crop_size": {"height": 30, "width": 28}}, NotImplementedError, "crop_size.height 30 is not supported"),
        ({"size": {"shortest_edge": 56}}, NotImplementedError, "size.shortest_edge 56 is not supported"),
        ({"resample": 2}, NotImplementedError, "resample=2 is not supported"),
        ({"do_normalize": False}, NotImplementedError, "do_normalize=false is not supported"),
    ):
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**raw, **change}))
        if error is None:
            assert LlavaNextPreprocessor.for_model(tmp_path, LAYOUT).mean == (0.5, 0.5, 0.5)
            continue
        with pytest.raises(error, match=message):
            LlavaNextPreprocessor.for_model(tmp_path, LAYOUT)


def test_greedy_equals_transformers(checkpoint, llm):
    """One image (2x2 tiles), and two whose sizes pick a 1x2 and a 2x1 grid; the first again as the processor's
    expanded ids."""
    one_ids, want_one = transformers_greedy(checkpoint, ONE, [SQUARE], MAX_NEW)
    two_ids, want_two = transformers_greedy(checkpoint, TWO, [WIDE, TALL], MAX_NEW)
    image_id = llm.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN)
    assert one_ids.count(image_id) == LAYOUT.token_count(30, 40) == 70
    assert two_ids.count(image_id) == LAYOUT.token_count(24, 60) + LAYOUT.token_count(60, 20) == 52 + 40
    outs = llm.generate(
        [
            {"prompt": ONE, "multi_modal_data": {"image": SQUARE}},
            {"prompt": TWO, "multi_modal_data": {"image": [WIDE, TALL]}},
            {"prompt_token_ids": one_ids, "multi_modal_data": {"image": [SQUARE]}},
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.error for o in outs] == [None] * 3
    assert [o.prompt_token_ids for o in outs] == [one_ids, two_ids, one_ids]
    assert [o.token_ids for o in outs] == [want_one, want_two, want_one]


def test_a_later_turn_s_image_and_the_caches(checkpoint, llm):
    """Turn 2 repeats turn 1 (its image) and adds another image: the first turn's tokens come from the prefix cache,
    the new image is encoded; a third prompt, other text before that image, takes its features from the encoder cache
    (its tokens are computed anew). The tokens equal transformers' each time."""
    engine, images = llm.engine, llm.engine.runner.images
    turn1 = llm.generate({"prompt": ONE, "multi_modal_data": {"image": SQUARE}}, GREEDY, use_tqdm=False)[0]
    encoded, hits = images.encoded, images.hits
    cached = engine.scheduler.block_manager.num_hit_tokens
    second = f"{ONE}{turn1.text} USER: {IMAGE_TOKEN}\nAnd this one? ASSISTANT:"
    later = png(50, 22, seed=4)  # an image no other test sends
    ids, want = transformers_greedy(checkpoint, second, [SQUARE, later], MAX_NEW)
    turn2 = llm.generate({"prompt": second, "multi_modal_data": {"image": [SQUARE, later]}}, GREEDY, use_tqdm=False)[0]
    assert turn2.error is None and turn2.prompt_token_ids == ids and turn2.token_ids == want
    assert images.encoded == encoded + 1  # the later image only
    assert engine.scheduler.block_manager.num_hit_tokens - cached >= len(turn1.prompt_token_ids) - 4
    third = f"Again: {IMAGE_TOKEN} what now?"
    ids, want = transformers_greedy(checkpoint, third, [later], MAX_NEW)
    out = llm.generate({"prompt": third, "multi_modal_data": {"image": later}}, GREEDY, use_tqdm=False)[0]
    assert out.error is None and out.prompt_token_ids == ids and out.token_ids == want
    assert images.encoded == encoded + 1 and images.hits == hits + 1


@pytest.mark.parametrize(
    "images, prompt, message",
    [
        ([b"not an image at all"], f"x {IMAGE_TOKEN}", "image 0: not an image Pillow can read"),
        (["ok", "ok"], f"x {IMAGE_TOKEN}", "do not match its 2 image(s): it holds 1 in 1 run(s)"),
        (["wide"], "expanded", "do not match its 1 image(s): it holds 70 in 1 run(s)"),  # the square's 70 tokens
    ],
)
def test_bad_images_are_refused_by_name(llm, images, prompt, message):
    made = {"ok": SQUARE, "wide": WIDE}
    images = [made.get(i, i) if isinstance(i, str) else i for i in images]
    if prompt == "expanded":
        image_id = llm.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN)
        request = {"prompt_token_ids": [1, *[image_id] * 70, 2], "multi_modal_data": {"image": images}}
    else:
        request = {"prompt": prompt, "multi_modal_data": {"image": images}}
    out = llm.generate(request, GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "error" and message in out.error, out.error


def test_checkpoint_layouts_and_refusals(checkpoint, tmp_path):
    """transformers 5's module names (`model.image_newline`, `model.language_model.*`, ...) load the same weights as
    what it saves; the "full" feature strategy and pinpoints that are no multiple of the tile are refused by name."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from infer.worker.loading.loader import build_model, load_model
    from infer.worker.models.llava_next import LlavaNextForConditionalGeneration

    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    renames = (
        ("image_newline", "model.image_newline"),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    tensors = load_file(checkpoint / "model.safetensors")
    assert "image_newline" in tensors  # what transformers saves
    moved = {next((new + k[len(old) :] for old, new in renames if k.startswith(old)), k): v for k, v in tensors.items()}
    save_file(moved, other / "model.safetensors")
    cpu = torch.device("cpu")
    saved, loaded = load_model(checkpoint, torch.float32, cpu), load_model(other, torch.float32, cpu)
    assert type(saved) is LlavaNextForConditionalGeneration
    assert torch.equal(saved.image_newline, tensors["image_newline"])
    for (name, a), (_, b) in zip(saved.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    config = AutoConfig.from_pretrained(str(checkpoint))
    config.vision_feature_select_strategy = "full"
    with pytest.raises(NotImplementedError, match="vision_feature_select_strategy 'full' is not supported"):
        build_model(config, torch.float32, "meta")
    config.vision_feature_select_strategy = "default"
    config.image_grid_pinpoints = [[28, 42]]
    with pytest.raises(ValueError, match=r"multiple of the vision tower's image_size 28, got \(28, 42\)"):
        build_model(config, torch.float32, "meta")
