"""LLaVA-NeXT (transformers' LlavaNextForConditionalGeneration, "anyres"): LLaVA-1.5's CLIP tower, projector and Llama
language model (models/llava.py `ClipLlava`), with each image seen at a resolution that follows its size.

An image is cut into a grid of tiles (the grid of the checkpoint's `image_grid_pinpoints` that fits it best:
worker/engine/anyres.py) after one tile of the whole image (worker/engine/vision.py LlavaNextPreprocessor). The tower
and projector run on every tile; the image's features are the whole-image tile's, then the grid's tiles stitched into
one feature map, cropped of the rows or columns that only saw padding (`unpad_image`), each row followed by the learned
`image_newline` vector. So an image's token count follows from its size, as LlavaNextProcessor expands `<image>`; the
text model takes the features at the image tokens' rows as LLaVA-1.5's (`ForwardBatch.image_rows` / `image_embeds`).

Only the "default" feature strategy is built (the class token dropped), as every published checkpoint has it: under
"full" a CLIP tile's features hold the class token beside its patch grid, which transformers' own model cannot stitch.

Checkpoint names: LLaVA-1.5's (models/llava.py), and `image_newline` (published checkpoints and what transformers 5
saves) or `model.image_newline` (its module names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.anyres import AnyresLayout
from infer.worker.engine.vision import AnyresPixels, LlavaNextPreprocessor
from infer.worker.models.llava import ClipLlava


class LlavaNextForConditionalGeneration(ClipLlava):
    """LLaVA-NeXT over the paged KV cache: the registry's CausalLM contract (of its language model) plus
    worker/engine/vision.py's VisionModel (`image_token_id`, `image_preprocessor`, `image_placement`: a count from the
    image's size, `encode_image`)."""

    checkpoint_prefix_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.image_newline", "image_newline"),
        *ClipLlava.checkpoint_prefix_renames,
    )

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy != "default":
            raise NotImplementedError(
                f"LLaVA-NeXT with vision_feature_select_strategy {strategy!r} is not supported (only 'default': a CLIP "
                "tile's class token does not fit its feature grid)"
            )
        super().__init__(config, dtype, tp=tp)
        vision = config.vision_config
        self.layout = AnyresLayout.of(
            self.image_size, self.image_size // vision.patch_size, config.image_grid_pinpoints
        )
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size, dtype=dtype))

    def image_preprocessor(self, model_dir: Path | None) -> LlavaNextPreprocessor:
        return LlavaNextPreprocessor.for_model(model_dir, self.layout)

    def image_placement(self, pixels: AnyresPixels) -> tuple[int, None]:
        """The image's tokens (`AnyresLayout.token_count` of its size), at their places in the sequence."""
        return self.layout.token_count(pixels.height, pixels.width), None

    @torch.inference_mode()
    def encode_image(self, pixels: AnyresPixels) -> torch.Tensor:
        """One image's tiles -> its features [token_count, text hidden] in the model's dtype: the whole-image tile's,
        then the grid's feature map unpadded, row by row, each row ended by `image_newline`."""
        rows, cols = self.layout.grid(pixels.height, pixels.width)
        tile, side = self.layout.tile, self.layout.side
        if tuple(pixels.tiles.shape) != (1 + rows * cols, 3, tile, tile):
            raise ValueError(
                f"tiles of shape {tuple(pixels.tiles.shape)}: a {pixels.width}x{pixels.height} image takes "
                f"{1 + rows * cols} tiles of 3x{tile}x{tile} (a {rows}x{cols} grid and the whole image)"
            )
        features = self.projected_features(pixels.tiles)  # [1 + rows * cols, side * side, hidden]
        hidden = features.shape[-1]
        grid = features[1:].view(rows, cols, side, side, hidden).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * side, cols * side, hidden)
        top, kept_rows, left, kept_cols = self.layout.kept_features(pixels.height, pixels.width)
        grid = grid[top : top + kept_rows, left : left + kept_cols]
        newlines = self.image_newline.to(grid.dtype).expand(kept_rows, 1, hidden)
        rows_with_newlines = torch.cat([grid, newlines], dim=1).reshape(kept_rows * (kept_cols + 1), hidden)
        return torch.cat([features[0], rows_with_newlines])
