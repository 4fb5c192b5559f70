"""Images of a multimodal prompt, torch-free: decoded and checked (Pillow), named by their content, and placed in
the prompt's tokens.

An image arrives as its encoded bytes (the wire carries those: compact) or, in-process, as a PIL image. Every check
that a peer can trigger raises ValueError naming what is wrong, before any pixel is decoded where it can:

- `ImageLimits.max_bytes`: the encoded size;
- `ImageLimits.max_pixels`: width x height read from the header, before the pixels are decoded (a decompression bomb
  is refused for its declared size, never inflated);
- bytes that are no image Pillow reads, or a truncated one (decoding fails), are refused by name.

An image's `key` is a 63-bit integer from a blake2b digest of what it is: its encoded bytes, or a PIL image's mode,
size and pixels. The encoder cache and the prefix cache name an image by it (worker/engine/vision.py, block_manager.py).

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
    pixels (a tensor: worker/engine/vision.py; typed Any so that the scheduler's modules stay torch-free). `grid`: the
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


@dataclass(frozen=True)
class Gemma3ImagePrompt:
    """Gemma 3's image prompt form, as transformers' Gemma3Processor writes it: each `<start_of_image>` (boi: what its
    chat template writes for an image part) becomes "\\n\\n" boi, `tokens_per_image` image tokens, eoi "\\n\\n".

    - A text prompt is expanded as text before it is tokenized (`expand_text`): the processor's way, so its ids.
    - Token ids (`place`): already expanded (one run of `tokens_per_image` image tokens per image: the processor's
      output, a failover's resumed prompt) taken as they are; else each boi expanded in ids, its "\\n\\n" merged with
      a newline token beside it into the one token of the whole run where the vocabulary has one (vLLM's merge:
      what Gemma's tokenizer, whose newline runs are single tokens, gives for the expanded text).
    `newline_ids[k - 1]`: the id of the token of k newlines, -1 where the vocabulary has none."""

    boi_token: str
    full_image_text: str
    boi_token_id: int
    eoi_token_id: int
    image_token_id: int
    tokens_per_image: int
    newline_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any, boi_id: int, eoi_id: int, image_id: int, tokens_per_image: int) -> Gemma3ImagePrompt:
        """From the model's token ids and its tokenizer (the tokens' text, the newline runs' ids)."""
        boi, eoi, image = (tokenizer.decode([i]) for i in (boi_id, eoi_id, image_id))
        newlines = []
        for k in range(1, 32):
            ids = tokenizer.encode("\n" * k, add_special_tokens=False)
            newlines.append(ids[0] if len(ids) == 1 else -1)
        if newlines[0] < 0:
            raise ValueError("the tokenizer has no token for a newline, which Gemma 3's image prompt form needs")
        full = f"\n\n{boi}{image * tokens_per_image}{eoi}\n\n"
        return cls(boi, full, boi_id, eoi_id, image_id, tokens_per_image, tuple(newlines))

    def expand_text(self, text: str, num_images: int) -> str:
        """`text` with each boi replaced by its image's whole sequence; ValueError unless it holds one per image."""
        count = text.count(self.boi_token)
        if count != num_images:
            raise ValueError(
                f"the prompt holds {count} {self.boi_token} token(s) for its {num_images} image(s): give one per image"
            )
        return text.replace(self.boi_token, self.full_image_text)

    def place(self, prompt_ids: Sequence[int], num_images: int) -> tuple[list[int], list[tuple[int, int]]]:
        """(the ids with every image's tokens in place, each image's (offset, length)); ValueError saying what the
        prompt holds when it fits neither form."""
        if self.image_token_id in prompt_ids:
            return place_images(prompt_ids, self.image_token_id, [self.tokens_per_image] * num_images)
        bois = [i for i, t in enumerate(prompt_ids) if t == self.boi_token_id]
        if len(bois) != num_images:
            raise ValueError(
                f"the prompt holds {len(bois)} {self.boi_token} token(s) (id {self.boi_token_id}) and no image tokens "
                f"for its {num_images} image(s): give one {self.boi_token} per image, or each image's tokens expanded"
            )
        ids: list[int] = []
        places: list[tuple[int, int]] = []
        last = 0
        for at in bois:
            ids.extend(prompt_ids[last:at])
            self._newlines_before(ids)
            ids.append(self.boi_token_id)
            places.append((len(ids), self.tokens_per_image))
            ids.extend([self.image_token_id] * self.tokens_per_image)
            ids.append(self.eoi_token_id)
            last = at + 1
            after = self._newline_count(prompt_ids[last]) if last < len(prompt_ids) else 0
            if after and self._newline(2 + after) >= 0:
                ids.append(self._newline(2 + after))
                last += 1
            else:
                ids.extend(self._two_newlines())
        ids.extend(prompt_ids[last:])
        return ids, places

    def _newlines_before(self, ids: list[int]) -> None:
        """Append "\\n\\n" to `ids`, merged into their last token where that is a newline run with room to grow."""
        before = self._newline_count(ids[-1]) if ids else 0
        if before and self._newline(before + 2) >= 0:
            ids[-1] = self._newline(before + 2)
        else:
            ids.extend(self._two_newlines())

    def _two_newlines(self) -> list[int]:
        two = self._newline(2)
        return [two] if two >= 0 else [self._newline(1)] * 2

    def _newline(self, count: int) -> int:
        return self.newline_ids[count - 1] if count <= len(self.newline_ids) else -1

    def _newline_count(self, token_id: int) -> int:
        """k when `token_id` is the token of k newlines, else 0."""
        return self.newline_ids.index(token_id) + 1 if token_id >= 0 and token_id in self.newline_ids else 0
