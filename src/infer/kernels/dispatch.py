"""Which kernel runs each op, chosen once per device: `kernels_for(device)` gives the frozen table the model's
layers, the attention step, the sampler and the MoE experts take their kernels from (each module gets it when it is
built, from the device it is built on; `worker/loading/loader.build_model` builds under that device).

Devices and what they run (an op's table entry; "where it takes": the op's `*_takes` predicate in
kernels/cpu_kernels.py or kernels/quant.py, checked per call, the twin where it says no):

    op                           cuda ("triton")              cpu ("cpu")                              other ("torch")
    rms_norm                     rms_norm_triton              native where it takes, else the twin     the twin
    rotary_embedding             rotary_embedding_triton      native where it takes, else the twin     the twin
    append_kv                    append_kv_triton             native where it takes, else the twin     the twin
    paged_decode_attention       Triton; the twin with sinks  native where it takes, else the twin     the twin
    paged_prefill_attention      Triton; the twin with sinks  native where it takes, else the twin     the twin
    step_graph_decode            Triton (CUDA graph); with    the native operator where it takes,      compiled
                                 sinks the compiled version   else the version written for inductor
    silu_and_mul                 torch (F.silu * up)          native bf16 where it takes, else torch   torch
    quant_matmul (per format)    quant_matmul_triton          native (`quant_matmul_takes`, decided    the twin
                                                              once per weight), else the twin
    fused_experts (MoE)          fused_experts_triton         the twin                                 the twin
    sample                       sample_triton                the twin                                 the twin
    apply_token_bitmask          Triton                       the twin                                 the twin
    row_max (greedy)             torch max                    native fp32 where it takes, else torch   torch max
    lora_rows (a row per slot)   none (stacked matmuls)       native where it takes, else stacked      none

A CPU's native kernels are one build of kernels/cpu/*.c, at the ISA level `cpu_kernels.selected_isa()` picks (the
only reader of the CPU's flags: avx512, with its AVX512-BF16 / VNNI paths where the CPU has them; avx2; generic;
INFER_CPU_ISA picks a lower one); the table records that level (`isa`). Every `*_takes` also answers False where
the library could not be built (`cpu_kernels.native_ready()`), so such a CPU runs the twins. Two CPU kernels have
no twin of the same call and stay with their callers, each decided by its own predicate: the GEMV for a decode's
1-8 bf16 rows (`gemv_takes`, once per weight when worker/models/layers.py's PackedLinear packs it) and the whole
native decode step of a bf16 Llama with dense or quantized linears (worker/models/native_decode.py:
`NativeDecoder.for_model` once per weights, `takes` per step).

"triton" needs a CUDA device with triton installed; INFER_KERNELS=torch makes such a device run the twins
("torch"), to rule out a kernel while debugging. A table does not depend on the dtype: each CPU `*_takes` checks
the tensors' dtypes per call (bf16 / fp32 native, anything else the twin).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from infer.kernels import cpu_kernels
from infer.kernels._triton import HAS_TRITON
from infer.kernels.kv_append import append_kv_cpu, append_kv_torch, append_kv_triton
from infer.kernels.moe import fused_experts_torch, fused_experts_triton
from infer.kernels.paged_attention import (
    DecodePlan,
    paged_decode_attention_compiled,
    paged_decode_attention_cpu,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_prefill_attention_cpu,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)
from infer.kernels.quant import quant_matmul, quant_matmul_takes
from infer.kernels.rmsnorm import rms_norm_cpu, rms_norm_torch, rms_norm_triton
from infer.kernels.rotary import rotary_embedding_cpu, rotary_embedding_torch, rotary_embedding_triton
from infer.kernels.sampling import sample_torch, sample_triton
from infer.kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton
from infer.protocol import env

if TYPE_CHECKING:
    from infer.kernels.quant import QuantWeight

Backend = Literal["triton", "cpu", "torch"]
Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernels:
    """The kernel of each op on one device (module docstring). Each op has the signature of its twin in the
    kernel's module (`op_torch`), plus what is noted here."""

    device_type: str
    backend: Backend
    isa: str | None  # the CPU kernels' ISA level (cpu_kernels.selected_isa); None off the CPU
    rms_norm: Callable[..., Tensor]  # rms_norm_torch's, plus any_rows (rms_norm_cpu)
    rotary_embedding: Callable[..., None]
    append_kv: Callable[..., None]
    paged_decode_attention: Callable[..., Tensor]
    paged_prefill_attention: Callable[..., Tensor]
    # Whether paged_decode_attention runs its kernel for (q, k_cache, block_tables, seq_lens, sinks), not the twin
    # (the attention step plans the twin's tiles only where the twin runs)
    paged_decode_takes: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None], bool]
    # A step graph's decode: (q, k_cache, v_cache, block_tables, seq_lens, scale, split_tokens, window, softcap,
    # sinks) -> out, every row decoding, traceable (worker/engine/attention.py)
    step_graph_decode: Callable[..., Tensor]
    silu_and_mul: Callable[[Tensor], Tensor]  # [..., 2d] (gate | up) -> silu(gate) * up [..., d]
    quant_matmul: Callable[[Tensor, QuantWeight, bool], Tensor]  # (x [M, K], weight, native: quant_matmul_takes)
    quant_matmul_takes: Callable[[QuantWeight], bool]  # asked once per weight (worker/models/layers.py)
    fused_experts: Callable[..., Tensor]
    sample: Callable[..., Tensor]
    apply_token_bitmask: Callable[[Tensor, Tensor, Tensor], None]
    row_max: Callable[[Tensor], tuple[Tensor, Tensor]]  # logits [B, V] -> (max, argmax) as Tensor.max(dim=-1)
    # A LoRA step's delta for one linear, every row by its own adapter slot (cpu_kernels.lora_rows; None where the
    # device has no such kernel: the caller multiplies stacked slots instead), and whether it takes (x, y, a_t, b_t)
    lora_rows: Callable[..., Tensor] | None
    lora_rows_takes: Callable[[Tensor, Tensor, Tensor, Tensor], bool]


