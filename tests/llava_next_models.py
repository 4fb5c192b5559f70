"""A tiny random LLaVA-NeXT checkpoint: tests/llava_models.py's CLIP tower (3 layers at 28x28 pixels in 7x7 patches:
tiles of 4x4 = 16 features, feature layer -2, the "default" strategy) and 2-layer Llama of SmolLM2's vocabulary plus
`<image>`, with grid resolutions of 1x2, 2x1 and 2x2 tiles (PINPOINTS), so an image takes 16 + up to 8 x 9 tokens;
saved with transformers, its preprocessor_config.json that of LlavaNextImageProcessor at 28 pixels. And transformers'
inputs (LlavaNextProcessor) and greedy tokens for a prompt with images. Import as `from llava_next_models import ...`
(tests/ is on the path)."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import torch
from llava_models import IMAGE_SIZE, IMAGE_TOKEN, TEXT, VISION
from tiny_models import save_redrawn

PATCH = 7
PINPOINTS = [[28, 56], [56, 28], [56, 56]]  # (height, width) in pixels


def llava_next_checkpoint(path: Path, base_tokenizer: Any, seed: int = 11, vocab_multiple: int = 1) -> Path:
    """The checkpoint in `path` (created); returns it. `vocab_multiple`: the embedding's rows rounded up to a multiple
    of it (tensor parallelism splits the vocabulary)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text = LlamaConfig(
        vocab_size=-(-len(tokenizer) // vocab_multiple) * vocab_multiple,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        **TEXT,
    )
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_grid_pinpoints=PINPOINTS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).to(torch.float32)
    save_redrawn(model, path, tokenizer)
    image_processor().save_pretrained(path)
    return Path(path)


def image_processor() -> Any:
    """transformers' LlavaNextImageProcessor (the PIL backend, which ours follows) at the checkpoint's sizes."""
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=PINPOINTS,
    )


def transformers_inputs(path: Path, text: str, images: list[bytes]) -> Any:
    """LlavaNextProcessor's input_ids (each `<image>` expanded), pixel_values and image_sizes for the prompt."""
    from PIL import Image
    from transformers import AutoTokenizer, LlavaNextProcessor

    processor = LlavaNextProcessor(
        image_processor=image_processor(),
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token
    )
    return processor(text=text, images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")


def transformers_greedy(path: Path, text: str, images: list[bytes], max_new: int) -> tuple[list[int], list[int]]:
    """(the prompt's ids as LlavaNextProcessor expands them, transformers' fp32 greedy tokens after it)."""
    from transformers import LlavaNextForConditionalGeneration

    inputs = transformers_inputs(path, text, images)
    model = LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids) :].tolist()
