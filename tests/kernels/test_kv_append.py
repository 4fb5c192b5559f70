"""KV append by slot mapping, with and without rotary embedding of K: Triton and twin against float64."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, assert_close, requires_triton

from infer.kernels.kv_append import append_kv_torch, append_kv_triton

IMPLS = {"twin": append_kv_torch, "triton": pytest.param(append_kv_triton, marks=requires_triton)}


def _cos_sin_cache(max_positions: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def _rotate64(x: torch.Tensor, positions: torch.Tensor, head_dim: int, is_neox: bool) -> torch.Tensor:
    """The definition in float64: pairs (i, i + D/2) for neox, (2i, 2i + 1) for GPT-J, angle pos * theta_i."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angle = positions.double()[:, None, None] * inv_freq  # [T, 1, D/2]
    x = x.double()
    if is_neox:
        a, b = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()
    if is_neox:
        return torch.cat((ra, rb), dim=-1)
    return torch.stack((ra, rb), dim=-1).flatten(-2)


@pytest.mark.parametrize("impl", list(IMPLS.values()), ids=list(IMPLS))
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rope", [None, "neox", "gptj"])
@pytest.mark.parametrize("shape", [(2, 64), (4, 128), (1, 16)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_append_writes_exactly_the_named_slots(impl, dtype, rope, shape):
    num_kv_heads, head_dim = shape
    num_blocks, block_size, num_tokens = 9, 16, 23
    generator = torch.Generator().manual_seed(zlib.crc32(repr((dtype, rope, shape)).encode()))
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    # distinct random slots anywhere in the pool, some tokens padding (-1)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.tensor([0, 5, 22])] = -1
    positions = torch.randint(0, 4000, (num_tokens,), generator=generator)
    shape4 = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.full(shape4, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape4, float("nan"), dtype=dtype, device=DEVICE)
    k_before = k.clone()
    kwargs = {}
    if rope is not None:
        kwargs = {
            "positions": positions.to(DEVICE),
            "is_neox": rope == "neox",
            "cos_sin_cache": _cos_sin_cache(4096, head_dim).to(DEVICE),
        }
    impl(k, v, k_cache, v_cache, slots.to(DEVICE), **kwargs)

    assert torch.equal(k, k_before), "the input K must not be modified"
    written = slots >= 0
    expected_k = k.double() if rope is None else _rotate64(k, positions.to(DEVICE), head_dim, rope == "neox")
    k_flat, v_flat = k_cache.view(num_kv_heads, -1, head_dim), v_cache.view(num_kv_heads, -1, head_dim)
    target = slots[written].to(DEVICE)
    assert_close(k_flat[:, target].transpose(0, 1), expected_k[written.to(DEVICE)], dtype, "K at its slots")
    assert torch.equal(v_flat[:, target].transpose(0, 1), v[written.to(DEVICE)]), "V is stored bit-exactly"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.isnan(k_flat[:, untouched.to(DEVICE)]).all() and torch.isnan(v_flat[:, untouched.to(DEVICE)]).all(), (
        "a slot outside the mapping (or a padding token's) was written"
    )


@pytest.mark.parametrize("impl", list(IMPLS.values()), ids=list(IMPLS))
def test_append_at_a_slot_past_32_bit_offsets(impl):
    """The last slot of a 4 GiB fp16 pool (untouched pages are never mapped): offsets must be int64."""
    block_size, head_dim, dtype = 16, 64, torch.float16
    num_blocks = (2**31) // (block_size * head_dim) + 2
    k_cache = torch.empty(1, num_blocks, block_size, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    k = torch.randn(2, 1, head_dim).to(dtype).to(DEVICE)
    v = torch.randn(2, 1, head_dim).to(dtype).to(DEVICE)
    last = num_blocks * block_size - 1
    assert last * head_dim > 2**31
    impl(k, v, k_cache, v_cache, torch.tensor([last, 5], device=DEVICE))
    assert torch.equal(k_cache[0, -1, -1], k[0, 0]) and torch.equal(v_cache[0, -1, -1], v[0, 0])
    assert torch.equal(k_cache[0, 0, 5], k[1, 0])


def test_append_rejects_mismatched_shapes():
    cache = torch.zeros(2, 4, 16, 64)
    with pytest.raises(ValueError, match="does not fit the cache"):
        append_kv_torch(torch.zeros(3, 4, 64), torch.zeros(3, 4, 64), cache, cache.clone(), torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping"):
        append_kv_torch(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), cache, cache.clone(), torch.arange(4))
