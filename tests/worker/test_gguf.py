"""GGUF files read as they are (worker/loading/gguf.py): our torch decoding against gguf-py's numpy reference, the repack
into kernels.quant's q4 / q8 (exact where the module says exact, within its stated bound elsewhere), lazy narrowing,
transformers names and the llama q / k unpermutation (tiny files written with gguf.GGUFWriter, and the embedded
SmolLM2 against transformers' own GGUF loading), broken files, and the weightless model directory."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from infer.kernels.quant import dequantize
from infer.worker.loading import gguf as gguf_module
from infer.worker.loading.gguf import GGUFFile, GGUFTensor, checkpoint_name, unpermute_order, write_model_dir
from infer.worker.loading.model_files import default_model_gguf

QUANTIZED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPPORTED = (Q.F32, Q.F16, Q.BF16, *QUANTIZED)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
EXACT_REPACK = {
    Q.Q4_0: ("q4", True),
    Q.Q4_1: ("q4", True),
    Q.Q8_0: ("q8", False),
    Q.Q5_0: ("q8", False),
    Q.Q5_1: ("q8", True),
}


# ---------------------------------------------------------------------------------------------------------
# Synthetic blocks


def _fp16_bytes(rng: np.random.Generator, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
    """Random finite fp16 values in [low, high), as their 2 bytes each: uint8 [*shape, 2]."""
    return rng.uniform(low, high, size=shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def k_quant_bytes(qtype: Q, rows: int, cols: int, rng: np.random.Generator, scale: float = 1e-2) -> np.ndarray:
    """K-quant blocks gguf-py cannot quantize: random quants and packed sub-block scales, fp16 d / dmin set to
    small finite values. uint8 [rows, cols / 256 * type_size]."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    if qtype == Q.Q6_K:
        blocks[..., 208:210] = _fp16_bytes(rng, blocks.shape[:2], scale / 10, scale)
    else:
        blocks[..., 0:2] = _fp16_bytes(rng, blocks.shape[:2], scale / 10, scale)
        blocks[..., 2:4] = _fp16_bytes(rng, blocks.shape[:2], scale / 10, scale)
    return blocks.reshape(rows, -1)


def gguf_bytes(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A [rows, cols] tensor as GGUF stores `qtype`: gguf-py's own quantizer where it has one (the floats as
    float32 / float16 arrays), random blocks for the K-quants."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return k_quant_bytes(qtype, rows, cols, rng)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    return values.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(values, qtype)


