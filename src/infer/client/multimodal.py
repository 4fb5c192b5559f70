"""vLLM's multimodal prompt form, torch-free: `{"prompt": "...<image>...", "multi_modal_data": {"image": X}}` (or
`"prompt_token_ids"` instead of `"prompt"`), X a PIL image, encoded image bytes, or a list of those, in the order of
the prompt's image tokens. `split_prompt` takes it apart; `image_bytes` encodes a PIL image for the wire (PNG:
lossless, so the worker decodes the same pixels)."""

from __future__ import annotations

import io
from typing import Any

from infer.protocol.messages import MAX_IMAGE_BYTES, MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES

MODALITIES = ("image", "audio")  # audio: client/audio.py split_audio takes it out first


def split_prompt(prompt: Any) -> tuple[Any, list[Any]]:
    """(the text or token ids, the images) of a prompt; a plain string or id list has no images. ValueError naming
    what is wrong with a dict."""
    if not isinstance(prompt, dict):
        return prompt, []
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown:
        raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids' and 'multi_modal_data', got {unknown}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    text = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict, got {type(data).__name__}")
    others = sorted(set(data) - set(MODALITIES))
    if others:
        raise ValueError(f"multi_modal_data: modality {others[0]!r} is not supported; supported: image, audio")
    images = data.get("image", [])
    return text, list(images) if isinstance(images, (list, tuple)) else [images]


def wire_images(images: list[Any]) -> list[bytes]:
    """The images encoded for Submit.images, within the wire's bounds (ValueError naming the one that is not)."""
    if len(images) > MAX_IMAGES:
        raise ValueError(f"{len(images)} images exceed the wire's limit of {MAX_IMAGES} per request")
    out = [image_bytes(image) for image in images]
    for index, data in enumerate(out):
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"image {index}: {len(data)} bytes exceeds the limit of {MAX_IMAGE_BYTES} bytes per image")
    total = sum(map(len, out))
    if total > MAX_REQUEST_IMAGE_BYTES:
        raise ValueError(f"the images hold {total} bytes, more than the limit of {MAX_REQUEST_IMAGE_BYTES} a request")
    return out


def image_bytes(image: Any) -> bytes:
    """Encoded bytes of an image given as bytes or a PIL image (PNG); ValueError for anything else."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be encoded bytes or a PIL.Image, got {type(image).__name__}")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