def _backend(device: torch.device) -> Backend:
    if device.type == "cuda" and HAS_TRITON and (env.read(env.KERNELS) or "").lower() != "torch":
        return "triton"
    return "cpu" if device.type == "cpu" else "torch"


def kernels_here() -> Kernels:
    """The table of the device modules are being built on (torch's default device, which
    worker/loading/loader.build_model sets): what a layer holds from its construction on."""
    return kernels_for(torch.get_default_device())


def kernels_for(device: torch.device | str) -> Kernels:
    """The table of `device` (one object per device type and backend, built on the first call)."""
    device = torch.device(device)
    return _table(device.type, _backend(device))


@functools.cache
def _table(device_type: str, backend: Backend) -> Kernels:
    if backend == "triton":
        return _triton_table(device_type)
    if backend == "cpu":
        # The library is built (a cold compile cache: ~35 s of a 2-core VM) or loaded now, as the first table is made
        # (the engine's construction), never inside a step: a first step that waited on the build stalled the first
        # request that long, and a pipeline stage's or TP rank's peer gave up on it (--pp-timeout, --tp-timeout).
        # Without a compiler, or with INFER_CPU_KERNELS=0, the kernels' `*_takes` say no and the twins run.
        cpu_kernels.native_ready()
        # the level the native library is built at, chosen once per process as the library is (cpu_kernels)
        return _cpu_table(device_type, cpu_kernels.selected_isa())
    return _twin_table(device_type)


# ---------------------------------------------------------------------------------------------------------
# The ops whose choice differs by backend (the rest are the kernels' own functions)


