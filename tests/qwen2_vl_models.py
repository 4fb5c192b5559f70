"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints (a vision tower of 2-3 blocks over 14x14 patches merged 2x2, 4 to
16 image tokens an image by the preprocessor's min_pixels / max_pixels; a 2-layer Qwen2 text model of SmolLM2's
vocabulary plus Qwen's vision tokens, M-RoPE sections [2, 3, 3]), saved with transformers with the preprocessor_config
of Qwen2VLImageProcessor, and transformers' greedy tokens for them. Import as `from qwen2_vl_models import ...`
(tests/ is on the path)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from tiny_models import save_redrawn

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
IMAGE = VISION_START + IMAGE_PAD + VISION_END  # one image in a prompt, as Qwen2-VL's chat template writes it
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16

TEXT: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
    # windows of 56 pixels: 2x2 merged tokens each; block 1 attends over the whole image
    "qwen2_5_vl": dict(
        depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, window_size=56,
        fullatt_block_indexes=[1],
    ),
}  # fmt: skip


def qwen2_vl_checkpoint(
    path: Path, base_tokenizer: Any, model_type: str = "qwen2_vl", seed: int = 7, vocab_multiple: int = 1
) -> Path:
    """The checkpoint of `model_type` ("qwen2_vl" or "qwen2_5_vl") in `path` (created); returns it. `vocab_multiple`:
    the embedding's rows rounded up to a multiple of it (tensor parallelism splits the vocabulary)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)}
    config_class, model_class = {
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    }[model_type]
    text = dict(
        TEXT,
        vocab_size=-(-len(tokenizer) // vocab_multiple) * vocab_multiple,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = config_class(
        text_config=text,
        vision_config=dict(VISION[model_type], patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    save_redrawn(model, path, tokenizer, ones=("norm", "ln_q"))
    image_processor(MIN_PIXELS, MAX_PIXELS).save_pretrained(path)
    assert isinstance(image_processor(1, 1), Qwen2VLImageProcessorPil)
    return Path(path)


def image_processor(min_pixels: int, max_pixels: int) -> Any:
    """transformers' Qwen2VLImageProcessor (its PIL backend) at these bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def transformers_inputs(path: Path, text: str, images: list[bytes]) -> dict[str, torch.Tensor]:
    """What transformers' Qwen2VLProcessor makes of a prompt and its images (PNG bytes): input_ids with each image's
    pad token expanded, pixel_values, image_grid_thw, mm_token_type_ids."""
    import io

    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLProcessor

    class ImagesOnly(Qwen2VLProcessor):
        """The processor without its video processor (which needs torchvision, not installed here)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    processor = ImagesOnly(
        image_processor=image_processor(MIN_PIXELS, MAX_PIXELS), tokenizer=AutoTokenizer.from_pretrained(path)
    )
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return dict(processor(text=[text], images=pil or None, return_tensors="pt"))


def transformers_greedy(path: Path, text: str, images: list[bytes], max_new: int, dtype: torch.dtype) -> list[int]:
    """transformers' greedy tokens for the prompt and its images."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    inputs = transformers_inputs(path, text, images)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    prompt = inputs["input_ids"]
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()
