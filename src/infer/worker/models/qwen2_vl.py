"""Qwen2-VL and Qwen2.5-VL (transformers' Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration): a
vision transformer over an image's 14x14 patches at its own resolution, merged 2x2 into the language model's
tokens, and our Llama-family language model (Qwen2's layers) with M-RoPE.

- The vision tower: a Conv3d patch embedding (a still image is its frame repeated over the temporal patch of 2), 2D
  rotary embeddings in its attention (a patch's row rotates half of each head, its column the other half),
  bidirectional attention over the image's patches; Qwen2-VL's blocks are LayerNorm + a fc1/fc2 MLP, Qwen2.5-VL's
  RMSNorm + a gated (SwiGLU) MLP, with windowed attention (windows of `window_size` pixels) in all blocks but
  `fullatt_block_indexes`; then the patch merger (norm, 2x2 patches concatenated, a two-layer GELU MLP).
- The language model: `LlamaForCausalLM` with `MRotaryEmbedding` (worker/models/layers.py): each token's three
  positions come from worker/engine/vision.py's `step_mrope_positions` (`ForwardBatch.mrope_positions`), the features go
  in at the image tokens' rows (`ForwardBatch.image_rows` / `image_embeds`), as LLaVA's.
- Preprocessing is worker/engine/vision.py's `Qwen2VLPreprocessor` (transformers' Qwen2VLImageProcessor).

With tensor parallelism the language model is sharded as Qwen2's; the vision tower is whole on every rank and runs
on rank 0 only, whose features and M-RoPE positions the other ranks take with each step
(worker/parallel/tp_commands.py).

Not supported, refused by name: videos (`multi_modal_data` takes images only; a prompt holding the video token is
refused). Step graphs are off for these models (a graph's decode rows carry no per-request position delta): every
step runs eagerly, decodes on the CPU's native step still.

Checkpoint names: what transformers saves (`model.*`, `lm_head.*`, `visual.*`) and its module names
(`model.language_model.*`, `model.visual.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.vision import Qwen2VLPreprocessor
from infer.worker.models.layers import ColumnLinear, MergedColumnLinear, MRotaryEmbedding, RMSNorm
from infer.worker.models.llama import LlamaForCausalLM, LlamaModel
from infer.worker.models.llava import activation

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of one image's patches (q, k, v fused as `qkv`), q and k rotated
    by the patches' 2D rotary embedding in float32."""

    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ColumnLinear(dim, 3 * dim, True, dtype)
        self.proj = ColumnLinear(dim, dim, True, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """x [L, dim], cos / sin [L, head_dim], `bounds` the segments' cumulative lengths (0 first, L last)."""
        length = x.shape[0]
        q, k, v = self.qkv(x).view(length, 3, self.num_heads, self.head_dim).unbind(1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        out = torch.empty_like(q)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            if lo < hi:
                seg = [t[lo:hi].transpose(0, 1) for t in (q, k, v)]  # [heads, n, head_dim]
                out[lo:hi] = F.scaled_dot_product_attention(*seg).transpose(0, 1)
        return self.proj(out.reshape(length, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL's: fc1, the activation, fc2."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnLinear(dim, hidden, True, dtype)
        self.act = activation(act, "the vision tower's hidden_act")
        self.fc2 = ColumnLinear(hidden, dim, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL's: act(gate) * up, then down (with biases)."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(dim, {"gate": hidden, "up": hidden}, True, dtype)
        self.act = activation(act, "the vision tower's hidden_act")
        self.down_proj = ColumnLinear(hidden, dim, True, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, vision: Any, qwen25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        dim = vision.hidden_size if qwen25 else vision.embed_dim
        self.norm1: nn.Module
        self.norm2: nn.Module
        self.mlp: nn.Module
        if qwen25:
            self.norm1, self.norm2 = RMSNorm(dim, 1e-6, dtype), RMSNorm(dim, 1e-6, dtype)
            self.mlp = VisionGatedMLP(dim, vision.intermediate_size, vision.hidden_act, dtype)
        else:
            self.norm1 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
            self.norm2 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
            self.mlp = VisionMLP(dim, int(dim * vision.mlp_ratio), vision.hidden_act, dtype)
        self.attn = VisionAttention(dim, vision.num_heads, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 block of patches (consecutive in the processor's order) normed, concatenated and projected to one
    language-model token."""

    def __init__(self, dim: int, context_dim: int, merge: int, qwen25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q: nn.Module = (
            RMSNorm(context_dim, 1e-6, dtype) if qwen25 else nn.LayerNorm(context_dim, eps=1e-6, dtype=dtype)
        )
        self.mlp = nn.Sequential(
            ColumnLinear(self.hidden, self.hidden, True, dtype), nn.GELU(), ColumnLinear(self.hidden, dim, True, dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel is its stride: each patch [C, T, P, P] to one vector."""

    def __init__(self, channels: int, dim: int, kernel: tuple[int, int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.size = kernel[1:]
        self.proj = nn.Conv3d(channels, dim, kernel, kernel, bias=False, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [L, C, T, P, P] -> [L, dim]."""
        return self.proj(patches.to(self.proj.weight.dtype)).view(patches.shape[0], -1)


class QwenVisionTransformer(nn.Module):
    """The vision tower of one image: patches [rows, cols, merge, merge, patch_dim] -> [rows * cols, text hidden]."""

    inv_freq: torch.Tensor

    def __init__(self, vision: Any, qwen25: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.qwen25 = qwen25
        dim = vision.hidden_size if qwen25 else vision.embed_dim
        out_dim = vision.out_hidden_size if qwen25 else vision.hidden_size
        self.in_channels, self.patch_size = int(getattr(vision, "in_channels", 3)), int(vision.patch_size)
        self.temporal_patch_size, self.merge = int(vision.temporal_patch_size), int(vision.spatial_merge_size)
        self.window_size = int(getattr(vision, "window_size", 0) or 0)
        self.full_blocks = frozenset(getattr(vision, "fullatt_block_indexes", None) or ()) if qwen25 else None
        self.patch_embed = PatchEmbed(
            self.in_channels, dim, (self.temporal_patch_size, self.patch_size, self.patch_size), dtype
        )
        self.blocks = nn.ModuleList(VisionBlock(vision, qwen25, dtype) for _ in range(vision.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, qwen25, dtype)
        head_dim = dim // vision.num_heads
        theta = float((getattr(vision, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotary(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [L, head_dim] float32 of the patches in the processor's order (block-major over the merge)."""
        m = self.merge
        h = torch.arange(rows * m).view(rows, m, 1, 1).expand(rows, m, cols, m)
        w = torch.arange(cols * m).view(1, 1, cols, m).expand(rows, m, cols, m)
        h, w = (t.permute(0, 2, 1, 3).reshape(-1).to(self.inv_freq.device) for t in (h, w))
        freqs = torch.cat((torch.outer(h.float(), self.inv_freq), torch.outer(w.float(), self.inv_freq)), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _windows(self, rows: int, cols: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows: the order of the merged tokens window by window (row-major windows of `window_size`
        pixels, row-major within each) and the windows' cumulative lengths in patches."""
        side = self.window_size // self.merge // self.patch_size
        if side < 1:
            raise ValueError(f"window_size {self.window_size} is smaller than a merged token's pixels")
        index = torch.arange(rows * cols).view(rows, cols)
        order: list[torch.Tensor] = []
        bounds = [0]
        for top in range(0, rows, side):
            for left in range(0, cols, side):
                window = index[top : top + side, left : left + side].reshape(-1)
                order.append(window)
                bounds.append(bounds[-1] + window.numel() * self.merge * self.merge)
        return torch.cat(order), bounds

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        rows, cols = patches.shape[0], patches.shape[1]
        x = self.patch_embed(patches.reshape(-1, self.in_channels, self.temporal_patch_size, *self.patch_embed.size))
        cos, sin = self._rotary(rows, cols)
        full = [0, x.shape[0]]
        unit = self.merge * self.merge
        order = None
        windows = full
        if self.full_blocks is not None:
            order, windows = self._windows(rows, cols)
            order = order.to(x.device)
            x, cos, sin = (t.view(rows * cols, unit, -1)[order].reshape(x.shape[0], -1) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            bounds = full if self.full_blocks is None or i in self.full_blocks else windows
            x = block(x, cos, sin, bounds)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged


class Qwen2VLTextModel(LlamaModel):
    """Qwen2's layers with M-RoPE."""

    rotary_class: ClassVar[type[MRotaryEmbedding]] = MRotaryEmbedding


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2-VL / Qwen2.5-VL over the paged KV cache: the registry's CausalLM contract (of its language model, whose
    config is `self.config`) plus worker/engine/vision.py's VisionModel; `uses_mrope` tells the model runner to give
    each step M-RoPE's positions."""

    checkpoint_prefix_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    )
    supports_step_graphs: ClassVar[bool] = False  # a graph's decode rows carry no per-request M-RoPE delta
    base_model_class = Qwen2VLTextModel
    uses_mrope: ClassVar[bool] = True

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        qwen25 = config.model_type == "qwen2_5_vl"
        super().__init__(config.text_config, dtype, tp=tp)
        self.vl_config = config
        self.image_token_id: int = int(config.image_token_id)
        video = getattr(config, "video_token_id", None)
        # refused in prompts (worker/engine/intake.py)
        self.video_token_id: int | None = None if video is None else int(video)
        self.visual = QwenVisionTransformer(config.vision_config, qwen25, dtype)

    def image_preprocessor(self, model_dir: Path | None) -> Qwen2VLPreprocessor:
        pre = Qwen2VLPreprocessor.for_model(model_dir, self.vl_config.vision_config)
        visual = self.visual
        if (pre.patch_size, pre.temporal_patch_size, pre.merge_size) != (
            visual.patch_size,
            visual.temporal_patch_size,
            visual.merge,
        ):
            raise ValueError(
                f"the preprocessor's patch {pre.patch_size}, temporal patch {pre.temporal_patch_size} and merge "
                f"{pre.merge_size} differ from the vision tower's ({visual.patch_size}, {visual.temporal_patch_size}, "
                f"{visual.merge})"
            )
        return pre

    def image_placement(self, pixels: torch.Tensor) -> tuple[int, tuple[int, int]]:
        """rows x columns tokens on a grid of rows x columns (Qwen2VLPreprocessor's output shape)."""
        rows, cols = int(pixels.shape[0]), int(pixels.shape[1])
        return rows * cols, (rows, cols)

    def skips_checkpoint_tensor(self, key: str) -> bool:
        return key.endswith("position_ids")

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, rows, cols, merge, merge, patch_dim] (N images of one size) -> [N, rows * cols, hidden]."""
        return torch.stack([self.visual(image) for image in pixels]).to(self.dtype)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's patches [rows, cols, merge, merge, patch_dim] -> [rows * cols, hidden]."""
        return self.encode_images(pixels.unsqueeze(0))[0]
