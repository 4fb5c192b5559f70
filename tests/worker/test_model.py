"""Our Llama-family models against transformers on the same weights; paged attention against dense attention.

Batches are built here by `Pager` (random, non-contiguous block ids from a shuffled pool); the engine's own
builder comes later. Tolerances: fp32 logits within 1e-4 of transformers' relative to the largest logit;
bf16 no further from fp32 than transformers' own bf16 forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hf_reference import hf_model
from model_batches import Pager, new_cache, token_ids

from infer.kernels.dispatch import kernels_for
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.attention import paged_attention
from infer.worker.loading.loader import load_model
from infer.worker.models.layers import ColumnLinear, MergedColumnLinear, RotaryEmbedding, RowLinear

TINY_ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
CPU = torch.device("cpu")


SENTINEL = 4096.0


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    hf = hf_model(path, torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0]


@pytest.fixture(scope="module")
def model_dir(request, tiny_model_dir, smollm2_dir):
    return smollm2_dir if request.param == "smollm2" else tiny_model_dir(request.param)


@pytest.mark.parametrize("model_dir", [*TINY_ARCHS, "smollm2"], indirect=True)
def test_prefill_logits_match_transformers(model_dir: Path) -> None:
    model = load_model(model_dir, torch.float32, CPU, quantization="none")  # transformers dequantizes a GGUF
    seqs = {"a": token_ids(37, model.vocab_size, 1), "b": token_ids(12, model.vocab_size, 2)}
    pager = Pager(num_blocks=64, block_size=8)
    batch = pager.batch([(key, ids, 0, len(ids)) for key, ids in seqs.items()])
    with torch.inference_mode():
        logits = model.compute_logits(model(batch, new_cache(model, 64, 8)))
    assert logits.dtype == torch.float32 and logits.shape == (49, model.vocab_size)
    assert rel_err(logits[:37], hf_logits(model_dir, seqs["a"])) <= 1e-4
    assert rel_err(logits[37:], hf_logits(model_dir, seqs["b"])) <= 1e-4


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chunked_prefill_and_decodes_in_mixed_batches_match_transformers(tiny_model_dir, arch: str) -> None:
    """Sequence "a" is prefilled in 3 chunks then decoded 4 steps; "b" is prefilled whole, then decodes
    alongside a's chunks, so every step after the first mixes decodes with a prefill chunk."""
    path = tiny_model_dir(arch)
    model = load_model(path, torch.float32, CPU)
    a, b = token_ids(27, model.vocab_size, 3), token_ids(9, model.vocab_size, 4)
    steps = [
        [("b", b, 0, 5), ("a", a, 0, 10)],
        [("b", b, 5, 1), ("a", a, 10, 7)],
        [("b", b, 6, 1), ("a", a, 17, 6)],
        [("a", a, 23, 1), ("b", b, 7, 1)],
        [("a", a, 24, 1), ("b", b, 8, 1)],
        [("a", a, 25, 1)],
        [("a", a, 26, 1)],
    ]
    pager, cache = Pager(num_blocks=40, block_size=4, seed=7), new_cache(model, 40, 4)
    got: dict[str, dict[int, torch.Tensor]] = {"a": {}, "b": {}}
    with torch.inference_mode():
        for step in steps:
            batch = pager.batch(step, num_padding=2)
            logits = model.compute_logits(model(batch, cache))
            row = 0
            for key, _, num_cached, num_new in step:
                for j in range(num_new):
                    got[key][num_cached + j] = logits[row + j]
                row += num_new
    assert len(pager.tables["a"]) == 7  # 27 tokens over blocks of 4
    for key, ids in (("a", a), ("b", b)):
        ours = torch.stack([got[key][p] for p in range(len(ids))])
        assert rel_err(ours, hf_logits(path, ids)) <= 1e-4, key


