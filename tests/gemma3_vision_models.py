"""A tiny random Gemma 3 with images (transformers' Gemma3ForConditionalGeneration): a SigLIP tower of 2 layers at 56x56
pixels in 7x7 patches (an 8x8 grid, average-pooled to 4x4: 16 image tokens), Gemma 3 text layers of tests/gemma_models.py
(local layers with a window of 8, shorter than an image, so the window and the image's two-way attention meet),
SmolLM2's vocabulary plus `<start_of_image>`, `<image_soft_token>` and `<end_of_image>` (the tokenizer's boi_token /
image_token / eoi_token), Gemma 3's chat template, and Gemma3Processor's files (Gemma3ImageProcessor at 56 pixels,
image_seq_length 16). Import as `from gemma3_vision_models import ...` (tests/ is on the path)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from gemma_models import GEMMA3

BOI, IMAGE_TOKEN, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
IMAGE_SIZE = 56
TOKENS_PER_IMAGE = 16

VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=7,
    layer_norm_eps=1e-6,
)

# Gemma 3's chat template (the images are content parts: it writes <start_of_image> for each)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    '{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}"
    "{{ raise_exception('Invalid content type') }}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gemma3_tokenizer(base_tokenizer: Any, scratch: Path) -> Any:
    """SmolLM2's tokenizer with Gemma 3's image tokens as named special tokens and Gemma 3's chat template."""
    from transformers import AutoTokenizer

    copy.deepcopy(base_tokenizer).save_pretrained(scratch)
    named = {"boi_token": BOI, "image_token": IMAGE_TOKEN, "eoi_token": EOI}
    tokenizer = AutoTokenizer.from_pretrained(str(scratch), extra_special_tokens=named)
    tokenizer.add_special_tokens({"extra_special_tokens": [BOI, IMAGE_TOKEN, EOI]}, replace_extra_special_tokens=False)
    tokenizer.chat_template = GEMMA3_TEMPLATE
    return tokenizer


def gemma3_vision_checkpoint(
    path: Path, base_tokenizer: Any, seed: int = 11, vocab_multiple: int = 1, **text_overrides: Any
) -> Path:
    """The checkpoint in `path` (created), with Gemma3Processor's files; returns it. `vocab_multiple`: the
    embedding's rows rounded up to a multiple of it (tensor parallelism splits the vocabulary)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.siglip import SiglipVisionConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = gemma3_tokenizer(base_tokenizer, path / "tokenizer-scratch")
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (("boi", BOI), ("image", IMAGE_TOKEN), ("eoi", EOI))
    }
    text = Gemma3TextConfig(
        vocab_size=-(-len(tokenizer) // vocab_multiple) * vocab_multiple,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        **{**GEMMA3, **text_overrides},
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=SiglipVisionConfig(**VISION),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids["boi"],
        eoi_token_index=ids["eoi"],
        image_token_index=ids["image"],
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if "language_model" in name or "mm_soft" in name else 1.0, 0.3)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer,
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def transformers_gemma3_greedy(path: Path, ids: list[int], pixels: torch.Tensor | None, max_new: int) -> list[int]:
    """transformers' greedy tokens for a prompt of expanded image tokens and its pixels [N, 3, H, W] (fp32), with the
    processor's token_type_ids (1 at the image tokens: the mask that makes each image two-way)."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    image_id = AutoConfig.from_pretrained(path).image_token_id
    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    extra = {} if pixels is None else {"pixel_values": pixels, "token_type_ids": (x == image_id).long()}
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
