"""Rotary embedding of q and k in place: the Triton kernel and the twin against float64; the cos/sin cache.

q and k are views into a fused qkv buffer (token stride (Hq + 2 Hk) D), as the model hands them over, with
v poisoned (NaN): it must stay untouched. Positions are random, unsorted and repeated.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, assert_close, requires_triton

from infer.kernels.rotary import (
    build_cos_sin_cache,
    rotary_embedding_cpu,
    rotary_embedding_torch,
    rotary_embedding_triton,
)

TWIN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # the twin is the CPU path, bf16 included
MAX_POSITIONS = 4096


def cache_for(head_dim: int, theta: float = 10000.0, scaling: float = 1.0) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=DEVICE) / head_dim))
    return build_cos_sin_cache(inv_freq, scaling, MAX_POSITIONS)


def rotate64(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [T, heads, D] rotated in float64 by the cache's rows: pairs (i, i + D/2) or (2i, 2i + 1)."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin_cache.double()[positions][:, None].split(half, dim=-1)  # [T, 1, D/2]
    x = x.double()
    x1, x2 = (x[..., :half], x[..., half:]) if is_neox else (x[..., 0::2], x[..., 1::2])
    out = torch.empty_like(x)
    o1, o2 = (out[..., :half], out[..., half:]) if is_neox else (out[..., 0::2], out[..., 1::2])
    o1.copy_(x1 * cos - x2 * sin)
    o2.copy_(x2 * cos + x1 * sin)
    return out


def heads_of(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """q, k, v [T, heads, D]: views of qkv [T, (Hq + 2 Hk) D], as the model splits its qkv projection."""
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    return [t.view(qkv.shape[0], -1, head_dim) for t in qkv.split(sizes, dim=-1)]


def fused_qkv(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """qkv [T, (Hq + 2 Hk) D] of random values and its q, k, v views; v is NaN."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g, device=DEVICE)
    qkv = qkv.mul_(2).to(dtype)
    q, k, v = heads_of(qkv, num_heads, num_kv_heads, head_dim)
    v.fill_(float("nan"))
    return qkv, q, k, v


def random_positions(num_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=g, device=DEVICE)
    if num_tokens > 3:
        positions[:3] = torch.tensor([MAX_POSITIONS - 1, 0, int(positions[3])])  # the ends, and a repeat
    return positions


def check(
    op, num_tokens: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, is_neox: bool, seed: int
) -> None:
    _, q, k, v = fused_qkv(num_tokens, *heads, head_dim, dtype, seed)
    positions, cache = random_positions(num_tokens, seed), cache_for(head_dim, theta=[1e4, 1e6][seed % 2])
    expected_q, expected_k = rotate64(q, positions, cache, is_neox), rotate64(k, positions, cache, is_neox)
    op(positions, q, k, cache, is_neox)
    assert_close(q, expected_q, dtype, "q")
    assert_close(k, expected_k, dtype, "k")
    assert torch.isnan(v).all(), "v was written"


STYLES = {"neox": True, "gptj": False}