def test_greedy_generation_matches_transformers(smollm2_dir: Path, smollm2_tokenizer) -> None:

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = smollm2_tokenizer(prompt)["input_ids"]
    hf = hf_model(smollm2_dir, torch.float32)
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False)[0].tolist()

    model = load_model(smollm2_dir, torch.float32, CPU, quantization="none")
    pager, cache, ids = Pager(num_blocks=16, block_size=4), new_cache(model, 16, 4), list(prompt_ids)
    with torch.inference_mode():
        num_cached, num_new = 0, len(ids)
        while len(ids) < len(expected):
            batch = pager.batch([("s", ids, num_cached, num_new)])
            logits = model.compute_logits(model(batch, cache)[batch.logits_indices])
            ids.append(int(logits[0].argmax()))
            num_cached, num_new = len(ids) - 1, 1
    assert ids == expected
    assert "Paris" in smollm2_tokenizer.decode(ids[len(prompt_ids) :])


@pytest.mark.parametrize("model_dir", ["qwen3", "smollm2"], indirect=True)
def test_bf16_is_as_close_as_transformers_bf16(model_dir: Path, smollm2_tokenizer) -> None:
    """bf16 drifts from fp32 by a few percent of the largest logit; ours must drift no more than
    transformers' own bf16 forward does (measured: SmolLM2 ~4e-2 for both)."""

    ids = smollm2_tokenizer(
        "The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed the ocean "
        "blue, and Paris is the capital of"
    )["input_ids"]
    reference = hf_logits(model_dir, ids)
    hf = hf_model(model_dir, torch.bfloat16)
    with torch.inference_mode():
        hf_err = rel_err(hf(torch.tensor([ids])).logits[0], reference)
        model = load_model(model_dir, torch.bfloat16, CPU, quantization="none")
        assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
        batch = Pager(num_blocks=16, block_size=4).batch([("s", ids, 0, len(ids))])
        ours = model.compute_logits(model(batch, new_cache(model, 16, 4)))
    assert ours.dtype == torch.float32
    assert rel_err(ours, reference) <= max(2 * hf_err, 1e-2)
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


