"""Rotary position embedding of q and k, in place, from a precomputed cos/sin cache.

The cache (vLLM's layout) is [max_positions, rot_dim] float32: row p holds cos(p * inv_freq) in its first
half and sin(p * inv_freq) in its second, both times the rope type's attention scaling. Here rot_dim is the
whole head dim (no partial rotary). Each pair (x1, x2) of a head becomes
(x1 cos - x2 sin, x2 cos + x1 sin), computed in float32 and rounded once to the storage dtype:

- neox style (Llama family): x1 = x[..., :D/2], x2 = x[..., D/2:];
- GPT-J style: x1 = x[..., 0::2], x2 = x[..., 1::2].

q and k may be views into the fused qkv projection output ([T, (Hq + 2 Hk) D] split and viewed as heads):
any token and head strides, unit stride along the head dim. Positions must lie in the cache (not checked:
the check would cost a device sync; the twin's index_select raises, the kernel would read out of bounds).
"""

from __future__ import annotations

import torch

from infer.kernels._triton import tl, triton
from infer.kernels.cpu_kernels import rotary_native, rotary_takes


def build_cos_sin_cache(
    inv_freq: torch.Tensor,  # [rot_dim / 2] float32
    attention_scaling: float,
    max_positions: int,
) -> torch.Tensor:  # [max_positions, rot_dim] float32, on inv_freq's device
    """cos | sin of position * inv_freq, scaled. The angle is the float32 product, as in transformers."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    angles = torch.outer(positions, inv_freq.float())
    return torch.cat((angles.cos(), angles.sin()), dim=-1).mul_(attention_scaling)


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos_sin_cache: torch.Tensor) -> None:
    q_shape, cache_shape = q.shape, cos_sin_cache.shape  # (read once: this runs per layer on the CPU path)
    if len(q_shape) != 3 or q_shape[0] != positions.shape[0] or q.stride(2) != 1:
        raise ValueError(
            f"q {tuple(q_shape)} (strides {q.stride()}) must be [T, heads, head_dim] with T = "
            f"{positions.shape[0]} positions and a unit stride along the head dim"
        )
    if k is not None:
        k_shape = k.shape
        if (
            len(k_shape) != 3
            or k_shape[0] != q_shape[0]
            or k_shape[2] != q_shape[2]
            or k.stride(2) != 1
            or k.dtype != q.dtype
        ):
            raise ValueError(
                f"k {tuple(k_shape)} {k.dtype} (strides {k.stride()}) must be [T, heads, head_dim] "
                f"like q {tuple(q_shape)} {q.dtype}, with a unit stride along the head dim"
            )
    if len(cache_shape) != 2 or cache_shape[1] != q_shape[2] or q_shape[2] % 2:
        raise ValueError(
            f"cos_sin_cache {tuple(cache_shape)} must be [max_positions, head_dim] with an even head_dim {q_shape[2]}"
        )
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32, got {cos_sin_cache.dtype}")


def _heads_together(q: torch.Tensor, k: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """q and k as one [T, Hq + Hk, D] view when they share a storage and k's heads directly follow q's with
    the same strides (q and k split from the fused qkv output), else the tensors to rotate one by one.
    Halves the number of elementwise calls at decode sizes, where their overhead dominates."""
    if k is None:
        return (q,)
    if torch.compiler.is_compiling():  # data_ptr cannot be traced; the compiler fuses the two anyway
        return (q, k)
    (num_tokens, num_q_heads, head_dim), q_strides, k_strides = q.shape, q.stride(), k.stride()
    num_heads, q_offset, k_offset = num_q_heads + k.shape[1], q.storage_offset(), k.storage_offset()
    if (
        q_strides[1] == head_dim == k_strides[1]
        and k_offset == q_offset + num_q_heads * head_dim
        and (num_tokens == 1 or k_strides[0] == q_strides[0] >= num_heads * head_dim)
        and q.data_ptr() - k.data_ptr() == (q_offset - k_offset) * q.element_size()
    ):  # one storage
        return (q.as_strided((num_tokens, num_heads, head_dim), q_strides),)
    return (q, k)


def rotary_embedding_torch(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor | None,  # [T, Hk, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32
    is_neox: bool,
) -> None:
    """The twin. Both styles run the same code on a [T, heads, 2, D/2] view whose axis 2 picks x1 or x2."""
    _check(positions, q, k, cos_sin_cache)
    num_tokens, half = positions.shape[0], q.shape[2] // 2
    cos, sin = cos_sin_cache.index_select(0, positions).view(num_tokens, 1, 2, 1, half).unbind(2)  # [T, 1, 1, D/2]
    for x in _heads_together(q, k):
        if is_neox:
            pairs = x.view(num_tokens, x.shape[1], 2, half)
        else:
            pairs = x.view(num_tokens, x.shape[1], half, 2).transpose(2, 3)
        x_sin = pairs.float()  # a copy, except for float32 x: then x itself, overwritten below anyway
        rotated = x_sin * cos
        x_sin.mul_(sin)
        (x1_cos, x2_cos), (x1_sin, x2_sin) = rotated.unbind(2), x_sin.unbind(2)
        x1_cos.sub_(x2_sin)  # x1 cos - x2 sin
        x2_cos.add_(x1_sin)  # x2 cos + x1 sin
        pairs.copy_(rotated)


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's first head
    head_stride,
    num_heads,
    x1_offsets,  # [BLOCK_D] offsets of x1 within a head (x2 at x2_offsets)
    x2_offsets,
    d_mask,
    cos,  # [BLOCK_D] float32
    sin,
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    for first in range(0, num_heads, BLOCK_H):
        head = first + heads
        mask = (head < num_heads)[:, None] & d_mask[None, :]
        head_ptr = x_ptr + head.to(tl.int64)[:, None] * head_stride
        x1 = tl.load(head_ptr + x1_offsets[None, :], mask=mask, other=0.0)
        x2 = tl.load(head_ptr + x2_offsets[None, :], mask=mask, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(head_ptr + x1_offsets[None, :], (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
        tl.store(head_ptr + x2_offsets[None, :], (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T]
    q_ptr,  # [T, Hq, D]
    q_token_stride,
    q_head_stride,
    num_q_heads,
    k_ptr,  # [T, Hk, D] (unused unless HAS_K)
    k_token_stride,
    k_head_stride,
    num_k_heads,
    cache_ptr,  # [max_positions, D] float32
    cache_stride,
    HALF: tl.constexpr,  # D / 2
    BLOCK_D: tl.constexpr,  # power of two >= HALF
    BLOCK_H: tl.constexpr,  # heads per tile
    IS_NEOX: tl.constexpr,
    HAS_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + position * cache_stride + d, mask=d_mask, other=0.0)
    sin = tl.load(cache_ptr + position * cache_stride + HALF + d, mask=d_mask, other=0.0)
    if IS_NEOX:
        x1_offsets, x2_offsets = d, d + HALF
    else:
        x1_offsets, x2_offsets = 2 * d, 2 * d + 1
    _rotate_heads(
        q_ptr + token * q_token_stride, q_head_stride, num_q_heads, x1_offsets, x2_offsets, d_mask, cos, sin, BLOCK_H
    )
    if HAS_K:
        _rotate_heads(
            k_ptr + token * k_token_stride,
            k_head_stride,
            num_k_heads,
            x1_offsets,
            x2_offsets,
            d_mask,
            cos,
            sin,
            BLOCK_H,
        )


def rotary_embedding_triton(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor | None,  # [T, Hk, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32
    is_neox: bool,
) -> None:
    """One program per token: its cos/sin row is loaded once and applied to all of its q and k heads."""
    _check(positions, q, k, cos_sin_cache)
    num_tokens, half = positions.shape[0], q.shape[2] // 2
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(half)
    num_heads = max(q.shape[1], k.shape[1] if k is not None else 0)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_d))
    k_args = (k, k.stride(0), k.stride(1), k.shape[1]) if k is not None else (q, 0, 0, 0)
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        q.stride(0),
        q.stride(1),
        q.shape[1],
        *k_args,
        cos_sin_cache,
        cos_sin_cache.stride(0),
        HALF=half,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        IS_NEOX=is_neox,
        HAS_K=k is not None,
    )


def rotary_embedding_cpu(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos_sin_cache: torch.Tensor, is_neox: bool
) -> None:
    """A CPU's rotary embedding (kernels/dispatch.py): the native kernel where it takes the arguments
    (kernels/cpu_kernels.py), else the twin (see `rotary_embedding_torch` for shapes)."""
    if rotary_takes(positions, q, cos_sin_cache) and (k is None or rotary_takes(positions, k, cos_sin_cache)):
        _check(positions, q, k, cos_sin_cache)
        for x in (q, k) if k is not None else (q,):
            rotary_native(positions, x, cos_sin_cache, is_neox)
    else:
        rotary_embedding_torch(positions, q, k, cos_sin_cache, is_neox)


__all__ = ["build_cos_sin_cache", "rotary_embedding_cpu", "rotary_embedding_torch", "rotary_embedding_triton"]
