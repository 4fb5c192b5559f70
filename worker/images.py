"""Images of a multimodal prompt, torch-free: decoded and checked (Pillow), named by their content, and placed in
the prompt's tokens.

An image arrives as its encoded bytes (the wire carries those: compact) or, in-process, as a PIL image. Every check
that a peer can trigger raises ValueError naming what is wrong, before any pixel is decoded where it can:

- `ImageLimits.max_bytes`: the encoded size;
- `ImageLimits.max_pixels`: width x height read from the header, before the pixels are decoded (a decompression bomb
  is refused for its declared size, never inflated);
- bytes that are no image Pillow reads, or a truncated one (decoding fails), are refused by name.

An image's `key` is a 63-bit integer from a blake2b digest of what it is: its encoded bytes, or a PIL image's mode,
size and pixels. The encoder cache and the prefix cache name an image by it (worker/vision.py, block_manager.py).

`place_images` finds where each image's tokens are in a prompt: one run of the image's tokens per image (a fixed count
for LLaVA, one that follows from the image's size for Qwen2-VL), as transformers' processors expand them, or one image
token per image, which it expands (vLLM's prompt form "...<image>...", Qwen2-VL's "<|vision_start|><|image_pad|>
<|vision_end|>").
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infer.protocol.messages import MAX_IMAGE_BYTES


@dataclass(frozen=True)
class ImageLimits:
    """What one prompt's images may be: at most `max_images` of them (vLLM's --limit-mm-per-prompt), each at most
    `max_bytes` encoded and `max_pixels` decoded (width x height)."""

    max_images: int = 4
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        for name in ("max_images", "max_bytes", "max_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class PlacedImage:
    """One image of a request: its prompt tokens [offset, offset + length), its content key and its preprocessed
    pixels (a tensor: worker/vision.py; typed Any so that the scheduler's modules stay torch-free). `grid`: the
    (rows, columns) its tokens make on an M-RoPE model's position grid (Qwen2-VL: rows x columns = length), None for
    a model whose image tokens take their places in the sequence as positions (LLaVA)."""

    offset: int
    length: int
    key: int
    pixels: Any
    grid: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def rope_shift(self) -> int:
        """How far the positions of the tokens after this image fall behind their places in the sequence: M-RoPE
        gives the image max(rows, columns) positions for its rows x columns tokens (0 without a grid)."""
        return 0 if self.grid is None else max(self.grid) - self.length


def _key(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8, person=b"infer-image")
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "little") >> 1  # a non-negative int64: it is hashed as one (prefix_hash.py)


def load_image(item: object, limits: ImageLimits, index: int = 0) -> tuple[Any, int]:
    """(an RGB PIL image (`to_rgb`), its key) from encoded bytes or a PIL image; ValueError naming image `index` and
    what is wrong with it."""
    from PIL import Image

    where = f"image {index}"
    if isinstance(item, Image.Image):
        width, height = item.size
        _check_pixels(where, width, height, limits)
        key = _key(item.mode.encode(), f"{width}x{height}".encode(), item.tobytes())
        return to_rgb(item), key
    if isinstance(item, (bytearray, memoryview)):
        item = bytes(item)
    if not isinstance(item, bytes):
        raise ValueError(f"{where}: expected encoded image bytes or a PIL.Image, got {type(item).__name__}")
    if len(item) > limits.max_bytes:
        raise ValueError(f"{where}: {len(item)} bytes exceeds the limit of {limits.max_bytes} bytes per image")
    if not item:
        raise ValueError(f"{where}: empty (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(item))  # reads the header only
        except Image.UnidentifiedImageError:
            raise ValueError(f"{where}: not an image Pillow can read ({len(item)} bytes)") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise ValueError(
                f"{where}: exceeds the limit of {limits.max_pixels} pixels per image (checked before decoding: {error})"
            ) from None
        width, height = image.size
        _check_pixels(where, width, height, limits)
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as error:
            kind = image.format or "unknown format"
            raise ValueError(f"{where}: cannot decode its pixels ({kind}): {error}") from None
    return to_rgb(image), _key(item)


def to_rgb(image: Any) -> Any:
    """An RGB copy of a PIL image, transparency composited onto white (what transformers' image processors do)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _check_pixels(where: str, width: int, height: int, limits: ImageLimits) -> None:
    if width < 1 or height < 1:
        raise ValueError(f"{where}: empty ({width}x{height} pixels)")
    if width * height > limits.max_pixels:
        raise ValueError(
            f"{where}: {width}x{height} = {width * height} pixels exceeds the limit of {limits.max_pixels} pixels "
            "per image (checked before decoding)"
        )


def place_images(
    prompt_ids: Sequence[int], image_token_id: int, tokens_per_image: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """(the prompt's token ids with every image's tokens in place, each image's (offset, length)), for images of
    `tokens_per_image[i]` tokens each, in order.

    The prompt holds either one image token per image (image i's expanded to tokens_per_image[i]) or, already
    expanded, one run of exactly tokens_per_image[i] image tokens for image i; anything else is a ValueError saying
    what it holds."""
    num_images = len(tokens_per_image)
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(prompt_ids):
        if prompt_ids[i] == image_token_id:
            start = i
            while i < len(prompt_ids) and prompt_ids[i] == image_token_id:
                i += 1
            runs.append((start, i - start))
        else:
            i += 1
    total = sum(length for _, length in runs)
    if total == num_images and all(length == 1 for _, length in runs):
        ids: list[int] = []
        placed: list[tuple[int, int]] = []
        last = 0
        for (start, _), count in zip(runs, tokens_per_image, strict=True):
            ids.extend(prompt_ids[last:start])
            placed.append((len(ids), count))
            ids.extend([image_token_id] * count)
            last = start + 1
        ids.extend(prompt_ids[last:])
        return ids, placed
    if [length for _, length in runs] == list(tokens_per_image):
        return list(prompt_ids), runs
    counts = ", ".join(map(str, tokens_per_image))
    raise ValueError(
        f"the prompt's image tokens (id {image_token_id}) do not match its {num_images} image(s): it holds {total} in "
        f"{len(runs)} run(s); give one image token per image, or each image's tokens in a row ({counts})"
    )
