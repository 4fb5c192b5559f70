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
<|vision_end|>"). `Gemma3ImagePrompt` and `Idefics3ImagePrompt` are the two families' own prompt forms (Idefics3's:
each image's tiles, a run of image tokens each between the processor's tokens, placed one by one under `tile_key`).
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


def tile_key(image_key: int, tile: int) -> int:
    """The content key of tile `tile` of the image `image_key` (Idefics3's tiles are placed, encoded and cached one by
    one: each is a PlacedImage of its own)."""
    return _key(image_key.to_bytes(8, "little"), tile.to_bytes(4, "little"))


@dataclass(frozen=True)
class Idefics3ImagePrompt:
    """Idefics3's and SmolVLM's image prompt form, as transformers' Idefics3Processor / SmolVLMProcessor write it: each
    `<image>` becomes, for an image cut into rows x columns tiles, per tile `<fake_token_around_image><row_r_col_c>` and
    `image_seq_len` image tokens, "\\n" after each row of tiles, then "\\n<fake_token_around_image><global-img>", the
    global image's tokens and `<fake_token_around_image>`; an image not cut (0 x 0) is the global part alone, without
    the leading "\\n". Each tile's run of image tokens is one PlacedImage (`place`).

    - A text prompt is expanded as text before it is tokenized (`expand_text`): the processor's way, so its ids.
    - Token ids (`place`) holding one image token per image are expanded in ids (`encode` of each expansion: its
      tokens are special, so it tokenizes alike alone and in context); ids already expanded (the processor's output, a
      failover's resumed prompt) are taken as they are when their runs are the tiles'."""

    image_token: str
    image_token_id: int
    image_seq_len: int
    encode: Any  # text -> token ids, no special tokens added

    @classmethod
    def of(cls, tokenizer: Any, image_token_id: int, image_seq_len: int) -> Idefics3ImagePrompt:
        """From the model's image token id and its tokenizer; ValueError naming a prompt token the vocabulary lacks."""
        image = tokenizer.convert_ids_to_tokens(image_token_id)
        for token in (FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, "<row_1_col_1>"):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
                raise ValueError(f"the tokenizer has no {token} token, which Idefics3's image prompt form needs")

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        return cls(image, image_token_id, image_seq_len, encode)

    def expansion(self, rows: int, cols: int) -> str:
        """The text an image of rows x cols tiles (0 x 0: not cut) stands for."""
        tokens = self.image_token * self.image_seq_len
        whole = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{tokens}{FAKE_IMAGE_TOKEN}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join(
            "".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{whole}"

    def expand_text(self, text: str, grids: Sequence[tuple[int, int]]) -> str:
        """`text` with image i's `<image>` replaced by its expansion (grids[i]: its rows x columns of tiles);
        ValueError unless it holds one per image."""
        count = text.count(self.image_token)
        if count != len(grids):
            raise ValueError(
                f"the prompt holds {count} {self.image_token} token(s) for its {len(grids)} image(s): give one per "
                "image"
            )
        parts = text.split(self.image_token)
        out = [parts[0]]
        for (rows, cols), part in zip(grids, parts[1:], strict=True):
            out += [self.expansion(rows, cols), part]
        return "".join(out)

    def place(
        self, prompt_ids: Sequence[int], grids: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """(the ids with every image's tokens in place, each image's tiles' (offset, length) in the processor's order:
        the grid's row by row, then the global image); ValueError saying what the prompt holds when it fits neither
        form."""
        tiles = [rows * cols + 1 for rows, cols in grids]
        runs = [(start, length) for start, length in _runs(prompt_ids, self.image_token_id)]
        if len(runs) == len(grids) and all(length == 1 for _, length in runs) and self.image_seq_len != 1:
            ids: list[int] = []
            last = 0
            for (start, _), (rows, cols) in zip(runs, grids, strict=True):
                ids.extend(prompt_ids[last:start])
                ids.extend(self.encode(self.expansion(rows, cols)))
                last = start + 1
            ids.extend(prompt_ids[last:])
            runs = list(_runs(ids, self.image_token_id))
        else:
            ids = list(prompt_ids)
        if [length for _, length in runs] != [self.image_seq_len] * sum(tiles):
            raise ValueError(
                f"the prompt's image tokens (id {self.image_token_id}) do not match its {len(grids)} image(s): it "
                f"holds {sum(length for _, length in runs)} in {len(runs)} run(s); give one {self.image_token} per "
                f"image, or each image's {sum(tiles)} tile(s) of {self.image_seq_len} tokens expanded"
            )
        places, at = [], 0
        for count in tiles:
            places.append(runs[at : at + count])
            at += count
        return ids, places


FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


def _runs(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every run of `token_id` in `ids`."""
    runs = []
    i = 0
    while i < len(ids):
        if ids[i] == token_id:
            start = i
            while i < len(ids) and ids[i] == token_id:
                i += 1
            runs.append((start, i - start))
        else:
            i += 1
    return runs
