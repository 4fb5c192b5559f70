"""Which of our model classes implements a transformers config, and the contract they all meet."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.models.bart import BartForConditionalGeneration
from infer.worker.models.deepseek import DeepseekV2ForCausalLM
from infer.worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from infer.worker.models.gemma3_vision import Gemma3ForConditionalGeneration
from infer.worker.models.gpt_oss import GptOssForCausalLM
from infer.worker.models.idefics3 import Idefics3ForConditionalGeneration
from infer.worker.models.llama import LlamaForCausalLM
from infer.worker.models.llava import LlavaForConditionalGeneration
from infer.worker.models.llava_next import LlavaNextForConditionalGeneration
from infer.worker.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from infer.worker.models.phi3 import Phi3ForCausalLM
from infer.worker.models.qwen2_vl import Qwen2VLForConditionalGeneration
from infer.worker.models.t5 import T5ForConditionalGeneration
from infer.worker.models.whisper import WhisperForConditionalGeneration


class CausalLM(Protocol):
    """What the model runner relies on.

    Construction: `cls(config, dtype)` under a `torch.device` scope (MoE classes, which set
    `supports_expert_parallel = True`, take `cls(config, dtype, ep=ExpertParallel)` and hold only
    `ep.expert_range(num_experts)`); parameters are empty until the loader fills them. Names follow
    transformers' modules, except where class attributes say otherwise (see `infer.worker.loading.loader`):
    `packed_modules_mapping` maps a checkpoint module name to (our fused module, shard); MoE classes add
    `expert_modules_mapping` (per-expert checkpoint module -> (fused expert parameter, projection)) and
    optionally `checkpoint_module_renames` (checkpoint module name -> ours).
    `forward` reads batch.input_ids / positions, writes each layer's new K, V into kv_cache at
    batch.slot_mapping and returns hidden states [T, hidden]; `compute_logits` takes rows of them
    (hidden[batch.logits_indices]) to float32 logits [N, vocab]. KV cache tensors have the model's dtype and
    shape [num_kv_heads, num_blocks, block_size, head_dim], one K and one V per layer.
    """

    config: Any
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    packed_modules_mapping: dict[str, tuple[str, str]]

    def __call__(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor: ...

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def tie_lm_head(self) -> None: ...


MODEL_TYPES: dict[str, type] = {
    "bart": BartForConditionalGeneration,
    "t5": T5ForConditionalGeneration,
    "whisper": WhisperForConditionalGeneration,
    "llama": LlamaForCausalLM,
    "llava": LlavaForConditionalGeneration,
    "llava_next": LlavaNextForConditionalGeneration,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2VLForConditionalGeneration,
    "qwen3": LlamaForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV2ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma3": Gemma3ForConditionalGeneration,
    "gpt_oss": GptOssForCausalLM,
    "idefics3": Idefics3ForConditionalGeneration,
    "smolvlm": Idefics3ForConditionalGeneration,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}

ARCHITECTURES: dict[str, type] = {
    "BartForConditionalGeneration": BartForConditionalGeneration,
    "T5ForConditionalGeneration": T5ForConditionalGeneration,
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "SmolVLMForConditionalGeneration": Idefics3ForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(config: Any) -> type:
    """Our class for `config`, by model_type, else by its `architectures`; ValueError if none fits."""
    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    for arch in getattr(config, "architectures", None) or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported model: model_type {model_type!r}, architectures "
        f"{getattr(config, 'architectures', None)}; supported model types: "
        f"{', '.join(sorted(MODEL_TYPES))}"
    )
