"""Images into a model's input embeddings (torch): preprocessing, the vision encoder's cache, and each step's
image rows.

- `ClipPreprocessor`: transformers' CLIPImageProcessor for LLaVA-1.5, written with Pillow + torch: RGB, resize the
  shortest edge (bicubic), center crop, rescale by 1/255, normalize by the CLIP mean and std.
- `VisionModel`: what a model that takes images offers (models/llava.py): its image token, the tokens (features) of
  one image, and `encode_images` (vision tower + projector) -> [N, tokens_per_image, hidden].
- `ImageEncoder`: runs the tower once per image, at the first prefill chunk that needs any of its tokens, and keeps
  its features in a bounded LRU by the image's content key (worker/images.py), so a later request (a second turn
  with the same image, a preemption's recompute, a failover's resume) takes them from there.
- `step_image_rows`: for one step's chunks, the rows of the flattened tokens that hold image tokens and the feature
  rows that go there; a chunk that covers part of an image (chunked prefill) takes that part.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from infer.worker.scheduler import ScheduledChunk

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 64  # longer side / shorter side: past it, a resize of the shortest edge would make a huge image


@runtime_checkable
class VisionModel(Protocol):
    """A model whose prompts may hold images. `encode_images(pixels [N, 3, H, W] float32)` -> features [N,
    tokens_per_image, hidden] in the model's dtype, written at the image tokens' rows of the input embeddings
    (`ForwardBatch.image_rows` / `image_embeds`). Positions stay the tokens' places in the sequence (a family with
    positions of its own, such as M-RoPE, would add them here)."""

    image_token_id: int
    tokens_per_image: int
    image_size: int

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor: ...


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
        """From the model's preprocessor_config.json when it has one, else CLIP's defaults at the tower's size."""
        path = None if model_dir is None else Path(model_dir) / "preprocessor_config.json"
        if path is None or not path.is_file():
            return cls(image_size, image_size, image_size)
        raw = json.loads(path.read_text())
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
        """An RGB PIL image (worker/images.py to_rgb) -> pixels [3, crop_height, crop_width] float32."""
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
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(new_h, new_w, 3)
        pixels = _crop(pixels.permute(2, 0, 1), top, left, self.crop_height, self.crop_width)
        scaled = (pixels.to(torch.float64) * self.rescale_factor).to(torch.float32)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(3, 1, 1)
        return ((scaled - mean) / std).contiguous()


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

    def features(self, key: int, pixels: torch.Tensor) -> torch.Tensor:
        """[tokens_per_image, hidden] of the image `key` (`pixels` [3, H, W] encoded if it is not cached)."""
        found = self._features.get(key)
        if found is not None:
            self._features.move_to_end(key)
            self.hits += 1
            return found
        device = next(iter(getattr(self.model, "parameters")()), torch.empty(0)).device
        out = self.model.encode_images(pixels.unsqueeze(0).to(device))[0]
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
        """From the model's preprocessor_config.json when it has one, else the defaults at the tower's size;
        NotImplementedError naming a setting it does not compute (pan-and-scan, another resample, a step off)."""
        path = None if model_dir is None else Path(model_dir) / "preprocessor_config.json"
        if path is None or not path.is_file():
            return cls(image_size, image_size)
        raw = json.loads(path.read_text())
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
        """An RGB PIL image (worker/images.py to_rgb) -> pixels [3, height, width] float32."""
        from PIL import Image

        image = image.resize((self.width, self.height), resample=Image.Resampling.BILINEAR)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(self.height, self.width, 3)
        scaled = (pixels.permute(2, 0, 1).to(torch.float64) * self.rescale_factor).to(torch.float32)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(3, 1, 1)
        return ((scaled - mean) / std).contiguous()


def preprocessor_for(model: VisionModel, model_dir: Path | None) -> Any:
    """The model's own preprocessing (`model.preprocessor(model_dir)`) where it has one, else CLIP's (LLaVA)."""
    make = getattr(model, "preprocessor", None)
    return make(model_dir) if make is not None else ClipPreprocessor.for_model(model_dir, model.image_size)


def step_image_spans(chunks: Sequence[ScheduledChunk]) -> tuple[tuple[int, int, int], ...]:
    """(sequence index in the batch, image offset, image end) of every image whose tokens a chunk computes and some
    of which attend to later tokens of the same image (all but its last token), for a model whose image tokens
    attend to each other both ways (`bidirectional_images`; worker/attention.py `image_span_attention`). Chunks in
    `build_forward_batch`'s order, each one sequence of the batch (a verification chunk is several: its request holds
    no image, since images refuse speculative decoding)."""
    spans = []
    index = 0
    for chunk in chunks:
        for image in chunk.request.images:
            if image.offset < chunk.end and chunk.start < image.end - 1:
                spans.append((index, image.offset, image.end))
        index += chunk.num_new_tokens if chunk.num_draft_tokens else 1
    return tuple(spans)
