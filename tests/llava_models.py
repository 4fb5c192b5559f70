"""A tiny random LLaVA-1.5 checkpoint (CLIP tower of 3 layers at 28x28 pixels in 7x7 patches: 16 image tokens, feature
layer -2, the "default" strategy; a 2-layer Llama of SmolLM2's vocabulary plus an `<image>` token), saved with
transformers, its preprocessor_config.json that of CLIPImageProcessor at 28 pixels; and test images as PNG bytes.
Import as `from llava_models import ...` (tests/ is on the path)."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import torch
from tiny_models import save_redrawn

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 28
TOKENS_PER_IMAGE = 16

VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=7,
    projection_dim=32,
)
TEXT: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def llava_checkpoint(path: Path, base_tokenizer: Any, seed: int = 5, vocab_multiple: int = 1) -> Path:
    """The checkpoint in `path` (created); returns it. `vocab_multiple`: the embedding's rows rounded up to a multiple
    of it (tensor parallelism splits the vocabulary; the rows past the tokenizer's are never a prompt's)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(
        vocab_size=-(-len(tokenizer) // vocab_multiple) * vocab_multiple,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        **TEXT,
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=TOKENS_PER_IMAGE,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    save_redrawn(model, path, tokenizer)
    CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(path)
    return Path(path)


def bomb() -> bytes:
    """A PNG that declares 5000 x 5000 pixels (of one colour: a few KB compressed): a decompression bomb."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (5000, 5000)).save(out, format="PNG")
    return out.getvalue()


def png(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    """A random image of that size as PNG bytes."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = torch.randint(0, 256, (height, width, channels), generator=g, dtype=torch.uint8).numpy()
    image = Image.fromarray(pixels[:, :, 0] if mode == "L" else pixels, mode)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def transformers_llava_greedy(path: Path, ids: list[int], pixels: torch.Tensor, max_new: int) -> list[int]:
    """transformers' greedy tokens for a prompt of expanded image tokens and its pixels [N, 3, H, W] (fp32)."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = model.generate(
            x,
            pixel_values=pixels,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=0,
        )
    return y[0, len(ids) :].tolist()