def _without_any_rows(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """rms_norm_triton / rms_norm_torch with rms_norm_cpu's signature (any_rows only changes the CPU's choice)."""

    def rms_norm(
        x: Tensor,
        weight: Tensor,
        eps: float,
        residual: Tensor | None = None,
        out: Tensor | None = None,
        any_rows: bool = False,
    ) -> Tensor:
        return fn(x, weight, eps, residual, out)

    return rms_norm


def _decode_cuda(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
    num_splits: int | None = None,
    plan: DecodePlan | None = None,
    split_tokens: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Triton's decode attention (paged_decode_attention_cpu's signature), or the twin for a call with sinks
    (Triton computes none)."""
    if sinks is None:
        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, plan, split_tokens, window, softcap
        )
    return _decode_twin(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, plan, None, window, softcap, sinks
    )


def _decode_twin(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    out: Tensor | None = None,
    num_splits: int | None = None,
    plan: DecodePlan | None = None,
    split_tokens: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """The twin with paged_decode_attention_cpu's signature (it reduces each sequence in one pass: no
    split_tokens)."""
    return paged_decode_attention_torch(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_splits, plan, window, softcap, sinks
    )


def _prefill_cuda(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    out: Tensor | None = None,
    max_query_len: int | None = None,
    decode_from: Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Triton's prefill attention (paged_prefill_attention_cpu's signature; `decode_from` is the native CPU
    kernel's), or the twin for a call with sinks (Triton computes none)."""
    if sinks is None:
        return paged_prefill_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, max_query_len, window, softcap
        )
    return _prefill_twin(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        out,
        max_query_len,
        None,
        window,
        softcap,
        sinks,
    )


def _prefill_twin(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    out: Tensor | None = None,
    max_query_len: int | None = None,
    decode_from: Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """The twin with paged_prefill_attention_cpu's signature (`decode_from` is the native kernel's)."""
    return paged_prefill_attention_torch(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, max_query_len, window, softcap, sinks
    )


def _step_graph_decode_cuda(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    split_tokens: int | None,
    window: int,
    softcap: float,
    sinks: Tensor | None,
) -> Tensor:
    """Triton (captured in a CUDA graph); with sinks, the version written for the compiler."""
    if sinks is None:
        return paged_decode_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            split_tokens=split_tokens,
            window=window,
            softcap=softcap,
        )
    return paged_decode_attention_compiled(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)


def _step_graph_decode_cpu(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    split_tokens: int | None,
    window: int,
    softcap: float,
    sinks: Tensor | None,
) -> Tensor:
    """The native decode kernel as an operator where it takes the call, else the version written for inductor
    (it reads K and V in place in the pool)."""
    if cpu_kernels.paged_decode_takes(q, k_cache, block_tables, seq_lens, sinks):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cpu_kernels.paged_decode_cpu_op(q, k_cache, v_cache, block_tables, seq_lens, scale, out, window, softcap, sinks)
        return out
    return paged_decode_attention_compiled(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)


def _step_graph_decode_twin(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    split_tokens: int | None,
    window: int,
    softcap: float,
    sinks: Tensor | None,
) -> Tensor:
    return paged_decode_attention_compiled(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)


