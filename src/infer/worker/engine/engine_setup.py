"""What an engine is built with, decided before it exists: the device, the dtype (by the CPU's ISA), the context
length and the size of the KV pool. The engine, the TP and PP groups' members and the worker's flags read these;
they import no engine.
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import torch

from infer.worker.engine.config import EngineConfig
from infer.worker.engine.forward_batch import KVCache

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but no CUDA device is available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """`dtype` ("auto": by device; a CPU's rule is in the comment above _cpu_isa). `quantized`: the model's matmuls
    multiply weights kept quantized (`kept_quantized`)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    isa = _cpu_isa()
    bf16 = _cpu_has_native_bf16() or isa == "avx2" or (quantized and isa == "avx512")
    return torch.bfloat16 if bf16 else torch.float32


def kept_quantized(config: EngineConfig) -> bool:
    """Whether the engine's weights will be a GGUF's (its blocks, or a BF16 file's bf16 values) or quantized
    (--quantization int8 / int4, an AWQ / GPTQ checkpoint): their matmuls then run in kernels/cpu/quant.c
    (or the bf16 GEMV), which take bf16 rows natively on AVX2 as well, and no oneDNN bf16 matmul is left to
    emulate; bf16 rows also keep the native decode step (worker/models/native_decode.py)."""
    from infer.worker.loading.awq_gptq import directory_scheme
    from infer.worker.loading.model_files import model_source

    if config.quantization in ("int8", "int4"):
        return True
    if config.quantization == "none":
        return False
    source = model_source(config.model)
    return source.suffix.lower() == ".gguf" or (source.is_dir() and directory_scheme(source) is not None)


# "auto" on a CPU: bf16 where the CPU multiplies bf16 natively (AVX512-BF16, AMX), and on AVX2 machines (Zen 3),
# where oneDNN has no bf16 at all and our kernels multiply every bf16 linear (kernels/cpu/gemv.c's fp32 core: bf16
# weights widened in registers, any number of rows; quant.c for weights kept quantized); fp32 on AVX-512 CPUs
# without BF16 unless the weights are kept quantized (oneDNN emulates bf16 matmuls there; not measured).
# Measured 2026-11-27 on the 2-core Zen 5 VM, avx2 build with torch held to AVX2 (INFER_CPU_ISA=avx2,
# ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2), the embedded SmolLM2-135M dense (quantization "none"), 2
# threads, two alternating rounds: batch-1 decode bf16 143-177 tok/s against fp32 45-46 (half the bytes a token,
# and oneDNN's fp32 GEMV is slower than the native one); a 500-token prefill 623 tok/s against 894-918 (our tiles
# reach ~60% of oneDNN's sgemm); offline 16 x (200 -> 96) 152 against 151 tok/s. A 500-token prompt and 128 tokens
# out: ~1.6 s bf16, ~3.4 s fp32. (Before the GEMV took more than 8 rows and served weights oneDNN cannot pack,
# bf16 prefills ran on ATen's bf16 matmul at 220 tok/s.)
# With INFER_CPU_ISA set below avx512 the engine computes as such a CPU would (the kernels' build, and this choice).
def _cpu_isa() -> str:
    from infer.kernels.cpu_kernels import selected_isa

    return selected_isa()


def _cpu_has_native_bf16() -> bool:
    from infer.kernels.cpu_kernels import native_bf16

    return native_bf16()


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def context_length(config: EngineConfig, hf_config) -> int:
    # Whisper's decoder names its learned positions max_target_positions
    named = getattr(hf_config, "max_position_embeddings", 0) or getattr(hf_config, "max_target_positions", 0)
    model_max = int(named or 0) or 4096
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {model_max}")
    return config.max_model_len


def release_window(model: torch.nn.Module) -> int:
    """The scheduler's release window (SchedulerConfig.release_window): the largest of the model's sliding windows
    when every layer has one (`layer_windows`), else 0 (a full-attention layer needs every block)."""
    windows = tuple(getattr(model, "layer_windows", ()))
    return max(windows) if windows and all(windows) else 0


def shares_kv(model: object) -> bool:
    """Whether the model's V is its K (`kv_shared`: MLA's latent row), stored once in the pool."""
    return bool(getattr(model, "kv_shared", False))


class KVGeometry(Protocol):
    """What sizes a model's KV pool: this rank's (or pipeline stage's) layers, KV heads and head size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def num_kv_blocks(
    config: EngineConfig, model: KVGeometry, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> int:
    """Blocks of the KV pool: `config.kv_cache_memory` (else its fraction of the memory) over the bytes of one
    block of this rank's KV heads, at most what max_num_seqs full-length sequences can use."""
    per_block = KVCache.bytes_per_block(
        model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, dtype, shares_kv(model)
    )
    budget = config.kv_cache_memory
    if budget is None:
        budget = int(_memory_bytes(device) * config.kv_cache_memory_fraction)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget} bytes is too small for one KV block: a block of {config.block_size} "
            f"tokens needs {per_block} bytes ({model.num_layers} layers x K and V x "
            f"{model.num_kv_heads} KV heads x head_dim {model.head_dim} x "
            f"{torch.empty((), dtype=dtype).element_size()} bytes)"
        )
    # More blocks than max_num_seqs full-length sequences can use would only waste memory.
    per_seq = math.ceil(max_model_len / config.block_size)
    if getattr(model, "is_encoder_decoder", False):  # + its cross-attention blocks over the longest encoder input
        encoder_len = getattr(model, "max_encoder_len", None) or max_model_len
        per_seq += math.ceil(min(encoder_len, max_model_len) / config.block_size)
    useful = config.max_num_seqs * per_seq + 1
    return int(min(num_blocks, useful))