def reference(raw: np.ndarray, qtype: Q, rows: int) -> torch.Tensor:
    """gguf-py's numpy dequantization, float32 [rows, cols]."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(rows, -1))


def repack_bound(raw: np.ndarray, qtype: Q, rows: int) -> torch.Tensor:
    """The module's stated per-element bound on |dequantize(quantized()) - gguf| for the inexact repacks,
    float32 [rows, cols], plus float32 rounding slack (a few ulps of the values involved)."""
    blocks = torch.from_numpy(raw.copy()).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype == Q.Q6_K:
        values = reference(raw, qtype, rows).reshape(-1, 32)
        step = (values.abs().amax(-1, keepdim=True) / 127).half().float()
        bound = step / 2 + values.abs().amax(-1, keepdim=True) * 2**-20
        return bound.expand(-1, 32).reshape(rows, -1)
    step, offset = gguf_module._k_step_and_offset(blocks)  # exact float32 products d sc, dmin mn: [n, 8]
    qmax = 15 if qtype == Q.Q4_K else 31
    bound = 2**-11 * (qmax * step.abs() + offset.abs()) + (qmax + 1) * 2**-25
    bound = bound + (qmax * step.abs() + offset.abs()) * 2**-22  # float32 rounding of q * scale + min
    return bound.unsqueeze(-1).expand(-1, -1, 32).reshape(rows, -1)


# ---------------------------------------------------------------------------------------------------------
# Decoding


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference_bit_for_bit(qtype: Q) -> None:
    raw = gguf_bytes(qtype, 6, 512)
    tensor = GGUFTensor("blk.0.ffn_up.weight", qtype, raw, (6, 512))
    assert tensor.ggml_type == qtype.name and tensor.shape == (6, 512)
    ours = tensor.dequantize(torch.float32)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, reference(raw, qtype, 6))
    assert torch.equal(tensor.dequantize(torch.bfloat16), ours.to(torch.bfloat16))  # decoded in f32, then cast


def test_dequantize_reads_the_file_in_chunks_of_rows(monkeypatch) -> None:
    raw = gguf_bytes(Q.Q4_K, 7, 512, seed=1)
    expected = reference(raw, Q.Q4_K, 7)
    whole = GGUFTensor("w", Q.Q4_K, raw, (7, 512)).quantized()
    monkeypatch.setattr(gguf_module, "DECODE_CHUNK_ELEMENTS", 3 * 512)  # chunks of 3, 3, 1 rows
    tensor = GGUFTensor("w", Q.Q4_K, raw, (7, 512))
    assert list(len(rows) for _, rows in tensor._row_chunks()) == [3, 3, 1]
    assert torch.equal(tensor.dequantize(), expected)
    chunked = tensor.quantized()
    assert whole is not None and chunked is not None
    assert all(torch.equal(a, b) for a, b in zip(whole.tensors().values(), chunked.tensors().values(), strict=True))


def test_read_gives_the_natural_dtype() -> None:
    assert GGUFTensor("n", Q.F16, gguf_bytes(Q.F16, 2, 64), (2, 64)).read().dtype == torch.float16
    assert GGUFTensor("n", Q.BF16, gguf_bytes(Q.BF16, 2, 64), (2, 64)).read().dtype == torch.bfloat16
    assert GGUFTensor("n", Q.Q8_0, gguf_bytes(Q.Q8_0, 2, 64), (2, 64)).read().dtype == torch.float32


def test_unsupported_type_is_refused_naming_type_and_tensor() -> None:
    raw = np.random.default_rng(0).integers(0, 256, size=(2, GGML_QUANT_SIZES[Q.Q2_K][1]), dtype=np.uint8)
    tensor = GGUFTensor("blk.3.ffn_down.weight", Q.Q2_K, raw, (2, 256))
    with pytest.raises(NotImplementedError, match=r"'blk\.3\.ffn_down\.weight'.*Q2_K"):
        tensor.dequantize()
    with pytest.raises(NotImplementedError, match=r"'blk\.3\.ffn_down\.weight'.*Q2_K"):
        tensor.quantized()


def test_wrong_byte_count_is_refused_naming_the_tensor() -> None:
    raw = gguf_bytes(Q.Q8_0, 4, 64)
    with pytest.raises(ValueError, match=r"'token_embd\.weight'.*needs 340 bytes, the file holds 272"):
        GGUFTensor("token_embd.weight", Q.Q8_0, raw, (5, 64))


# ---------------------------------------------------------------------------------------------------------
# Repacking into q4 / q8


@pytest.mark.parametrize("qtype", list(EXACT_REPACK), ids=lambda t: t.name)
def test_exact_repacks_dequantize_bit_for_bit(qtype: Q) -> None:
    raw = gguf_bytes(qtype, 5, 256, seed=2)
    weight = GGUFTensor("w", qtype, raw, (5, 256)).quantized()
    assert weight is not None
    assert (weight.format, weight.mins is not None) == EXACT_REPACK[qtype]
    assert weight.shape == (5, 256)
    assert torch.equal(dequantize(weight), reference(raw, qtype, 5))


def test_q4_0_and_q4_1_keep_their_nibbles_and_scales_as_stored() -> None:
    for qtype, qs_at in ((Q.Q4_0, 2), (Q.Q4_1, 4)):
        raw = gguf_bytes(qtype, 3, 128, seed=3)
        weight = GGUFTensor("w", qtype, raw, (3, 128)).quantized()
        assert weight is not None
        blocks = raw.reshape(3, 4, -1)
        assert np.array_equal(weight.qs.numpy(), blocks[..., qs_at : qs_at + 16].reshape(3, -1))
        assert np.array_equal(weight.scales.numpy(), blocks[..., 0:2].copy().view(np.float16).reshape(3, 4))


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_repacks_stay_within_the_stated_bound(qtype: Q) -> None:
    raw = gguf_bytes(qtype, 4, 512, seed=4)
    weight = GGUFTensor("w", qtype, raw, (4, 512)).quantized()
    assert weight is not None
    assert weight.format == ("q4" if qtype == Q.Q4_K else "q8")
    assert (weight.mins is None) == (qtype == Q.Q6_K)
    error = (dequantize(weight) - reference(raw, qtype, 4)).abs()
    bound = repack_bound(raw, qtype, 4)
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(error.max()) > 0  # the bound is doing work: these repacks do round


def test_k_quant_repack_keeps_the_quants_and_rounds_only_scale_and_min() -> None:
    """Q4_K's 4-bit values survive untouched; its scale and min are the exact products rounded to fp16 once."""
    raw = gguf_bytes(Q.Q4_K, 2, 256, seed=5)
    weight = GGUFTensor("w", Q.Q4_K, raw, (2, 256)).quantized()
    assert weight is not None
    blocks = torch.from_numpy(raw.copy()).reshape(-1, 144)
    step, offset = gguf_module._k_step_and_offset(blocks)
    assert torch.equal(weight.scales.reshape(-1, 8), step.half())
    assert torch.equal(weight.mins.reshape(-1, 8), (-offset).half())
    # with the scales and mins as stored, the values are exactly what GGUF's own formula gives
    q = gguf_module._q4_k_values(blocks, 16).float()
    expected = (weight.scales.float().reshape(-1, 8, 1) * q + weight.mins.float().reshape(-1, 8, 1)).reshape(2, 256)
    assert torch.equal(dequantize(weight), expected)


