"""Idefics3 and SmolVLM (transformers' Idefics3ForConditionalGeneration, model_type "idefics3", and
SmolVLMForConditionalGeneration, "smolvlm"): a SigLIP vision tower, a pixel-shuffle connector and our Llama language
model, each image cut into tiles whose features are written into the input embeddings at their image tokens.

- The tower is SigLIP's (models/gemma3_vision.py `SiglipVisionTransformer`: the patches with the convolution's bias and
  learned position embeddings, CLIP's pre-LN layers, the post-layernorm). Every tile is the tower's full image_size
  (the preprocessor's `max_image_size` must equal it), so no patch is padding and each patch takes its own position:
  transformers' fractional position buckets are then the identity.
- The connector: the side x side patch grid pixel-shuffled by `scale_factor` (each token the scale_factor^2 patches of
  a square, concatenated) and projected by one bias-free linear: (side / scale_factor)^2 tokens per tile.
- An image is its grid's tiles row by row, then the whole image as one tile (worker/engine/vision.py
  `Idefics3Preprocessor`); the prompt holds each tile's run of image tokens between the processor's
  `<fake_token_around_image>`, `<row_r_col_c>` and `<global-img>` tokens (worker/engine/images.py
  `Idefics3ImagePrompt`). Each tile is one PlacedImage with its own content key (the image's and its index), so the
  encoder cache and the prefix cache hold tiles, and the tower runs once per tile.
- The text model's attention is causal over images too; positions are the tokens' places.

SmolVLM is the same model and the same prompt form (its processor's video path is not served: videos are refused).

With tensor parallelism the text model is sharded as Llama's; the tower and connector are whole on every rank and run
on rank 0 only, whose features the other ranks take with each step (worker/parallel/tp_commands.py).

Checkpoint names: transformers' (`model.text_model.*`, `model.vision_model.*`, `model.connector.*`, `lm_head.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.images import Idefics3ImagePrompt
from infer.worker.engine.vision import Idefics3Preprocessor, TiledPixels
from infer.worker.models.gemma3_vision import SiglipVisionTransformer
from infer.worker.models.layers import ColumnLinear
from infer.worker.models.llama import LlamaForCausalLM

VISION_MODEL_TYPES = ("idefics3_vision", "smolvlm_vision")


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = ColumnLinear(in_features, out_features, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    """[N, side * side, vision hidden] -> [N, (side / s)^2, text hidden]: pixel shuffle by s = scale_factor (token
    (i, j) of the shuffled grid holds the patches of rows s*i..s*i+s-1, columns s*j..s*j+s-1, row by row), then the
    projection."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision = config.vision_config
        self.scale = int(config.scale_factor)
        self.side = vision.image_size // vision.patch_size
        if self.scale < 1 or self.side % self.scale:
            raise ValueError(
                f"scale_factor {config.scale_factor} must divide the {self.side}x{self.side} patch grid "
                f"(image_size {vision.image_size} / patch_size {vision.patch_size})"
            )
        self.modality_projection = ModalityProjection(
            vision.hidden_size * self.scale**2, config.text_config.hidden_size, dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, hidden = x.shape
        s, side = self.scale, self.side
        grid = x.view(n, side // s, s, side // s, s, hidden).permute(0, 1, 3, 2, 4, 5)
        return self.modality_projection(grid.reshape(n, (side // s) ** 2, s * s * hidden))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """Idefics3 / SmolVLM over the paged KV cache: the registry's CausalLM contract (of its text model, whose config is
    `self.config`) plus worker/engine/vision.py's VisionModel (`image_token_id`, `image_preprocessor`,
    `image_placement`, `encode_image`: one tile) and its prompt form (`image_prompt`)."""

    checkpoint_prefix_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.text_model.", "model."),
        ("model.vision_model.", "vision_model."),
        ("model.connector.", "connector."),
    )
    supports_step_graphs: ClassVar[bool] = True  # decode steps hold no image token: the Llama layers' graphs apply
    tiled_images: ClassVar[bool] = True  # each image is several PlacedImages, one per tile

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        vision = config.vision_config
        if getattr(vision, "model_type", "idefics3_vision") not in VISION_MODEL_TYPES:
            raise NotImplementedError(f"Idefics3 with a {vision.model_type!r} vision tower is not supported")
        text_type = getattr(config.text_config, "model_type", "llama")
        if text_type != "llama":
            raise NotImplementedError(
                f"Idefics3 / SmolVLM with a {text_type!r} text model is not supported (only llama)"
            )
        super().__init__(config.text_config, dtype, tp=tp)
        if getattr(config, "tie_word_embeddings", False) and not self.lm_head_tied:
            self.tie_lm_head()
        self.idefics3_config = config
        self.vision_model = SiglipVisionTransformer(vision, dtype)
        self.connector = Idefics3Connector(config, dtype)
        self.image_token_id: int = int(config.image_token_id)
        self.image_size: int = int(vision.image_size)
        self.tokens_per_tile: int = (self.connector.side // self.connector.scale) ** 2

    def skips_checkpoint_tensor(self, key: str) -> bool:
        """The tower's position-id buffer."""
        return key.endswith("position_ids")

    def image_prompt(self, tokenizer: Any) -> Idefics3ImagePrompt:
        return Idefics3ImagePrompt.of(tokenizer, self.image_token_id, self.tokens_per_tile)

    def image_preprocessor(self, model_dir: Path | None) -> Idefics3Preprocessor:
        return Idefics3Preprocessor.for_model(model_dir, self.image_size)

    def image_placement(self, pixels: TiledPixels) -> tuple[int, None]:
        """The image's tokens: `tokens_per_tile` per tile (placed tile by tile: worker/engine/intake.py)."""
        return self.tokens_per_tile * pixels.tiles.shape[0], None

    @torch.inference_mode()
    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """One tile [3, image_size, image_size] -> its features [tokens_per_tile, text hidden] in the model's dtype."""
        size = self.image_size
        if tuple(pixels.shape) != (3, size, size):
            raise ValueError(f"a tile of shape {tuple(pixels.shape)}: the vision tower takes 3x{size}x{size}")
        return self.connector(self.vision_model(pixels.unsqueeze(0)))[0].to(self.dtype)
