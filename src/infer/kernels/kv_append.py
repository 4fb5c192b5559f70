"""KV append: store the new tokens' K and V into the paged pool by slot, optionally rotating K on the way.

The pool of one layer, K and V alike, is [Hkv, num_blocks, block_size, D] (head-major: one KV head's block is
a contiguous [block_size, D] tile, and one head's blocks gathered in table order are directly the [L, D]
operand of a matmul). Token t goes to slot_mapping[t] = block * block_size + offset; slot -1 is padding and
is skipped. With `cos_sin_cache`, K is rotated (rotary embedding at `positions`) as it is stored; the input
`k` is not modified.
"""

from __future__ import annotations

import torch

from infer.kernels._triton import tl, triton
from infer.kernels.cpu_kernels import append_kv_native, append_kv_takes


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
) -> None:
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            f"caches must both be [Hkv, num_blocks, block_size, D], got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    if (k_cache.shape[0], k_cache.shape[3]) != (k.shape[1], k.shape[2]):
        raise ValueError(f"k {tuple(k.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if cos_sin_cache is not None:
        if positions is None or positions.shape != (k.shape[0],):
            raise ValueError("rotating K needs positions of shape [T]")
        if cos_sin_cache.shape[1] != k.shape[2]:
            raise ValueError(
                f"cos_sin_cache rotates {cos_sin_cache.shape[1]} dims; head_dim is {k.shape[2]} "
                "(partial rotary is not supported)"
            )


# ---------------------------------------------------------------------------------------------------------
# The twin


def append_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    is_neox: bool = True,
    pad_slot: int | None = None,
) -> None:
    """k, v [T, Hkv, D]; caches [Hkv, NB, bs, D]; slot_mapping [T] int64 (-1 = skip); positions [T] int64;
    cos_sin_cache [P, D] float32 (cos | sin halves). Writes the caches in place.

    `pad_slot` (a slot no sequence owns, e.g. KVCache.pad_slot): padding rows are written there instead of
    being filtered out, which needs no host sync (the form step graphs compile). The Triton kernel skips
    slot -1 without a sync and ignores it."""
    _check(k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache)
    if cos_sin_cache is not None and positions is not None:  # (_check: positions come with the cache)
        k = _rotated(k, positions, cos_sin_cache, is_neox)
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    if pad_slot is not None:
        slot_mapping = torch.where(slot_mapping < 0, pad_slot, slot_mapping)
    elif bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    k_slots = k_cache.view(num_kv_heads, -1, head_dim)  # [Hkv, NB * bs, D]
    v_slots = v_cache.view(num_kv_heads, -1, head_dim)
    k_slots.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_slots.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def _rotated(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [T, heads, D] rotated at `positions` (float32 math, one rounding), a new tensor."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    xf = x.float()
    if is_neox:
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Triton


@triton.jit
def _append_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    pos_ptr,
    cos_sin_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_cs,  # the caches' strides (K and V share them; D is contiguous)
    stride_cos,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    # grid: (T, Hkv). One program stores one token's K and V row of one KV head.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = head * stride_ch + block * stride_cb + offset * stride_cs
    k_row = k_ptr + token * stride_kt + head * stride_kh
    v_row = v_ptr + token * stride_vt + head * stride_vh
    half = HEAD_DIM // 2
    i = tl.arange(0, HALF_PAD)
    mask = i < half
    # the row as two halves: neox rotates (x[:half], x[half:]); GPT-J rotates (x[0::2], x[1::2])
    if IS_NEOX:
        first = i
        second = i + half
    else:
        first = 2 * i
        second = 2 * i + 1
    k1 = tl.load(k_row + first, mask=mask)
    k2 = tl.load(k_row + second, mask=mask)
    if ROPE:
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cos + i, mask=mask)
        sin = tl.load(cos_sin_ptr + pos * stride_cos + half + i, mask=mask)
        x1, x2 = k1.to(tl.float32), k2.to(tl.float32)
        k1 = x1 * cos - x2 * sin
        k2 = x2 * cos + x1 * sin
    out_type = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst + first, k1.to(out_type), mask=mask)
    tl.store(k_cache_ptr + dst + second, k2.to(out_type), mask=mask)
    tl.store(v_cache_ptr + dst + first, tl.load(v_row + first, mask=mask).to(out_type), mask=mask)
    tl.store(v_cache_ptr + dst + second, tl.load(v_row + second, mask=mask).to(out_type), mask=mask)


def append_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    is_neox: bool = True,
    pad_slot: int | None = None,
) -> None:
    """Same contract as `append_kv_torch` (padding rows are always skipped: `pad_slot` is not needed)."""
    _check(k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache)
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("append_kv_triton needs a contiguous head dim and K/V caches of the same strides")
    num_tokens, num_kv_heads, head_dim = k.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if num_tokens == 0:
        return
    rope = cos_sin_cache is not None
    _append_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        positions if rope else slot_mapping,
        cos_sin_cache if rope else k,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        cos_sin_cache.stride(0) if cos_sin_cache is not None else 0,
        BLOCK_SIZE=k_cache.shape[2],
        HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        ROPE=rope,
        IS_NEOX=is_neox,
    )


def append_kv_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    is_neox: bool = True,
    pad_slot: int | None = None,
) -> None:
    """A CPU's KV append (kernels/dispatch.py): the native kernel where it takes the arguments
    (kernels/cpu_kernels.py), else the twin (see `append_kv_torch` for the contract)."""
    if append_kv_takes(k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache):
        _check(k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache)
        append_kv_native(k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, is_neox, pad_slot)
    else:
        append_kv_torch(k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, is_neox, pad_slot)