# ---------------------------------------------------------------------------------------------------------
# Paged attention against dense attention


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] for the last n of ctx positions, k, v [ctx, Hkv, D] -> [n, H, D], causal, float32."""
    n, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), k) * scale
    future = torch.arange(ctx)[None, :] > torch.arange(ctx - n, ctx)[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hnc,chd->nhd", probs, v)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (5, 1)])
def test_paged_attention_matches_dense(dtype: torch.dtype, tol: float, num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    head_dim, block_size, num_blocks = 16, 4, 300  # block ids up to 299, scattered
    # (num_cached, num_new): 3 decodes of different lengths, then a chunk after a prefix, then a fresh prompt
    shapes = [(9, 1), (0, 1), (22, 1), (13, 6), (0, 11)]
    pager = Pager(num_blocks, block_size, seed=3)
    # finite garbage in every stale slot (the pool's invariant); SENTINEL marks slots nothing may write
    k_cache = torch.full((num_kv_heads, num_blocks, block_size, head_dim), SENTINEL, dtype=dtype)
    v_cache = k_cache.clone()
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, dtype=dtype) for c, n in shapes]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, dtype=dtype) for c, n in shapes]
    dummy_ids = [0] * 40
    batch = pager.batch([(str(i), dummy_ids, c, n) for i, (c, n) in enumerate(shapes)], num_padding=3)
    for i, (c, _) in enumerate(shapes):  # the cached prefixes, as earlier steps would have written them
        for p in range(c):
            block = pager.tables[str(i)][p // block_size]
            k_cache[:, block, p % block_size], v_cache[:, block, p % block_size] = full_k[i][p], full_v[i][p]
    q = torch.randn(batch.num_tokens, num_heads, head_dim, dtype=dtype)
    padding = torch.randn(3, num_kv_heads, head_dim, dtype=dtype)
    k = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, shapes, strict=True)] + [padding])
    v = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, shapes, strict=True)] + [padding])
    scale = head_dim**-0.5

    out = paged_attention(kernels_for(q.device), q, k, v, k_cache, v_cache, batch, scale)

    assert out.shape == q.shape and out.dtype == dtype
    starts = batch.query_start_loc.tolist()
    for i, _ in enumerate(shapes):
        expected = dense_attention(q[starts[i] : starts[i + 1]], full_k[i], full_v[i], scale)
        assert (out[starts[i] : starts[i + 1]].float() - expected).abs().max().item() <= tol, i
    assert not out[-3:].any()  # padding rows
    for i, (c, n) in enumerate(shapes):  # new tokens landed in their slots
        for p in range(c, c + n):
            block = pager.tables[str(i)][p // block_size]
            assert torch.equal(k_cache[:, block, p % block_size], full_k[i][p])
    written = sum(c + n for c, n in shapes)
    assert (k_cache[0, ..., 0] != SENTINEL).sum().item() == written  # padding wrote nothing


# ---------------------------------------------------------------------------------------------------------
# Layers


def test_linear_layers_shard_for_tensor_parallelism() -> None:
    """Two ranks of a column-parallel layer hold complementary rows; row-parallel partial sums add up."""
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    q, k, v, bias = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    fused = [
        MergedColumnLinear(
            8, {"q": 8, "k": 4, "v": 4}, bias=False, dtype=torch.float32, tp=TensorParallel(rank=r, size=2)
        )
        for r in range(2)
    ]
    for rank in fused:
        for name, w in (("q", q), ("k", k), ("v", v)):
            rank.load_shard("weight", w, name)
    halves = [rank.split(rank(x)) for rank in fused]
    for i, w in enumerate((q, k, v)):
        assert torch.allclose(torch.cat([h[i] for h in halves], -1), x @ w.T)

    column = [ColumnLinear(8, 8, bias=True, dtype=torch.float32, tp=TensorParallel(rank=r, size=2)) for r in range(2)]
    row = RowLinear(8, 8, bias=False, dtype=torch.float32)
    parts = [
        RowLinear(8, 8, bias=False, dtype=torch.float32, tp=TensorParallel(rank=r, size=2), reduce_results=False)
        for r in range(2)
    ]
    for r in range(2):
        column[r].load_shard("weight", q)
        column[r].load_shard("bias", bias)
        parts[r].load_shard("weight", k.repeat(2, 1))
    row.load_shard("weight", k.repeat(2, 1))
    assert torch.allclose(torch.cat([c(x) for c in column], -1), x @ q.T + bias)
    hidden = x @ q.T
    assert torch.allclose(parts[0](hidden[:, :4]) + parts[1](hidden[:, 4:]), row(hidden), atol=1e-5)
    qk = MergedColumnLinear(8, {"q": 8, "k": 4}, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"weight\[k\]: checkpoint shape \(5, 8\) != expected \(4, 8\)"):
        qk.load_shard("weight", torch.randn(5, 8), "k")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
)
def test_rope_scaling_matches_transformers(rope: dict) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        num_attention_heads=2,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling=dict(rope),
    )
    expected, expected_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, CPU)
    ours = RotaryEmbedding(config, head_dim=32)
    assert torch.allclose(ours.inv_freq, expected, rtol=1e-6)
    assert ours.attention_scaling == pytest.approx(expected_scaling)


def test_rope_legacy_fields_and_unknown_type() -> None:
    class Legacy:  # a pre-transformers-5 config: rope_theta and rope_scaling with "type"
        rope_theta = 1000.0
        rope_scaling: ClassVar[dict] = {"type": "linear", "factor": 2.0}

    legacy = RotaryEmbedding(Legacy(), head_dim=8)
    assert torch.allclose(legacy.inv_freq, 1.0 / (1000.0 ** (torch.arange(0, 8, 2) / 8)) / 2.0)

    class Unknown:
        rope_parameters: ClassVar[dict] = {"rope_type": "proportional", "rope_theta": 10000.0}

    with pytest.raises(NotImplementedError, match="rope_type 'proportional' is not supported; supported: default, "):
        RotaryEmbedding(Unknown(), head_dim=8)

    class Mrope:  # Qwen2-VL's older configs name M-RoPE's type "mrope": the default frequencies, as transformers reads it
        rope_parameters: ClassVar[dict] = {"rope_type": "mrope", "rope_theta": 1000.0}

    assert torch.allclose(RotaryEmbedding(Mrope(), head_dim=8).inv_freq, 1.0 / (1000.0 ** (torch.arange(0, 8, 2) / 8)))