def _silu_and_mul_torch(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _silu_and_mul_cpu(x: Tensor) -> Tensor:
    """A CPU's bf16 rows take the native kernel (one pass), the rest torch's two ops."""
    if cpu_kernels.silu_and_mul_takes(x):
        return cpu_kernels.silu_and_mul_native(x)
    return _silu_and_mul_torch(x)


def _quant_matmul_twin(x: Tensor, weight: QuantWeight, native: bool = False) -> Tensor:
    from infer.kernels.quant_triton import quant_matmul_torch  # not imported by CPU workers that need none

    return quant_matmul_torch(x, weight)


def _quant_matmul_triton(x: Tensor, weight: QuantWeight, native: bool = False) -> Tensor:
    from infer.kernels.quant_triton import quant_matmul_triton

    return quant_matmul_triton(x, weight)


def _quant_matmul_cpu(x: Tensor, weight: QuantWeight, native: bool) -> Tensor:
    """The native kernel for bf16 / fp32 rows by a weight it takes (`native`: quant_matmul_takes, asked once per
    weight), else the twin (dequantize, fp32 matmul)."""
    if native and x.dtype in cpu_kernels.NATIVE_DTYPES and x.is_cpu and x.shape[0] > 0:
        return quant_matmul(x if x.stride(1) == 1 else x.contiguous(), weight)
    return _quant_matmul_twin(x, weight)


def _row_max_torch(x: Tensor) -> tuple[Tensor, Tensor]:
    top, ids = x.max(dim=-1)
    return top, ids


def _row_max_cpu(x: Tensor) -> tuple[Tensor, Tensor]:
    return cpu_kernels.row_max(x) if cpu_kernels.row_max_takes(x) else _row_max_torch(x)


def _never(*args: Any) -> bool:
    return False


def _decode_takes_cuda(q: Tensor, k_cache: Tensor, tables: Tensor, lens: Tensor, sinks: Tensor | None) -> bool:
    return sinks is None


# ---------------------------------------------------------------------------------------------------------
# The tables


def _triton_table(device_type: str) -> Kernels:
    return Kernels(
        device_type=device_type,
        backend="triton",
        isa=None,
        rms_norm=_without_any_rows(rms_norm_triton),
        rotary_embedding=rotary_embedding_triton,
        append_kv=append_kv_triton,
        paged_decode_attention=_decode_cuda,
        paged_prefill_attention=_prefill_cuda,
        paged_decode_takes=_decode_takes_cuda,
        step_graph_decode=_step_graph_decode_cuda,
        silu_and_mul=_silu_and_mul_torch,
        quant_matmul=_quant_matmul_triton,
        quant_matmul_takes=quant_matmul_takes,
        fused_experts=fused_experts_triton,
        sample=sample_triton,
        apply_token_bitmask=apply_token_bitmask_triton,
        row_max=_row_max_torch,
        lora_rows=None,
        lora_rows_takes=_never,
    )


def _cpu_table(device_type: str, isa: str | None) -> Kernels:
    return Kernels(
        device_type=device_type,
        backend="cpu",
        isa=isa,
        rms_norm=rms_norm_cpu,
        rotary_embedding=rotary_embedding_cpu,
        append_kv=append_kv_cpu,
        paged_decode_attention=paged_decode_attention_cpu,
        paged_prefill_attention=paged_prefill_attention_cpu,
        paged_decode_takes=cpu_kernels.paged_decode_takes,
        step_graph_decode=_step_graph_decode_cpu,
        silu_and_mul=_silu_and_mul_cpu,
        quant_matmul=_quant_matmul_cpu,
        quant_matmul_takes=quant_matmul_takes,
        fused_experts=fused_experts_torch,
        sample=sample_torch,
        apply_token_bitmask=apply_token_bitmask_torch,
        row_max=_row_max_cpu,
        lora_rows=cpu_kernels.lora_rows,
        lora_rows_takes=cpu_kernels.lora_rows_takes,
    )


def _twin_table(device_type: str) -> Kernels:
    return Kernels(
        device_type=device_type,
        backend="torch",
        isa=None,
        rms_norm=_without_any_rows(rms_norm_torch),
        rotary_embedding=rotary_embedding_torch,
        append_kv=append_kv_torch,
        paged_decode_attention=_decode_twin,
        paged_prefill_attention=_prefill_twin,
        paged_decode_takes=_never,
        step_graph_decode=_step_graph_decode_twin,
        silu_and_mul=_silu_and_mul_torch,
        quant_matmul=_quant_matmul_twin,
        quant_matmul_takes=_never,
        fused_experts=fused_experts_torch,
        sample=sample_torch,
        apply_token_bitmask=apply_token_bitmask_torch,
        row_max=_row_max_torch,
        lora_rows=None,
        lora_rows_takes=_never,
    )


__all__ = ["Backend", "Kernels", "kernels_for", "kernels_here"]