@pytest.fixture
def seed(request) -> int:
    """A different, reproducible seed for every test case (from its id): fresh inputs per case."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.mark.parametrize("dtype", TWIN_DTYPES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("head_dim, heads", [(16, (5, 1)), (64, (9, 3)), (128, (4, 4))])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_twin_matches_float64(
    num_tokens: int, head_dim: int, heads: tuple[int, int], style: str, dtype: torch.dtype, seed: int
) -> None:
    check(rotary_embedding_torch, num_tokens, heads, head_dim, dtype, STYLES[style], seed)


@requires_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(
    "num_tokens, head_dim, heads", [(37, 16, (5, 1)), (37, 64, (9, 3)), (1, 128, (4, 4)), (3, 128, (72, 8))]
)
def test_triton_matches_float64_and_twin(
    num_tokens: int, head_dim: int, heads: tuple[int, int], style: str, dtype: torch.dtype, seed: int
) -> None:
    """72 query heads at D = 128 take two head tiles per token in the kernel (64 heads per tile)."""
    check(rotary_embedding_triton, num_tokens, heads, head_dim, dtype, STYLES[style], seed)
    qkv, q, k, _ = fused_qkv(num_tokens, *heads, head_dim, dtype, seed + 1)
    twin_q, twin_k, _ = heads_of(qkv.clone(), *heads, head_dim)
    positions, cache = random_positions(num_tokens, seed + 2), cache_for(head_dim)
    rotary_embedding_triton(positions, q, k, cache, STYLES[style])
    rotary_embedding_torch(positions, twin_q, twin_k, cache, STYLES[style])
    assert_close(q, twin_q, dtype, "triton vs twin, q")
    assert_close(k, twin_k, dtype, "triton vs twin, k")


@pytest.mark.parametrize("op", [rotary_embedding_torch, pytest.param(rotary_embedding_triton, marks=requires_triton)])
@pytest.mark.parametrize("style", STYLES)
def test_separate_strided_buffers_and_no_k(op, style: str, seed: int) -> None:
    """q and k in buffers of their own, token strides padded past heads * D (so the twin cannot treat them
    as one view); then q alone (k None)."""
    dtype, num_tokens, head_dim = torch.float16, 11, 32
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q_buffer = torch.randn(num_tokens, 3 * head_dim + 5, generator=g, device=DEVICE).to(dtype)
    k_buffer = torch.randn(num_tokens, 2, head_dim + 8, generator=g, device=DEVICE).to(dtype)
    q, k = q_buffer[:, : 3 * head_dim].view(num_tokens, 3, head_dim), k_buffer[:, :, 4 : 4 + head_dim]
    positions, cache = random_positions(num_tokens, seed), cache_for(head_dim)
    q_before, k_before = q_buffer.clone(), k_buffer.clone()
    expected_q, expected_k = rotate64(q, positions, cache, STYLES[style]), rotate64(k, positions, cache, STYLES[style])
    op(positions, q, k, cache, STYLES[style])
    assert_close(q, expected_q, dtype, "q")
    assert_close(k, expected_k, dtype, "k")
    assert torch.equal(q_buffer[:, 3 * head_dim :], q_before[:, 3 * head_dim :])
    assert torch.equal(k_buffer[..., :4], k_before[..., :4]) and torch.equal(
        k_buffer[..., 4 + head_dim :], k_before[..., 4 + head_dim :]
    )
    q_buffer.copy_(q_before)
    op(positions, q, None, cache, STYLES[style])
    assert_close(q, expected_q, dtype, "q alone")


def test_cache_matches_float64_math() -> None:
    """Row p: cos | sin of the float32 angle p * inv_freq (rounded as transformers rounds it), times the
    attention scaling; cos and sin themselves evaluated in float64."""
    head_dim, scaling = 64, 1.25
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cache = build_cos_sin_cache(inv_freq, scaling, 1000)
    assert cache.shape == (1000, head_dim) and cache.dtype == torch.float32
    angle = (torch.arange(1000, dtype=torch.float64)[:, None] * inv_freq.double()).float().double()
    expected = torch.cat((angle.cos(), angle.sin()), dim=-1) * scaling
    assert_close(cache, expected, torch.float32, "cos_sin_cache")


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    ],
)
def test_scaled_caches_match_float64_and_transformers(rope: dict) -> None:
    """The model's cache for llama3 / yarn scaling: against float64 math on the rope type's inv_freq and
    attention scaling (yarn's is 0.1 ln(4) + 1), and against transformers' own cos / sin."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from infer.worker.models.layers import RotaryEmbedding

    config = AutoConfig.for_model(
        "llama",
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=1024,
        rope_theta=500000.0,
        rope_scaling=dict(rope),
    )
    ours = RotaryEmbedding(config, head_dim=64)
    if rope["rope_type"] == "yarn":
        assert ours.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    positions = torch.arange(1024, dtype=torch.float64)
    angle = (positions[:, None] * ours.inv_freq.double()).float().double()
    expected = torch.cat((angle.cos(), angle.sin()), dim=-1) * ours.attention_scaling
    assert ours.cos_sin_cache.shape == (1024, 64)
    assert_close(ours.cos_sin_cache, expected, torch.float32, "cos_sin_cache")

    position_ids = torch.randperm(1024, generator=torch.Generator().manual_seed(0))[None, :100]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), position_ids)
    rows = ours.cos_sin_cache[position_ids[0]]
    torch.testing.assert_close(rows[:, :32], cos[0, :, :32], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rows[:, 32:], sin[0, :, :32], atol=1e-6, rtol=1e-6)


def test_rotary_module_rotates_in_place_and_grows_its_cache() -> None:
    """RotaryEmbedding: neox by default (GPT-J on request), cache sized to max_position_embeddings,
    `reserve` grows it to the next power of two with the same rows."""
    from transformers import AutoConfig

    from infer.worker.models.layers import RotaryEmbedding

    config = AutoConfig.for_model(
        "llama", hidden_size=64, num_attention_heads=4, max_position_embeddings=100, rope_theta=10000.0
    )
    rotary, gptj = RotaryEmbedding(config, head_dim=16), RotaryEmbedding(config, head_dim=16, is_neox=False)
    assert rotary.is_neox and not gptj.is_neox and rotary.max_positions == 100
    first_rows = rotary.cos_sin_cache.clone()
    rotary.reserve(100)
    assert rotary.max_positions == 100
    rotary.reserve(130)
    assert rotary.max_positions == 256 and torch.equal(rotary.cos_sin_cache[:100], first_rows)

    gptj.reserve(256)
    for module in (rotary, gptj):
        q, k, _ = heads_of(fused_qkv(5, 4, 2, 16, torch.float32, seed=10)[0].cpu(), 4, 2, 16)  # its cache: CPU
        positions = torch.tensor([255, 3, 0, 120, 3])
        expected_q, expected_k = (rotate64(t, positions, module.cos_sin_cache, module.is_neox) for t in (q, k))
        module(positions, q, k)
        assert_close(q, expected_q, torch.float32, "q")
        assert_close(k, expected_k, torch.float32, "k")


def test_dispatch_and_errors() -> None:
    q, k, _ = heads_of(fused_qkv(3, 2, 1, 8, torch.float32, seed=11)[0].cpu(), 2, 1, 8)  # CPU: the twin
    cache, positions = cache_for(8).cpu(), torch.tensor([5, 1, 5])
    expected = rotate64(q, positions, cache, True)
    rotary_embedding_cpu(positions, q, k, cache, True)  # CPU tensors: the twin
    assert_close(q, expected, torch.float32, "q")
    with pytest.raises(ValueError, match="cos_sin_cache must be float32"):
        rotary_embedding_cpu(positions, q, k, cache.half(), True)
    with pytest.raises(ValueError, match=r"cos_sin_cache \(4096, 16\) must be \[max_positions, head_dim\]"):
        rotary_embedding_cpu(positions, q, k, cache_for(16), True)
    with pytest.raises(ValueError, match=r"k \(2, 1, 8\) torch.float32 \(strides .*\) must be \[T, heads, head_dim\]"):
        rotary_embedding_cpu(positions, q, k[:2], cache, True)
    with pytest.raises(ValueError, match=r"q \(3, 8, 2\) \(strides \(32, 1, 8\)\) must be .* unit stride along"):
        rotary_embedding_cpu(positions, q.transpose(1, 2), None, cache_for(2), True)
