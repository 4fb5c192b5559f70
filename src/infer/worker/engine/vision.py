"""Images into a model's input embeddings (torch): preprocessing, the vision encoder's cache, and each step's
image rows.

- `ClipPreprocessor`: transformers' CLIPImageProcessor for LLaVA-1.5, written with Pillow + torch: RGB, resize the
  shortest edge (bicubic), center crop, rescale by 1/255, normalize by the CLIP mean and std.
- `Qwen2VLPreprocessor`: transformers' Qwen2VLImageProcessor (Qwen2-VL, Qwen2.5-VL): dynamic resolution
  (`smart_resize` between min_pixels and max_pixels, to multiples of patch x merge), rescale, normalize, and the
  patches flattened in the processor's order (a still image repeated over the temporal patch).
- `LlavaNextPreprocessor`: transformers' LlavaNextImageProcessor (LLaVA-NeXT's any resolution; the layout's
  arithmetic is worker/engine/anyres.py): the image resized into its best grid resolution and padded, cut into tiles,
  after the whole image resized to one tile; each tile rescaled and normalized as CLIP's. Its output, `AnyresPixels`,
  keeps the image's size, which the token count and the unpadding of the features read.
- `Idefics3Preprocessor`: transformers' Idefics3ImageProcessor (Idefics3, SmolVLM): the longest edge resized, the image
  cut into tiles of the tower's size (Lanczos, in Pillow) and resized whole to one more; its output, `TiledPixels`,
  keeps the grid (rows x columns), from which the prompt's layout follows (worker/engine/images.py
  `Idefics3ImagePrompt`; each tile is placed and encoded as an image of its own).
- `VisionModel`: what a model that takes images offers (models/llava.py, models/llava_next.py, models/qwen2_vl.py,
  models/gemma3_vision.py, models/idefics3.py): its image token, its preprocessing, each preprocessed image's token
  count and M-RoPE grid, and `encode_image` (vision tower + projector: one image, the encoder cache's unit) ->
  [tokens, hidden].
- `ImageEncoder`: runs the tower once per image, at the first prefill chunk that needs any of its tokens, and keeps
  its features in a bounded LRU by the image's content key (worker/engine/images.py), so a later request (a second turn
  with the same image, a preemption's recompute, a failover's resume) takes them from there.
- `step_image_rows`: for one step's chunks, the rows of the flattened tokens that hold image tokens and the feature
  rows that go there; a chunk that covers part of an image (chunked prefill) takes that part.
- `step_mrope_positions`: M-RoPE's three positions (temporal, height, width) of every token of a step, as
  transformers' get_rope_index gives them: an image's tokens at (s, s + row, s + column) from the position s its
  first token takes, the text after it from s + max(rows, columns) on (`Request.rope_delta` past the prompt).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from infer.worker.engine.anyres import AnyresLayout, fitted_size
from infer.worker.engine.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from infer.worker.engine.request import Request
    from infer.worker.engine.scheduler import ScheduledChunk

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 64  # longer side / shorter side: past it, a resize of the shortest edge would make a huge image


@dataclass(frozen=True)
class AnyresPixels:
    """One image preprocessed for LLaVA-NeXT: `tiles` [1 + rows * columns, 3, tile, tile] float32 (the whole image
    resized to one tile, then its grid's tiles row by row) and the image's `height` x `width` before preprocessing,
    from which its grid, its token count and the unpadding of its features follow (worker/engine/anyres.py)."""

    tiles: torch.Tensor
    height: int
    width: int

    def to(self, device: torch.device | str) -> AnyresPixels:
        return replace(self, tiles=self.tiles.to(device))


# an RGB PIL image (worker/engine/images.py to_rgb) -> its pixels as the model's vision tower takes them (a tensor, or
# LLaVA-NeXT's AnyresPixels); ValueError for an image it cannot take
Preprocessor = Callable[[Any], torch.Tensor | AnyresPixels]


@runtime_checkable
class VisionModel(Protocol):
    """A model whose prompts may hold images. `image_preprocessor(model_dir)` reads its preprocessing (the
    checkpoint's preprocessor_config.json); `image_placement(pixels)` gives one preprocessed image's token count and
    its M-RoPE grid (rows, columns), or None where image tokens take their places in the sequence as positions;
    `encode_image(pixels)` (one preprocessed image, on the model's device) -> features [tokens, hidden] in the model's
    dtype, written at the image tokens' rows of the input embeddings (`ForwardBatch.image_rows` / `image_embeds`).
    `pixels` is what the model's own preprocessor made."""

    image_token_id: int

    def image_preprocessor(self, model_dir: Path | None) -> Preprocessor: ...

    def image_placement(self, pixels: Any) -> tuple[int, tuple[int, int] | None]: ...

    def encode_image(self, pixels: Any) -> torch.Tensor: ...


def _normalized(
    pixels: torch.Tensor, rescale_factor: float, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """uint8 [3, H, W] -> float32, as transformers' PIL backend: rescaled in float64, then normalized in float32."""
    scaled = (pixels.to(torch.float64) * rescale_factor).to(torch.float32)
    mean_t = torch.tensor(tuple(mean), dtype=torch.float32).view(3, 1, 1)
    std_t = torch.tensor(tuple(std), dtype=torch.float32).view(3, 1, 1)
    return ((scaled - mean_t) / std_t).contiguous()


def _uint8_pixels(image: Any) -> torch.Tensor:
    """An RGB PIL image -> uint8 [3, H, W]."""
    width, height = image.size
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3).permute(2, 0, 1)


@dataclass(frozen=True)
class ClipPreprocessor:
    """CLIPImageProcessor's steps (LLaVA-1.5's preprocessor_config.json), equal to transformers' PIL backend."""

    shortest_edge: int = 336
    crop_height: int = 336
    crop_width: int = 336
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def for_model(cls, model_dir: Path | None, image_size: int) -> ClipPreprocessor:
        """From the model's image processor settings (`_image_processor_config`) when it has them, else CLIP's defaults
        at the tower's size."""
        path, raw = _image_processor_config(model_dir)
        if path is None:
            return cls(image_size, image_size, image_size)
        size, crop = raw.get("size", {}), raw.get("crop_size", {})
        edge = size.get("shortest_edge", image_size) if isinstance(size, dict) else int(size)
        if isinstance(crop, dict):
            height, width = crop.get("height", image_size), crop.get("width", image_size)
        else:
            height = width = int(crop)
        if raw.get("do_center_crop") is False or raw.get("do_pad") or raw.get("resample", 3) != 3:
            raise NotImplementedError(
                f"{path}: only CLIPImageProcessor's bicubic resize + center crop is supported (LLaVA-1.5)"
            )
        return cls(
            int(edge),
            int(height),
            int(width),
            tuple(raw.get("image_mean", OPENAI_CLIP_MEAN)),
            tuple(raw.get("image_std", OPENAI_CLIP_STD)),
            float(raw.get("rescale_factor", 1 / 255)),
        )

    def __call__(self, image: Any) -> torch.Tensor:
        """An RGB PIL image (worker/engine/images.py to_rgb) -> pixels [3, crop_height, crop_width] float32."""
        from PIL import Image

        width, height = image.size
        short, long = (width, height) if width <= height else (height, width)
        if long > MAX_ASPECT_RATIO * short:
            raise ValueError(
                f"{width}x{height} pixels: an aspect ratio past {MAX_ASPECT_RATIO}:1 is refused (resizing its "
                f"shorter side to {self.shortest_edge} would make it {self.shortest_edge * long // short} pixels long)"
            )
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
        top, left = (new_h - self.crop_height) // 2, (new_w - self.crop_width) // 2
        pixels = _crop(_uint8_pixels(image), top, left, self.crop_height, self.crop_width)
        return _normalized(pixels, self.rescale_factor, self.mean, self.std)


@dataclass(frozen=True)
class LlavaNextPreprocessor:
    """LlavaNextImageProcessor's steps, equal to transformers' PIL backend: the image resized (bicubic, aspect kept)
    into the grid resolution `layout` picks for its size, zero-padded to it (centered) and cut into tiles; before
    them the whole image resized to one tile (squashed); every tile rescaled and normalized. Each tile is already the
    size that the processor's per-tile resize and center crop keep, so those are no-ops here."""

    layout: AnyresLayout
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def for_model(cls, model_dir: Path | None, layout: AnyresLayout) -> LlavaNextPreprocessor:
        """From the model's image processor settings (`_image_processor_config`) when it has them, else CLIP's defaults
        at the model's layout.
        ValueError where its pinpoints differ from the model's (the model cuts the features by its own);
        NotImplementedError naming a setting whose tiles would not be the tower's (a resize or crop to another size,
        another resample, a step turned off)."""
        path, raw = _image_processor_config(model_dir)
        if path is None:
            return cls(layout)
        pinpoints = AnyresLayout.of(layout.tile, layout.side, raw.get("image_grid_pinpoints", layout.pinpoints))
        if pinpoints != layout:
            raise ValueError(
                f"{path}: image_grid_pinpoints {[list(p) for p in pinpoints.pinpoints]} differ from the model's "
                f"{[list(p) for p in layout.pinpoints]}"
            )
        off = [
            name
            for name in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb")
            if raw.get(name) is False
        ]
        wrong = [f"{name} {value}" for name, value in _sizes_of(raw) if value != layout.tile]
        if off or wrong or raw.get("resample", 3) != 3:
            what = ", ".join([f"{name}=false" for name in off] + wrong) or f"resample={raw.get('resample')!r}"
            raise NotImplementedError(
                f"{path}: {what} is not supported (only LlavaNextImageProcessor's bicubic resize to tiles of the "
                f"vision tower's {layout.tile} pixels)"
            )
        return cls(
            layout,
            tuple(raw.get("image_mean", OPENAI_CLIP_MEAN)),
            tuple(raw.get("image_std", OPENAI_CLIP_STD)),
            float(raw.get("rescale_factor", 1 / 255)),
        )

    def __call__(self, image: Any) -> AnyresPixels:
        """An RGB PIL image (worker/engine/images.py to_rgb) -> its AnyresPixels."""
        from PIL import Image

        width, height = image.size
        tile = self.layout.tile
        best_h, best_w = self.layout.best_resolution(height, width)
        new_h, new_w = fitted_size(height, width, (best_h, best_w))
        resized = _uint8_pixels(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
        canvas = torch.zeros((3, best_h, best_w), dtype=torch.uint8)
        top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
        canvas[:, top : top + new_h, left : left + new_w] = resized
        rows, cols = best_h // tile, best_w // tile
        grid = canvas.view(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
        whole = _uint8_pixels(image.resize((tile, tile), resample=Image.Resampling.BICUBIC))
        tiles = torch.cat([whole.unsqueeze(0), grid])
        return AnyresPixels(_normalized(tiles, self.rescale_factor, self.mean, self.std), height, width)


def _sizes_of(raw: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, value) of every size a preprocessor_config.json's `size` and `crop_size` give: a shortest edge, a height
    and a width, or a bare int."""
    found = []
    for name in ("size", "crop_size"):
        value = raw.get(name)
        if isinstance(value, dict):
            keys = ("shortest_edge", "height", "width")
            found += [(f"{name}.{key}", v) for key, v in value.items() if key in keys and v is not None]
        elif value is not None:
            found.append((name, value))
    return found


MAX_QWEN_ASPECT_RATIO = 200  # smart_resize's own bound


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize: (height, width) rounded to multiples of `factor`, scaled so that their
    product lies in [min_pixels, max_pixels], the aspect ratio kept as near as those allow."""
    if max(height, width) > MAX_QWEN_ASPECT_RATIO * min(height, width):
        raise ValueError(f"{width}x{height} pixels: an aspect ratio past {MAX_QWEN_ASPECT_RATIO}:1 is refused")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLPreprocessor:
    """Qwen2VLImageProcessor's steps for a still image, equal to transformers' PIL backend. The output [rows,
    columns, merge, merge, 3 * temporal_patch_size * patch_size^2] float32 holds the patches in the processor's
    order (its flattening is transformers' pixel_values); rows x columns are the image's tokens after the vision
    tower's merge."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} and max_pixels {self.max_pixels}: need 0 < min <= max")

    @classmethod
    def for_model(cls, model_dir: Path | None, vision: Any) -> Qwen2VLPreprocessor:
        """From the model's image processor settings (`_image_processor_config`: min_pixels / max_pixels, or size's
        shortest_edge / longest_edge, as transformers reads them) where it has them; the patch sizes default to the
        vision config's."""
        path, raw = _image_processor_config(model_dir)
        if raw.get("do_resize") is False or raw.get("resample", 3) != 3:
            raise NotImplementedError(f"{path}: only Qwen2VLImageProcessor's bicubic smart_resize is supported")
        size: dict[str, Any] = raw["size"] if isinstance(raw.get("size"), dict) else {}
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels
        return cls(
            int(min_pixels),
            int(max_pixels),
            int(raw.get("patch_size", vision.patch_size)),
            int(raw.get("temporal_patch_size", vision.temporal_patch_size)),
            int(raw.get("merge_size", vision.spatial_merge_size)),
            tuple(raw.get("image_mean", OPENAI_CLIP_MEAN)),
            tuple(raw.get("image_std", OPENAI_CLIP_STD)),
            float(raw.get("rescale_factor", 1 / 255)),
        )

    def __call__(self, image: Any) -> torch.Tensor:
        """An RGB PIL image -> patches [rows, columns, merge, merge, patch_dim] float32."""
        from PIL import Image

        width, height = image.size
        factor, p, m = self.patch_size * self.merge_size, self.patch_size, self.merge_size
        new_h, new_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        if (new_w, new_h) != (width, height):
            image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
        pixels = _normalized(_uint8_pixels(image), self.rescale_factor, self.mean, self.std)
        rows, cols = new_h // factor, new_w // factor
        patches = pixels.reshape(3, rows, m, p, cols, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        # [rows, cols, m, m, 3, p, p] -> the frame repeated over the temporal patch: [..., 3, T, p, p]
        patches = patches.unsqueeze(5).expand(rows, cols, m, m, 3, self.temporal_patch_size, p, p)
        return patches.reshape(rows, cols, m, m, -1).contiguous()


def _crop(pixels: torch.Tensor, top: int, left: int, height: int, width: int) -> torch.Tensor:
    """[C, H, W] cropped to [C, height, width] at (top, left); zero-padded where the crop leaves the image (as
    transformers' center_crop pads an image smaller than the crop)."""
    _, h, w = pixels.shape
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return pixels[:, top : top + height, left : left + width]
    out = torch.zeros((pixels.shape[0], height, width), dtype=pixels.dtype)
    src_top, src_left = max(top, 0), max(left, 0)
    dst_top, dst_left = src_top - top, src_left - left
    rows, cols = min(h - src_top, height - dst_top), min(w - src_left, width - dst_left)
    out[:, dst_top : dst_top + rows, dst_left : dst_left + cols] = pixels[
        :, src_top : src_top + rows, src_left : src_left + cols
    ]
    return out


class ImageEncoder:
    """The vision encoder's outputs by image key, least recently used evicted past `max_images`. Counters:
    `encoded` (images run through the tower), `hits` (features taken from the cache)."""

    def __init__(self, model: VisionModel, max_images: int = 64) -> None:
        if max_images < 1:
            raise ValueError(f"the encoder cache must hold at least one image, got {max_images}")
        self.model = model
        self.max_images = max_images
        self._features: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.encoded = 0
        self.hits = 0

    def features(self, key: int, pixels: torch.Tensor | AnyresPixels) -> torch.Tensor:
        """[tokens, hidden] of the image `key` (its preprocessed `pixels` encoded if it is not cached)."""
        found = self._features.get(key)
        if found is not None:
            self._features.move_to_end(key)
            self.hits += 1
            return found
        device = next(iter(getattr(self.model, "parameters")()), torch.empty(0)).device
        out = self.model.encode_image(pixels.to(device))
        self.encoded += 1
        self._features[key] = out
        while len(self._features) > self.max_images:
            self._features.popitem(last=False)
        return out

    def clear(self) -> None:
        """Forget every image's features (weights changed, or released for a suspend)."""
        self._features.clear()


def step_image_rows(chunks: Sequence[ScheduledChunk], encoder: ImageEncoder) -> tuple[list[int], torch.Tensor] | None:
    """(rows of the step's flattened tokens that hold image tokens, their features [rows, hidden]) for chunks in
    `build_forward_batch`'s order, or None when no chunk computes an image token. Each image is encoded (or taken
    from the cache) by the first chunk that needs it."""
    rows: list[int] = []
    parts: list[torch.Tensor] = []
    base = 0
    for chunk in chunks:
        start, n = chunk.start, chunk.num_new_tokens
        for image in chunk.request.images:
            lo, hi = max(start, image.offset), min(start + n, image.end)
            if lo >= hi:
                continue
            features = encoder.features(image.key, image.pixels)
            parts.append(features[lo - image.offset : hi - image.offset])
            rows.extend(range(base + lo - start, base + hi - start))
        base += n
    if not rows:
        return None
    return rows, torch.cat(parts)


@dataclass(frozen=True)
class Gemma3Preprocessor:
    """Gemma3ImageProcessor's default steps (pan-and-scan off), equal to transformers' PIL backend: RGB, resize to
    height x width (bilinear), rescale, normalize."""

    height: int = 896
    width: int = 896
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def for_model(cls, model_dir: Path | None, image_size: int) -> Gemma3Preprocessor:
        """From the model's image processor settings (`_image_processor_config`) when it has them, else the defaults at
        the tower's size; NotImplementedError naming a setting it does not compute (pan-and-scan, another resample, a
        step off)."""
        path, raw = _image_processor_config(model_dir)
        if path is None:
            return cls(image_size, image_size)
        if raw.get("do_pan_and_scan"):
            raise NotImplementedError(f"{path}: do_pan_and_scan (Gemma 3's pan-and-scan crops) is not supported")
        off = [name for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb") if raw.get(name) is False]
        if off or raw.get("resample", 2) != 2:
            what = ", ".join(f"{name}=false" for name in off) or f"resample={raw.get('resample')!r}"
            raise NotImplementedError(f"{path}: {what} is not supported (only Gemma3ImageProcessor's bilinear resize)")
        size = raw.get("size", {"height": image_size, "width": image_size})
        height, width = (size["height"], size["width"]) if isinstance(size, dict) else (int(size), int(size))
        return cls(
            int(height),
            int(width),
            tuple(raw.get("image_mean", (0.5, 0.5, 0.5))),
            tuple(raw.get("image_std", (0.5, 0.5, 0.5))),
            float(raw.get("rescale_factor", 1 / 255)),
        )

    def __call__(self, image: Any) -> torch.Tensor:
        """An RGB PIL image (worker/engine/images.py to_rgb) -> pixels [3, height, width] float32."""
        from PIL import Image

        image = image.resize((self.width, self.height), resample=Image.Resampling.BILINEAR)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(self.height, self.width, 3)
        scaled = (pixels.permute(2, 0, 1).to(torch.float64) * self.rescale_factor).to(torch.float32)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(3, 1, 1)
        return ((scaled - mean) / std).contiguous()


def step_image_spans(chunks: Sequence[ScheduledChunk]) -> tuple[tuple[int, int, int], ...]:
    """(sequence index in the batch, image offset, image end) of every image whose tokens a chunk computes and some
    of which attend to later tokens of the same image (all but its last token), for a model whose image tokens
    attend to each other both ways (`bidirectional_images`; worker/engine/attention.py `image_span_attention`). Chunks
    in `build_forward_batch`'s order, each one sequence of the batch (a verification chunk is several: its request holds
    no image, since images refuse speculative decoding)."""
    spans = []
    index = 0
    for chunk in chunks:
        for image in chunk.request.images:
            if image.offset < chunk.end and chunk.start < image.end - 1:
                spans.append((index, image.offset, image.end))
        index += chunk.num_new_tokens if chunk.num_draft_tokens else 1
    return tuple(spans)


def with_mrope_positions(batch: ForwardBatch, chunks: Sequence[ScheduledChunk]) -> ForwardBatch:
    """The batch of `chunks` with M-RoPE's positions: `positions` the text position of each token (its place in the
    sequence plus the shift of the images before it), and `mrope_positions` [3, T] as well where a token's three
    differ (the step computes image tokens). Slots were computed from the places already. A step of requests
    without images is left as it is (their positions are their places)."""
    if not any(image.grid is not None for chunk in chunks for image in chunk.request.images):
        return batch
    positions = step_mrope_positions(chunks)
    device = batch.positions.device
    if torch.equal(positions[0], positions[1]) and torch.equal(positions[0], positions[2]):
        return replace(batch, positions=positions[0].to(device))
    return replace(batch, positions=positions[0].to(device), mrope_positions=positions.to(device))


def step_mrope_positions(chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
    """[3, T] int64: M-RoPE's (temporal, height, width) position of each token of the step's chunks, in
    `build_forward_batch`'s order (`mrope_positions` of each chunk's tokens)."""
    return torch.cat([mrope_positions(c.request, c.start, c.num_new_tokens) for c in chunks], dim=1)


def mrope_positions(request: Request, start: int, n: int) -> torch.Tensor:
    """[3, n]: the positions of the request's tokens [start, start + n), as transformers' get_rope_index gives them for
    still images: a text token's three are equal, counted on from the previous image's largest + 1; an image's token at
    (row r, column c) of its grid is at (s, s + r, s + c), s the position its first token takes. Past the last image
    (every decode) a token's place plus `Request.rope_delta`."""
    places = torch.arange(start, start + n, dtype=torch.int64)
    on_grid = [(image, image.grid[1]) for image in request.images if image.grid is not None]
    if not on_grid or start >= on_grid[-1][0].end:
        return (places + request.rope_delta).expand(3, n).clone()
    positions = places.expand(3, n).clone()
    passed = 0  # the shift of the images before this one
    for image, cols in on_grid:
        if image.end < start + n:  # the tokens after it fall behind by its shift
            positions[:, max(image.end - start, 0) :] += image.rope_shift
        lo, hi = max(start, image.offset), min(start + n, image.end)
        if lo < hi:
            index = torch.arange(lo - image.offset, hi - image.offset)
            first = image.offset + passed
            positions[0, lo - start : hi - start] = first
            positions[1, lo - start : hi - start] = first + index // cols
            positions[2, lo - start : hi - start] = first + index % cols
        passed += image.rope_shift
    return positions


@dataclass(frozen=True)
class TiledPixels:
    """One image preprocessed for Idefics3 / SmolVLM: `tiles` [rows * cols + 1, 3, tile, tile] float32 (the grid's
    tiles row by row, then the whole image resized to one tile; an image not cut is that one tile alone, rows = cols =
    0). Each tile is placed, encoded and cached as an image of its own (worker/engine/images.py
    `Idefics3ImagePrompt`)."""

    tiles: torch.Tensor
    rows: int
    cols: int

    def to(self, device: torch.device | str) -> TiledPixels:
        return replace(self, tiles=self.tiles.to(device))


IDEFICS3_MAX_SIDE = 4096  # Idefics3ImageProcessor's MAX_IMAGE_SIZE: no side is resized past it


@dataclass(frozen=True)
class Idefics3Preprocessor:
    """Idefics3ImageProcessor's steps (SmolVLMImageProcessor's are the same), equal to transformers' PIL backend: RGB;
    the longest edge resized to `longest_edge` (Lanczos, aspect kept, the other side rounded up to even); with
    `do_image_splitting`, both sides resized up to multiples of `tile` and cut into tiles, then the whole image resized
    to one tile; without, the image resized to one tile; every tile rescaled and normalized."""

    tile: int
    longest_edge: int
    do_image_splitting: bool = True
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def for_model(cls, model_dir: Path | None, tile: int) -> Idefics3Preprocessor:
        """From the model's image processor settings (`_image_processor_config`) when it has them, else Idefics3's
        defaults (the longest edge 4 tiles) at the tower's size.
        ValueError where its max_image_size is not the tower's image_size (tiles of another size take interpolated
        position embeddings, not computed here); NotImplementedError naming a step turned off or another resample."""
        path, raw = _image_processor_config(model_dir)
        if path is None:
            return cls(tile, 4 * tile)
        max_size = raw.get("max_image_size", {}).get("longest_edge", tile)
        if max_size != tile:
            raise ValueError(f"{path}: max_image_size {max_size} differs from the vision tower's image_size {tile}")
        off = [name for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb") if raw.get(name) is False]
        if off or raw.get("resample", 1) != 1:
            what = ", ".join(f"{name}=false" for name in off) or f"resample={raw.get('resample')!r}"
            raise NotImplementedError(f"{path}: {what} is not supported (only Idefics3ImageProcessor's Lanczos resize)")
        size = raw.get("size", {})
        longest = size.get("longest_edge") if isinstance(size, dict) else None
        if longest is None:
            raise NotImplementedError(f"{path}: size {size!r} is not supported (only a longest_edge)")
        return cls(
            tile,
            int(longest),
            bool(raw.get("do_image_splitting", True)),
            tuple(raw.get("image_mean", (0.5, 0.5, 0.5))),
            tuple(raw.get("image_std", (0.5, 0.5, 0.5))),
            float(raw.get("rescale_factor", 1 / 255)),
        )

    def __call__(self, image: Any) -> TiledPixels:
        """An RGB PIL image (worker/engine/images.py to_rgb) -> its TiledPixels."""
        from PIL import Image

        lanczos = Image.Resampling.LANCZOS
        width, height = image.size
        height, width = _longest_edge_size(height, width, self.longest_edge)
        image = image.resize((width, height), resample=lanczos)
        tile = self.tile
        if not self.do_image_splitting:
            whole = _uint8_pixels(image.resize((tile, tile), resample=lanczos))
            return TiledPixels(_normalized(whole.unsqueeze(0), self.rescale_factor, self.mean, self.std), 0, 0)
        height, width = _tile_multiple_size(height, width, tile)
        image = image.resize((width, height), resample=lanczos)
        if height <= tile and width <= tile:
            whole = _uint8_pixels(image)
            return TiledPixels(_normalized(whole.unsqueeze(0), self.rescale_factor, self.mean, self.std), 0, 0)
        rows, cols = height // tile, width // tile
        pixels = _uint8_pixels(image)
        grid = pixels.view(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
        whole = _uint8_pixels(image.resize((tile, tile), resample=lanczos))
        tiles = torch.cat([grid, whole.unsqueeze(0)])
        return TiledPixels(_normalized(tiles, self.rescale_factor, self.mean, self.std), rows, cols)


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """Idefics3ImageProcessor's resize of the longest edge to `longest` (the other side int(), then rounded up to
    even, at least 1), then down below IDEFICS3_MAX_SIDE."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > IDEFICS3_MAX_SIDE:
        width, height = IDEFICS3_MAX_SIDE, int(IDEFICS3_MAX_SIDE / aspect)
    elif height > width and height > IDEFICS3_MAX_SIDE:
        height, width = IDEFICS3_MAX_SIDE, int(IDEFICS3_MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Idefics3ImageProcessor's resize_for_vision_encoder: the longer side rounded up to a multiple of `tile`, the
    other scaled with it (int()), then rounded up to a multiple of `tile`."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _image_processor_config(model_dir: Path | None) -> tuple[Path | None, dict[str, Any]]:
    """(its path, the image processor's settings) from the model's preprocessor_config.json, else from
    processor_config.json's "image_processor" (transformers 5 saves a processor's settings there); (None, {}) when
    neither is there."""
    if model_dir is None:
        return None, {}
    path = Path(model_dir) / "preprocessor_config.json"
    if path.is_file():
        return path, json.loads(path.read_text())
    path = Path(model_dir) / "processor_config.json"
    if path.is_file():
        raw = json.loads(path.read_text()).get("image_processor")
        if isinstance(raw, dict):
            return path, raw
    return None, {}
