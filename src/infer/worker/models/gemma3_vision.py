"""Gemma 3 with its vision tower (transformers' Gemma3ForConditionalGeneration, model_type "gemma3"): a SigLIP vision
tower, Gemma 3's multi-modal projector and our Gemma 3 text model, each image's features written into the input
embeddings at its image tokens, and the image's tokens attending to each other both ways.

- SigLIP's tower is CLIP's transformer (the same pre-LN layer: models/llava.py's `ClipEncoder`, run with SigLIP's
  gelu_pytorch_tanh) under other embeddings: the patches with the convolution's bias and learned position
  embeddings, no class token; and a post-layernorm after the last layer. Gemma 3 reads its last hidden state (the
  attention-pooling head, where a config has one, is not run: its tensors are skipped).
- The projector: the patch grid average-pooled to `mm_tokens_per_image` (a square), Gemma's RMSNorm (1 + w), then
  the input projection (a [vision hidden, text hidden] matrix).
- The features replace the *scaled* token embeddings (models/gemma.py `Gemma3Model.forward`: transformers scales the
  embedding and then scatters the features), positions are the tokens' places.
- Logits: the LM head's, with no final soft-capping, as transformers' Gemma3ForConditionalGeneration returns them (its
  text-only Gemma3ForCausalLM caps them where the text config says; published Gemma 3 configs do not).
- Bidirectional attention within an image: transformers masks each layer with OR(causal, same image) (sliding
  layers: AND(that, the window)), the image being a run of image tokens. Here each prefill chunk that computes
  image tokens carries the images' spans (`ForwardBatch.image_spans`, built by worker/engine/vision.py's
  `step_image_spans`) and worker/engine/attention.py recomputes those rows with that mask exactly; the scheduler never
  ends a chunk inside such an image (`SchedulerConfig.whole_images`), so every key an image token needs is in the
  pool or in its chunk.

With tensor parallelism the text model is sharded as Gemma 3's; the vision tower and projector are whole on every
rank and run on rank 0 only, whose features and image spans the other ranks take with each step
(worker/parallel/tp_commands.py).

Checkpoint names: what transformers 5 saves (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`, the
LM head tied), what published Gemma 3 checkpoints hold (the tower under `vision_tower.vision_model.*`) and transformers'
module names (`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.images import Gemma3ImagePrompt
from infer.worker.engine.vision import Gemma3Preprocessor
from infer.worker.models.gemma import Gemma3ForCausalLM, GemmaRMSNorm
from infer.worker.models.llava import ClipEncoder, SquareImages


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size, bias=True, dtype=dtype
        )
        self.num_positions = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_positions, config.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] -> [N, patches, hidden]: the patches row by row, each with its position's embedding."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    """SigLIP's vision transformer: embeddings, CLIP's encoder layers, the post-layernorm (its last hidden state)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config, dtype)
        self.encoder = ClipEncoder(config, config.num_hidden_layers, dtype)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """[N, patches, vision hidden] -> [N, mm_tokens_per_image, text hidden]: average pooling of the patch grid,
    Gemma's RMSNorm, the input projection."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens = int(config.mm_tokens_per_image)
        self.tokens_per_side = round(tokens**0.5)
        if self.tokens_per_side**2 != tokens or self.patches_per_side % self.tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {tokens}: the pooled grid must be a square that divides the "
                f"{self.patches_per_side}x{self.patches_per_side} patch grid"
            )
        self.kernel = self.patches_per_side // self.tokens_per_side
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, config.text_config.hidden_size, dtype=dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, hidden = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(n, hidden, side, side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(SquareImages, Gemma3ForCausalLM):
    """Gemma 3 with images over the paged KV cache: the registry's CausalLM contract (of its text model, whose config
    is `self.config`) plus worker/engine/vision.py's VisionModel (`image_token_id`, `image_preprocessor`,
    `image_placement`, `encode_images`; `bidirectional_images`) and the Gemma 3 prompt form (`image_prompt`: an image is
    "\\n\\n" boi, its image tokens, eoi "\\n\\n": worker/engine/images.py `Gemma3ImagePrompt`)."""

    checkpoint_prefix_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.language_model.", "model."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    supports_step_graphs: ClassVar[bool] = True  # decode steps hold no image token: the Gemma layers' graphs apply
    bidirectional_images: ClassVar[bool] = True  # an image's tokens attend to each other both ways

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        vision = config.vision_config
        if getattr(vision, "model_type", "siglip_vision_model") != "siglip_vision_model":
            raise NotImplementedError(
                f"Gemma 3 with a {vision.model_type!r} vision tower is not supported (only SigLIP)"
            )
        super().__init__(config.text_config, dtype, tp=tp)
        if getattr(config, "tie_word_embeddings", None) is not False and not self.lm_head_tied:
            self.tie_lm_head()  # the top-level config says (Gemma 3 ties by default)
        # transformers' Gemma3ForConditionalGeneration returns the LM head's logits as they are: the text config's
        # final_logit_softcapping (None in published Gemma 3 configs) applies only to its text-only model
        self.final_logit_softcapping = None
        self.gemma3_config = config
        self.vision_tower = SiglipVisionTransformer(vision, dtype)
        self.multi_modal_projector = Gemma3Projector(config, dtype)
        self.image_token_id: int = int(config.image_token_id)
        self.boi_token_id: int = int(config.boi_token_id)
        self.eoi_token_id: int = int(config.eoi_token_id)
        self.image_size: int = int(vision.image_size)
        self.tokens_per_image: int = int(config.mm_tokens_per_image)

    def skips_checkpoint_tensor(self, key: str) -> bool:
        """The tower's position-id buffer and its attention-pooling head (Gemma 3 reads the last hidden state)."""
        return key.endswith("position_ids") or ".head." in key and "vision_tower." in key

    def image_prompt(self, tokenizer: Any) -> Gemma3ImagePrompt:
        """How a prompt holds an image (boi, the image tokens, eoi; worker/engine/images.py)."""
        return Gemma3ImagePrompt.of(
            tokenizer, self.boi_token_id, self.eoi_token_id, self.image_token_id, self.tokens_per_image
        )

    def image_preprocessor(self, model_dir: Path | None) -> Gemma3Preprocessor:
        return Gemma3Preprocessor.for_model(model_dir, self.image_size)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] -> features [N, tokens_per_image, text hidden] in the model's dtype."""
        self.check_pixels(pixels)
        return self.multi_modal_projector(self.vision_tower(pixels)).to(self.dtype)