def test_floats_and_vectors_have_no_quantized_form() -> None:
    assert GGUFTensor("w", Q.F16, gguf_bytes(Q.F16, 2, 64), (2, 64)).quantized() is None
    assert GGUFTensor("w", Q.F32, np.ones(64, np.float32), (64,)).quantized() is None
    assert GGUFTensor("w", Q.Q8_0, gguf_bytes(Q.Q8_0, 1, 64), (64,)).quantized() is None


def test_repack_that_overflows_fp16_is_refused() -> None:
    raw = gguf_bytes(Q.Q4_0, 1, 32)
    raw[0, 0:2] = np.array([10000.0], np.float16).view(np.uint8)  # -8 d = -80000: past fp16's range
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_v\.weight'.*overflow fp16"):
        GGUFTensor("blk.0.attn_v.weight", Q.Q4_0, raw, (1, 32)).quantized()


# ---------------------------------------------------------------------------------------------------------
# Narrowing (a tensor-parallel rank's shard)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.F16], ids=lambda t: t.name)
def test_narrow_rows_and_block_columns_match_the_whole(qtype: Q) -> None:
    raw = gguf_bytes(qtype, 6, 768, seed=6)
    tensor = GGUFTensor("w", qtype, raw, (6, 768))
    whole = tensor.dequantize()
    rows = tensor.narrow(0, 2, 3)
    cols = tensor.narrow(1, 96, 320)  # not aligned to a K-quant's 256: decodes the covering blocks, then cuts
    both = rows.narrow(1, 288, 64).narrow(0, 1, 2)
    assert (rows.shape, cols.shape, both.shape) == ((3, 768), (6, 320), (2, 64))
    assert torch.equal(rows.dequantize(), whole[2:5])
    assert torch.equal(cols.dequantize(), whole[:, 96:416])
    assert torch.equal(both.dequantize(), whole[3:5, 288:352])
    full = tensor.quantized()
    if full is None:
        return
    part = both.quantized()
    assert part is not None and part.shape == (2, 64)
    per_byte = 2 if full.format == "q4" else 1
    assert torch.equal(part.qs, full.qs[3:5, 288 // per_byte : 352 // per_byte])
    assert torch.equal(part.scales, full.scales[3:5, 9:11])
    assert (part.mins is None) == (full.mins is None)
    if full.mins is not None and part.mins is not None:
        assert torch.equal(part.mins, full.mins[3:5, 9:11])


def test_narrow_columns_of_a_quantized_matrix_go_in_whole_blocks() -> None:
    tensor = GGUFTensor("blk.0.attn_output.weight", Q.Q8_0, gguf_bytes(Q.Q8_0, 2, 128), (2, 128))
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_output\.weight'.*whole blocks of 32"):
        tensor.narrow(1, 16, 32)
    with pytest.raises(ValueError, match="cannot narrow"):
        tensor.narrow(0, 1, 2)
    floats = GGUFTensor("w", Q.F32, np.arange(6, dtype=np.float32), (6,))
    assert floats.narrow(0, 1, 3).read().tolist() == [1.0, 2.0, 3.0]
    assert floats.narrow(-1, 4, 2).read().tolist() == [4.0, 5.0]


# ---------------------------------------------------------------------------------------------------------
# Names and the llama q / k unpermutation, on tiny files

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 64, 4, 2, 128, 96, 2


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a llama attn q / k weight before writing it."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    """A GGUF file of `arch` with the tiny config and `tensors` (name -> (float values in GGUF's row order, type
    to store them as))."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, (values, qtype) in tensors.items():
        if qtype == Q.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_tensors(hf: dict[str, np.ndarray], arch: str) -> dict[str, tuple[np.ndarray, Q]]:
    """The GGUF tensors of a tiny model whose transformers weights are `hf` (layer 0 and 1 of a Q4_0 / Q8_0 / F16 /
    F32 mixture), the q / k rows permuted as llama.cpp does for llama."""

    def stored(name: str) -> np.ndarray:
        values = hf[name]
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            return llama_cpp_permute(values, HEADS if "q_proj" in name else KV_HEADS)
        return values

    types = {
        "attn_q": Q.Q4_0,
        "attn_k": Q.F16,
        "attn_v": Q.Q8_0,
        "attn_output": Q.Q4_0,
        "ffn_gate": Q.Q4_0,
        "ffn_up": Q.Q8_0,
        "ffn_down": Q.F16,
    }
    out = {
        "token_embd.weight": (hf["model.embed_tokens.weight"], Q.Q8_0),
        "output_norm.weight": (hf["model.norm.weight"], Q.F32),
        "output.weight": (hf["lm_head.weight"], Q.F16),
    }
    for gguf_name in [f"blk.{i}.{part}.weight" for i in range(LAYERS) for part in ("attn_norm", "ffn_norm", *types)]:
        part = gguf_name.split(".")[2]
        out[gguf_name] = (stored(checkpoint_name(gguf_name) or ""), types.get(part, Q.F32))
    return out


def tiny_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,),
            layer + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            layer + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            layer + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            layer + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            layer + "mlp.gate_proj.weight": (FFN, HIDDEN),
            layer + "mlp.up_proj.weight": (FFN, HIDDEN),
            layer + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def test_tiny_llama_names_shapes_and_unpermuted_q_k(tmp_path: Path) -> None:
    hf = tiny_hf_weights()
    path = write_gguf(tmp_path / "tiny.gguf", "llama", tiny_tensors(hf, "llama"))
    file = GGUFFile(path)
    assert (file.architecture, file.num_layers, file.num_heads, file.num_kv_heads) == ("llama", 2, 4, 2)
    tensors = dict(file.tensors())
    assert set(tensors) == set(hf)
    assert {name: t.shape for name, t in tensors.items()} == {name: v.shape for name, v in hf.items()}
    # F16 k_proj: exactly the transformers weight (to fp16), rows back in transformers' order
    k = tensors["model.layers.1.self_attn.k_proj.weight"]
    assert k.ggml_type == "F16"
    assert torch.equal(k.dequantize(), torch.from_numpy(hf["model.layers.1.self_attn.k_proj.weight"]).half().float())
    # Q4_0 q_proj: gguf-py's decoding of the stored (permuted) blocks, unpermuted as transformers does
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    stored = gguf.quants.dequantize(
        gguf.quants.quantize(llama_cpp_permute(hf["model.layers.0.self_attn.q_proj.weight"], HEADS), Q.Q4_0), Q.Q4_0
    )
    theirs = (
        LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
        .process(stored, "blk.0.attn_q.weight")
        .weights
    )
    assert torch.equal(q.dequantize(), torch.from_numpy(np.ascontiguousarray(theirs)))
    packed = q.quantized()
    assert packed is not None and torch.equal(dequantize(packed), q.dequantize())  # the permutation moved blocks
    assert torch.allclose(q.dequantize(), torch.from_numpy(hf["model.layers.0.self_attn.q_proj.weight"]), atol=0.5)
    # a shard of the unpermuted rows is the same rows of the whole
    assert torch.equal(q.narrow(0, 16, 16).dequantize(), q.dequantize()[16:32])


def test_unpermute_order_inverts_llama_cpp_permutation() -> None:
    rows = np.arange(24 * 3).reshape(24, 3)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(llama_cpp_permute(rows, heads)[unpermute_order(24, heads)], rows)
    with pytest.raises(ValueError, match="do not split into 5 heads"):
        unpermute_order(24, 5)


def test_qwen_tensors_are_named_and_not_permuted(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    q = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    tensors = {
        "blk.0.attn_q.weight": (q, Q.F32),
        "blk.0.attn_q.bias": (q[0], Q.F32),
        "blk.0.attn_q_norm.weight": (q[1, :16], Q.F32),
        "blk.0.attn_k_norm.weight": (q[2, :16], Q.F32),
    }
    file = GGUFFile(write_gguf(tmp_path / "qwen3.gguf", "qwen3", tensors))
    named = dict(file.tensors())
    assert set(named) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    }
    assert torch.equal(named["model.layers.0.self_attn.q_proj.weight"].read(), torch.from_numpy(q))
    assert torch.equal(named["model.layers.0.self_attn.q_proj.bias"].read(), torch.from_numpy(q[0]))


def test_llama_bias_is_unpermuted_like_its_rows(tmp_path: Path) -> None:
    bias = np.arange(HIDDEN, dtype=np.float32)
    file = GGUFFile(
        write_gguf(tmp_path / "b.gguf", "llama", {"blk.0.attn_q.bias": (llama_cpp_permute(bias, HEADS), Q.F32)})
    )
    assert torch.equal(file.tensor("model.layers.0.self_attn.q_proj.bias").read(), torch.from_numpy(bias))
    assert file.tensor("model.layers.0.self_attn.q_proj.bias").narrow(0, 8, 4).read().tolist() == [8, 9, 10, 11]


def test_names_map_as_transformers_checkpoints() -> None:
    assert checkpoint_name("token_embd.weight") == "model.embed_tokens.weight"
    assert checkpoint_name("output.weight") == "lm_head.weight"
    assert checkpoint_name("output_norm.weight") == "model.norm.weight"
    assert checkpoint_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert checkpoint_name("blk.3.attn_v.bias") == "model.layers.3.self_attn.v_proj.bias"
    assert checkpoint_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert checkpoint_name("rope_freqs.weight") is None


def test_moe_experts_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    experts = np.zeros((4, 8, 64), np.float32)
    path = write_gguf(tmp_path / "moe.gguf", "llama", {"blk.0.ffn_gate_exps.weight": (experts, Q.F32)})
    with pytest.raises(NotImplementedError, match=r"moe\.gguf.*'blk\.0\.ffn_gate_exps\.weight'.*experts"):
        GGUFFile(path)


def test_unknown_tensor_and_architecture_are_refused_naming_the_file(tmp_path: Path) -> None:
    unknown = write_gguf(tmp_path / "odd.gguf", "llama", {"blk.0.ssm_conv.weight": (np.zeros((2, 32)), Q.F32)})
    with pytest.raises(ValueError, match=r"odd\.gguf.*'blk\.0\.ssm_conv\.weight' has no transformers name"):
        GGUFFile(unknown)
    other = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (np.zeros((2, 32)), Q.F32)})
    with pytest.raises(ValueError, match=r"gpt2\.gguf: GGUF architecture 'gpt2' is not supported"):
        GGUFFile(other)


