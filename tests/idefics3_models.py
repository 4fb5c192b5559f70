"""A tiny random Idefics3 (transformers' Idefics3ForConditionalGeneration) and SmolVLM (SmolVLMForConditionalGeneration)
checkpoint: a SigLIP tower of 2 layers at 32x32 pixels in 8x8 patches (a 4x4 grid, pixel-shuffled by 2: 4 image tokens
a tile), a 2-layer Llama of SmolLM2's vocabulary plus Idefics3's prompt tokens (`<fake_token_around_image>`, `<image>`,
`<end_of_utterance>`, `<global-img>`, `<row_r_col_c>` up to 6x6), and Idefics3Processor's files
(Idefics3ImageProcessor with tiles of 32 pixels, the longest edge resized to 64: every image is 2 or 4 tiles and the
global one). Import as `from idefics3_models import ...` (tests/ is on the path)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from llava_models import TEXT

IMAGE_TOKEN, FAKE, GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"
TILE = 32
LONGEST_EDGE = 64
TOKENS_PER_TILE = 4

VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=TILE,
    patch_size=8,
    layer_norm_eps=1e-6,
)


def idefics3_tokenizer(base_tokenizer: Any) -> Any:
    """SmolLM2's tokenizer with Idefics3's prompt tokens as special tokens."""
    tokenizer = copy.deepcopy(base_tokenizer)
    rows_cols = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [FAKE, IMAGE_TOKEN, "<end_of_utterance>", GLOBAL, *rows_cols]}
    )
    return tokenizer


def idefics3_checkpoint(
    path: Path, base_tokenizer: Any, family: str = "idefics3", seed: int = 13, vocab_multiple: int = 1
) -> Path:
    """The checkpoint of `family` ("idefics3" or "smolvlm") in `path` (created), with Idefics3Processor's files;
    returns it. `vocab_multiple`: the embedding's rows rounded up to a multiple of it (tensor parallelism splits the
    vocabulary)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = idefics3_tokenizer(base_tokenizer)
    text = LlamaConfig(
        vocab_size=-(-len(tokenizer) // vocab_multiple) * vocab_multiple,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        **TEXT,
    )
    config_class, model_class = {
        "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration),
        "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration),
    }[family]
    config = config_class(
        text_config=text.to_dict(),
        vision_config=dict(VISION),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}
        ),
        tokenizer=tokenizer,
        image_seq_len=TOKENS_PER_TILE,
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def transformers_idefics3_greedy(
    path: Path, ids: list[int], pixels: torch.Tensor | None, mask: torch.Tensor | None, max_new: int
) -> list[int]:
    """transformers' greedy tokens (fp32) for a prompt of expanded image tokens and the processor's pixel_values
    [1, tiles, 3, H, W] (and pixel_attention_mask)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    extra = {} if pixels is None else {"pixel_values": pixels, "pixel_attention_mask": mask}
    with torch.inference_mode():
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=0,
            **extra,
        )
    return y[0, len(ids) :].tolist()
