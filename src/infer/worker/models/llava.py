"""LLaVA-1.5 (transformers' LlavaForConditionalGeneration): a CLIP vision tower, a two-layer GELU projector and our
Llama language model, with each image's features written into the input embeddings at its image tokens.

The vision tower is CLIP's (pre-LN transformer, quick_gelu, a class token); the features are the hidden states after
`vision_feature_layer` layers (-2: all but the last; only those layers are built, the others' tensors skipped), the
class token dropped under the "default" select strategy. The language model is `LlamaForCausalLM` as is: the
features go in through `ForwardBatch.image_rows` / `image_embeds` (worker/engine/vision.py builds them per step), and
the positions are the tokens' places in the sequence. `ClipLlava` is what LLaVA-NeXT (models/llava_next.py) shares
with it: the tower, the projector and the checkpoint names. With tensor parallelism the language model is sharded as
Llama's; the vision tower and projector are whole on every rank and run on rank 0 only, whose features the other
ranks take with each step (worker/parallel/tp_commands.py).

Checkpoint names: what transformers 5 saves (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*`), its module names (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*`) and published LLaVA checkpoints' (`vision_tower.vision_model.*`) all
load (`checkpoint_prefix_renames`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.vision import ClipPreprocessor
from infer.worker.models.layers import ColumnLinear, MergedColumnLinear
from infer.worker.models.llama import LlamaForCausalLM

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str, what: str) -> Any:
    if name not in _ACTIVATIONS:
        raise NotImplementedError(f"{what} {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches (q, k, v fused)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = MergedColumnLinear(hidden, {"q": hidden, "k": hidden, "v": hidden}, True, dtype)
        self.out_proj = ColumnLinear(hidden, hidden, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, L, hidden] -> [N, L, hidden]."""
        n, length, hidden = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x.reshape(n * length, hidden)))
        q, k, v = (t.reshape(n, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n * length, hidden)).view(n, length, hidden)


class ClipMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(config.hidden_act, "the vision tower's hidden_act")
        self.fc1 = ColumnLinear(config.hidden_size, config.intermediate_size, True, dtype)
        self.fc2 = ColumnLinear(config.intermediate_size, config.hidden_size, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = ClipAttention(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = ClipMLP(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size, bias=False, dtype=dtype
        )
        self.num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, config.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] -> [N, 1 + patches, hidden]: the class token, then the patches row by row."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipEncoder(nn.Module):
    def __init__(self, config: Any, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(config, dtype) for _ in range(num_layers))


class ClipVisionTransformer(nn.Module):
    """CLIP's vision transformer up to its `num_layers`-th layer's output (no post-layernorm: LLaVA reads a hidden
    state, not the pooled output)."""

    def __init__(self, config: Any, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = ClipEmbeddings(config, dtype)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.encoder = ClipEncoder(config, num_layers, dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class LlavaProjector(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        text_hidden = config.text_config.hidden_size
        self.linear_1 = ColumnLinear(config.vision_config.hidden_size, text_hidden, bias, dtype)
        self.act = activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = ColumnLinear(text_hidden, text_hidden, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def feature_layers(config: Any) -> int:
    """How many vision layers LLaVA runs: hidden state `vision_feature_layer` of the L + 1 (embeddings, then each
    layer's output) is the output of that many layers."""
    layer = config.vision_feature_layer
    total = config.vision_config.num_hidden_layers
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise NotImplementedError(f"vision_feature_layer {layer!r}: only one feature layer is supported")
    count = total + 1 + layer if layer < 0 else layer
    if not 0 <= count <= total:
        raise ValueError(f"vision_feature_layer {layer} is out of range for {total} vision layers")
    return count


class SquareImages:
    """What a model whose tower takes images of one square size, each `tokens_per_image` tokens, answers the image
    path (worker/engine/vision.py): LLaVA-1.5 and Gemma 3. The model's `encode_images` takes a batch [N, 3, H, W]."""

    image_size: int
    tokens_per_image: int
    encode_images: Callable[[torch.Tensor], torch.Tensor]

    def image_placement(self, pixels: torch.Tensor) -> tuple[int, None]:
        """Every image is `tokens_per_image` tokens, at their places in the sequence."""
        return self.tokens_per_image, None

    def check_pixels(self, pixels: torch.Tensor) -> None:
        """pixels [N, 3, H, W] must be the tower's size (its preprocessor's output)."""
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            size = self.image_size
            raise ValueError(f"pixels of {tuple(pixels.shape[-2:])}: the vision tower takes {size}x{size}")

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's pixels [3, H, W] -> its features [tokens_per_image, text hidden]."""
        return self.encode_images(pixels.unsqueeze(0))[0]


class ClipLlava(LlamaForCausalLM):
    """What LLaVA-1.5 and LLaVA-NeXT (models/llava_next.py) share: a CLIP tower run to its feature layer, the
    projector, the Llama language model (whose config is `self.config`), the image token and the checkpoint names."""

    checkpoint_prefix_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.language_model.", "model."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
    supports_step_graphs: ClassVar[bool] = True  # decode steps hold no image token: the Llama layers' graphs apply

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise NotImplementedError(f"vision_feature_select_strategy {strategy!r} is not supported")
        vision = config.vision_config
        if getattr(vision, "model_type", "clip_vision_model") != "clip_vision_model":
            raise NotImplementedError(f"LLaVA with a {vision.model_type!r} vision tower is not supported (only CLIP)")
        super().__init__(config.text_config, dtype, tp=tp)
        self.llava_config = config
        self.num_vision_layers = feature_layers(config)
        self.drop_class_token = strategy == "default"
        self.vision_tower = ClipVisionTransformer(vision, self.num_vision_layers, dtype)
        self.multi_modal_projector = LlavaProjector(config, dtype)
        self.image_token_id: int = int(getattr(config, "image_token_id", None) or config.image_token_index)
        self.image_size: int = int(vision.image_size)

    def skips_checkpoint_tensor(self, key: str) -> bool:
        """The vision layers past the feature layer, the tower's post-layernorm and its position-id buffer."""
        if key.endswith("position_ids") or ".post_layernorm." in key:
            return True
        marker = ".encoder.layers."
        if "vision_tower." in key and marker in key:
            return int(key.split(marker, 1)[1].split(".", 1)[0]) >= self.num_vision_layers
        return False

    def projected_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, image_size, image_size] -> [N, patches (+ 1 under "full"), text hidden] in the model's
        dtype: the feature layer's hidden states (the class token dropped under "default"), projected."""
        hidden = self.vision_tower(pixels)
        if self.drop_class_token:
            hidden = hidden[:, 1:]
        return self.multi_modal_projector(hidden).to(self.dtype)


class LlavaForConditionalGeneration(SquareImages, ClipLlava):
    """LLaVA-1.5 over the paged KV cache: the registry's CausalLM contract (of its language model, whose config is
    `self.config`) plus worker/engine/vision.py's VisionModel (`image_token_id`, `image_preprocessor`,
    `image_placement`: `tokens_per_image` each, `encode_image`)."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__(config, dtype, tp=tp)
        patches = (self.image_size // config.vision_config.patch_size) ** 2
        self.tokens_per_image: int = patches if self.drop_class_token else patches + 1

    def image_preprocessor(self, model_dir: Path | None) -> ClipPreprocessor:
        return ClipPreprocessor.for_model(model_dir, self.image_size)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] -> features [N, tokens_per_image, text hidden] in the model's dtype."""
        self.check_pixels(pixels)
        return self.projected_features(pixels)