def test_truncated_or_garbage_file_is_a_value_error_naming_it(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "whole.gguf", "llama", tiny_tensors(tiny_hf_weights(), "llama")).read_bytes()
    for name, content in (
        ("header.gguf", whole[:200]),
        ("half.gguf", whole[: len(whole) // 2]),
        ("short.gguf", whole[:-10]),
        ("garbage.gguf", bytes(range(256)) * 40),
        ("empty.gguf", b""),
    ):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name}"):
            GGUFFile(path)
    with pytest.raises(ValueError, match=r"missing\.gguf: no such GGUF file"):
        GGUFFile(tmp_path / "missing.gguf")


# ---------------------------------------------------------------------------------------------------------
# The embedded SmolLM2 (Q4_1 layers, Q8_0 embedding, F32 norms)


@pytest.fixture(scope="module")
def smollm(smollm2_gguf: Path) -> GGUFFile:
    return GGUFFile(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm_config(smollm2_gguf: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_embedded_model_every_tensor_named_and_shaped_as_the_config(smollm: GGUFFile, smollm_config) -> None:
    c = smollm_config
    head_dim = c.hidden_size // c.num_attention_heads
    per_layer = {
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (c.num_attention_heads * head_dim, c.hidden_size),
        "self_attn.k_proj.weight": (c.num_key_value_heads * head_dim, c.hidden_size),
        "self_attn.v_proj.weight": (c.num_key_value_heads * head_dim, c.hidden_size),
        "self_attn.o_proj.weight": (c.hidden_size, c.num_attention_heads * head_dim),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    expected = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    expected |= {
        f"model.layers.{i}.{name}": shape for i in range(c.num_hidden_layers) for name, shape in per_layer.items()
    }
    tensors = dict(smollm.tensors())
    assert len(tensors) == len(smollm._reader.tensors) == 272  # every tensor of the file, none dropped
    assert {name: t.shape for name, t in tensors.items()} == expected  # tied: no lm_head
    types = {t.ggml_type for name, t in tensors.items() if name.endswith("proj.weight")}
    assert types == {"Q4_1"} and tensors["model.embed_tokens.weight"].ggml_type == "Q8_0"
    assert tensors["model.norm.weight"].ggml_type == "F32"


def test_embedded_token_embedding_repacks_exactly(smollm: GGUFFile) -> None:
    embedding = smollm.tensor("model.embed_tokens.weight")
    weight = embedding.quantized()
    assert weight is not None and weight.format == "q8" and weight.mins is None and weight.shape == (49152, 576)
    raw = smollm._reader.tensors[0].data
    assert smollm._reader.tensors[0].name == "token_embd.weight"
    assert torch.equal(dequantize(weight), reference(raw, Q.Q8_0, 49152))


@pytest.fixture(scope="module")
def transformers_weights(smollm2_dir: Path) -> dict[str, torch.Tensor]:
    """The embedded model as transformers' own GGUF loading gives it (gguf-py's dequantization, its reverse q / k
    permutation), float32: hf_reference's copy of that loading (tests/hf_reference.py, _dequantized), written once
    per machine by the first test that takes the embedded model's oracle, where reading the GGUF's 272 tensors
    again took ~60 s of this file on the 2-core CI machine. The copy holds transformers' float32 values as they
    are (safetensors), so the comparisons below stay bit for bit against transformers' own reading."""
    from hf_reference import hf_model

    return hf_model(smollm2_dir).state_dict()


def test_embedded_layers_agree_with_transformers_loading(smollm: GGUFFile, transformers_weights) -> None:
    """Every tensor of layer 0 and the q / k projections of every layer, bit for bit in float32."""
    names = [
        name
        for name, _ in smollm.tensors()
        if name.startswith("model.layers.0.") or name.endswith(("q_proj.weight", "k_proj.weight"))
    ]
    assert len(names) == 9 + 2 * 29
    for name in names:
        assert torch.equal(smollm.tensor(name).dequantize(), transformers_weights[name]), name
    q = smollm.tensor("model.layers.0.self_attn.q_proj.weight")
    packed = q.quantized()
    assert packed is not None
    assert torch.equal(dequantize(packed), transformers_weights["model.layers.0.self_attn.q_proj.weight"])


def test_loader_fills_a_tensor_parallel_rank_from_gguf_tensors(
    smollm: GGUFFile, smollm_config, transformers_weights
) -> None:
    """The loader takes GGUFTensors where it takes safetensors' lazy tensors: rank 1 of 3 narrows rows (q / k / v,
    gate / up, embedding) and whole blocks of columns (o_proj, down_proj) out of the unpermuted Q4_1 blocks."""
    from infer.worker.distributed.tensor_parallel import TensorParallel
    from infer.worker.loading.loader import build_model, load_named_tensors

    model = build_model(smollm_config, torch.float32, "cpu", tp=TensorParallel(rank=1, size=3))
    load_named_tensors(model, ((name, lambda t=t: t, "in the embedded GGUF") for name, t in smollm.tensors()))
    ours = dict(model.named_parameters())
    theirs = transformers_weights
    for i in (0, 29):
        layer = f"model.layers.{i}."
        qkv = torch.cat(
            [
                theirs[layer + "self_attn.q_proj.weight"][192:384],
                theirs[layer + "self_attn.k_proj.weight"][64:128],
                theirs[layer + "self_attn.v_proj.weight"][64:128],
            ]
        )
        gate_up = torch.cat(
            [theirs[layer + "mlp.gate_proj.weight"][512:1024], theirs[layer + "mlp.up_proj.weight"][512:1024]]
        )
        assert torch.equal(ours[layer + "self_attn.qkv_proj.weight"], qkv)
        assert torch.equal(ours[layer + "mlp.gate_up_proj.weight"], gate_up)
        assert torch.equal(
            ours[layer + "self_attn.o_proj.weight"], theirs[layer + "self_attn.o_proj.weight"][:, 192:384]
        )
        assert torch.equal(ours[layer + "mlp.down_proj.weight"], theirs[layer + "mlp.down_proj.weight"][:, 512:1024])
        assert torch.equal(ours[layer + "input_layernorm.weight"], theirs[layer + "input_layernorm.weight"])
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"][16384:32768])


# ---------------------------------------------------------------------------------------------------------
# Config and tokenizer without weights


def test_write_model_dir_has_config_tokenizer_and_a_link_no_weights(
    smollm2_gguf: Path, smollm_config, tmp_path: Path, monkeypatch
) -> None:
    import gguf
    from transformers import AutoConfig, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as utils

    # the oracle is transformers' own reading of the GGUF (the smollm2_tokenizer fixture is the cached conversion's)
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)

    reads = []
    read = utils.load_gguf_checkpoint

    def counted(*args, **options):
        reads.append(args)
        return read(*args, **options)

    monkeypatch.setattr(utils, "load_gguf_checkpoint", counted)
    slow_readers = []  # gguf-py's reader (a numpy view per vocabulary string): ours stands in for it
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **options: slow_readers.append(args))
    out = tmp_path / "model"
    write_model_dir(smollm2_gguf, out)
    assert len(reads) == 1  # the metadata read once, for the config and the tokenizer (seconds each time)
    assert not slow_readers
    assert utils.load_gguf_checkpoint is counted  # put back as it was
    assert (out / "model.gguf").is_symlink() and (out / "model.gguf").readlink() == smollm2_gguf.resolve()
    assert not list(out.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(str(out))
    ignored = {"_name_or_path": None, "transformers_version": None}  # where it was read from, and by which version
    assert config.to_dict() | ignored == smollm_config.to_dict() | ignored
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "user", "content": "Grüße, 世界!"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == gguf_tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    assert tokenizer("Grüße, 世界!")["input_ids"] == gguf_tokenizer("Grüße, 世界!")["input_ids"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def _resident_kib(address: int) -> int:
    """Resident KiB of the memory map holding `address` (/proc/self/smaps): one map, whatever other maps of the
    same file hold."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            low, high = (int(part, 16) for part in fields[0].split("-"))
            inside = low <= address < high
        elif inside and fields[0] == "Rss:":
            return int(fields[1])
    raise AssertionError(f"no map holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads /proc/self/smaps (Linux)")
def test_repacking_gives_the_files_pages_back_and_reads_them_again_unchanged():
    path = default_model_gguf().resolve()
    file = GGUFFile(path)
    tensors = dict(file.tensors())
    address = next(iter(tensors.values()))._raw.ctypes.data  # inside this file's own map
    first = {name: weight for name, t in tensors.items() if (weight := t.quantized()) is not None}
    assert _resident_kib(address) < path.stat().st_size // 1024 // 10  # not the file beside its blocks
    for name in list(first)[:3]:  # read again through the same map: the same blocks
        weight, again = first[name], file.tensor(name).quantized()
        assert again is not None and torch.equal(again.qs, weight.qs) and torch.equal(again.scales, weight.scales)


def test_other_memory_keeps_its_pages():
    # A tensor over bytes of our own (not a file's map) is read without giving anything back.
    data = np.arange(2 * GGML_QUANT_SIZES[Q.Q8_0][1], dtype=np.uint8) % 7  # two rows of one block
    tensor = GGUFTensor("t", Q.Q8_0, data.copy(), (2, 32))
    before = data.copy()
    tensor.quantized()
    assert np.array_equal(tensor._raw.reshape(-1), before)
