"""What only GPT-OSS has, on the tiny random checkpoint of tests/family_cases.py (attention sinks, alternating
sliding (window 8) and full layers, its router and clamped SwiGLU experts with biases, yarn rope; its greedy tokens,
whole and in chunks, logprobs and bf16 against transformers: tests/worker/test_families.py): the sink-aware attention
twins against a plain softmax with the sink; MXFP4 dequantization against transformers' own, and an MXFP4 checkpoint
loading to the dense weights; the model's parts equal transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import hf_model

from infer.kernels.paged_attention import (
    paged_decode_attention_compiled,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
)
from infer.worker.loading.loader import load_model
from infer.worker.models.gpt_oss import dequantize_mxfp4

# ---------------------------------------------------------------------------------------------------------
# The attention twins with sinks


def _reference(q, keys, values, sinks, scale, window, first_pos):
    """q [n, H, D] at positions first_pos.., keys / values [L, Hkv, D]: softmax with the sink, written out."""
    n, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float()
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    pos = torch.arange(keys.shape[0])
    query_pos = torch.arange(first_pos, first_pos + n)
    seen = pos[None, :] <= query_pos[:, None]
    if window:
        seen &= pos[None, :] > query_pos[:, None] - window
    scores = scores.masked_fill(~seen, float("-inf"))
    denom = torch.logsumexp(torch.cat((scores, sinks[:, None, None].expand(-1, n, 1)), -1), -1, keepdim=True)
    return torch.einsum("hnl,lhd->nhd", (scores - denom).exp(), v)


@pytest.mark.parametrize("window", [0, 5])
def test_attention_twins_put_the_sink_in_the_denominator(window):
    """GQA 6:2, random block tables, a prefill chunk after a cached prefix and decodes: the prefill twin, the decode
    twin and the step graphs' version all give softmax(s) with exp(sink_h) added to each head's denominator."""
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, hkv, heads, dim, scale = 24, 4, 2, 6, 16, 0.3
    k_cache = torch.randn(hkv, num_blocks, block_size, dim, generator=g)
    v_cache = torch.randn(hkv, num_blocks, block_size, dim, generator=g)
    sinks = torch.randn(heads, generator=g) * 2
    lens = [13, 7]
    tables = torch.randperm(num_blocks, generator=g)[:8].view(2, 4).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def context(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = [int(tables[i, j // block_size]) * block_size + j % block_size for j in range(lens[i])]
        flat_k, flat_v = k_cache.view(hkv, -1, dim), v_cache.view(hkv, -1, dim)
        return flat_k[:, slots].transpose(0, 1), flat_v[:, slots].transpose(0, 1)

    q_dec = torch.randn(2, heads, dim, generator=g)
    want = torch.cat([_reference(q_dec[i : i + 1], *context(i), sinks, scale, window, lens[i] - 1) for i in range(2)])
    got = paged_decode_attention_cpu(q_dec, k_cache, v_cache, tables, seq_lens, scale, window=window, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    compiled = paged_decode_attention_compiled(q_dec, k_cache, v_cache, tables, seq_lens, scale, window, sinks=sinks)
    torch.testing.assert_close(compiled, want, atol=1e-5, rtol=1e-5)
    # a chunk of 5 queries ending sequence 0, then sequence 1's single query (a decode inside the prefill call)
    q_pre = torch.randn(6, heads, dim, generator=g)
    starts = torch.tensor([0, 5, 6], dtype=torch.int32)
    want = torch.cat(
        (
            _reference(q_pre[:5], *context(0), sinks, scale, window, lens[0] - 5),
            _reference(q_pre[5:], *context(1), sinks, scale, window, lens[1] - 1),
        )
    )
    got = paged_prefill_attention_cpu(
        q_pre, k_cache, v_cache, tables, seq_lens, starts, scale, window=window, sinks=sinks
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the sinks matter: without them the output differs
    plain = paged_prefill_attention_cpu(q_pre, k_cache, v_cache, tables, seq_lens, starts, scale, window=window)
    assert (plain - got).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------------
# MXFP4


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert ours.shape == (3, 128, 10) and ours.dtype == dtype
        assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match=r"MXFP4 blocks \[E, R, G, 16\]"):
        dequantize_mxfp4(blocks[..., :8], scales, torch.float32)


def _mxfp4_checkpoint(dense_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """`dense_dir`'s checkpoint with random MXFP4 experts instead of its dense ones (config.json saying mxfp4), in
    `out`; returns the dense expert weights they stand for."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(str(dense_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    dense = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        num_experts, cols, rows = tensors.pop(key).shape  # [E, H, 2I] or [E, I, H]: quantized along the first
        blocks = torch.randint(0, 256, (num_experts, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 128, (num_experts, rows, cols // 32), generator=g, dtype=torch.uint8)
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        dense[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(config))
    return dense


def test_an_mxfp4_checkpoint_loads_its_experts_dequantized(family_dir, tmp_path):
    path = family_dir("gpt_oss")
    dense = _mxfp4_checkpoint(path, tmp_path / "mxfp4")
    model = load_model(tmp_path / "mxfp4", torch.float32, torch.device("cpu"))
    params = dict(model.named_parameters())
    for key, want in dense.items():
        assert torch.equal(params[key], want), key
    assert not any(p.numel() for name, p in params.items() if name.endswith(("_blocks", "_scales")))
    # the missing scales of one projection are named
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        load_model(tmp_path / "mxfp4", torch.float32, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------
# Against transformers


def test_the_model_is_ours_with_windows_sinks_and_experts(family_dir):
    path = family_dir("gpt_oss")
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "GptOssForCausalLM" and not model.supports_step_graphs
    assert model.layer_windows == (8, 0, 8, 0)
    theirs = hf_model(path)
    ours = model.model.layers[1]
    assert torch.equal(ours.self_attn.sinks, theirs.model.layers[1].self_attn.sinks)
    assert torch.equal(ours.mlp.experts.gate_up_proj, theirs.model.layers[1].mlp.experts.gate_up_proj)
    assert torch.equal(ours.mlp.router.bias, theirs.model.layers[1].mlp.router.bias)
