"""AWQ and GPTQ int4 checkpoints load as they are (worker/loading/awq_gptq.py, the loader's wiring).

There is no AutoAWQ / AutoGPTQ here, so the checkpoints are written by this file's own packers, each a plain loop
over the documented bit positions (nibble i of an int32 word is bits 4i .. 4i + 3):
- AWQ GEMM (AutoAWQ WQLinear_GEMM.from_linear): qweight [in, out / 8], word c of a row holds output 8c + ORDER[i] in
  nibble i, ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [groups, out / 8] the same; scales fp16 [groups, out].
- GPTQ (AutoGPTQ QuantLinear.pack): qweight [in / 8, out], word r of a column holds input 8r + i in nibble i;
  qzeros [groups, out / 8], word c holds output 8c + i in nibble i, storing zero - 1 ("gptq") or zero ("gptq_v2");
  scales fp16 [groups, out]; g_idx int32 [in] = i // group_size.
Element = s * (q - z).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_batches import Pager, kl_and_top1, new_cache, quantized_layers, token_ids
from safetensors.torch import load_file, save_file

from infer import SamplingParams
from infer.kernels.quant import dequantize, unpack_q4
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.loading.awq_gptq import Int4Scheme, Int4Tensor, scheme_of
from infer.worker.loading.loader import build_model, file_tensors, load_model, load_named_tensors, weight_files
from infer.worker.models.layers import QuantStorage

CPU = torch.device("cpu")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (mean KL, top-1 agreement) of the q4-kept model to the dense model of the same values in fp32, teacher-forced
# over 48 positions. KL: test_quantized.py's int8 bound (int8 weights and activations; its int4 bound is 0.05),
# here only the activations' int8 blocks and the fp16 mins differ: measured 4e-5 - 9e-5. Top-1: measured
# 0.875 - 1.0 (a random model's top logits are near ties, so it says less than KL; test_quantized.py's int8 bound
# is 0.9, its int4 bound 0.4).
ACTIVATION_BOUND = (1e-3, 0.8)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 300, 41, 9, 77, 1023, 64, 12, 88, 301, 7, 450, 33, 2, 19, 600], [1000, 2000, 3000], [42]]
# (method, checkpoint_format, sym): the variants a checkpoint comes in
VARIANTS = [
    ("awq", None, False),
    ("gptq", "gptq", True),
    ("gptq", "gptq", False),
    ("gptq", "gptq_v2", False),
    ("gptq", "gptq_v2", True),
]


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    pager = Pager(num_blocks=32, block_size=8)
    batch = pager.batch([("a", ids, 0, len(ids))])
    with torch.inference_mode():
        return model.compute_logits(model(batch, new_cache(model, 32, 8)))


def new_engine(path: Path, **options) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            max_model_len=256,
            kv_cache_memory=4_000_000,
            num_threads=1,
            block_size=4,
            suspend_weights="reload",
            **options,
        )
    )


def greedy(engine: Engine, prefix: str) -> list[list[int]]:
    """PROMPTS' greedy tokens, in order."""
    tokens: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(PROMPTS))}
    for rid, prompt in zip(tokens, PROMPTS):
        engine.add_request(rid, prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return list(tokens.values())


# ---------------------------------------------------------------------------------------------------------
# The reference packers


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0 .. 2^32 - 1 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_columns(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, C] of 0..15 -> int32 [R, C / 8]: word c, nibble i <- column 8c + order[i]."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            words[:, c] |= values[:, 8 * c + order[i]].to(torch.int64) << (4 * i)
    return to_int32(words)


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] of 0..15 -> int32 [R / 8, C]: word r, nibble i <- row 8r + i."""
    rows, cols = values.shape
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for r in range(rows // 8):
        for i in range(8):
            words[r, :] |= values[8 * r + i, :].to(torch.int64) << (4 * i)
    return to_int32(words)


def pack_layer(
    q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, method: str, fmt: str | None, group_size: int
) -> dict[str, torch.Tensor]:
    """q int [N, K], s fp16 [N, G], z int [N, G] -> the checkpoint tensors of one layer (names without prefix)."""
    if method == "awq":
        return {
            "qweight": pack_along_columns(q.t(), AWQ_ORDER),
            "qzeros": pack_along_columns(z.t(), AWQ_ORDER),
            "scales": s.t().contiguous(),
        }
    stored = z - 1 if fmt == "gptq" else z
    assert 0 <= int(stored.min()) and int(stored.max()) <= 15
    k = q.shape[1]
    g = k if group_size == -1 else group_size
    return {
        "qweight": pack_along_rows(q.t()),
        "qzeros": pack_along_columns(stored.t(), list(range(8))),
        "scales": s.t().contiguous(),
        "g_idx": (torch.arange(k) // g).to(torch.int32),
    }


def exact_values(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int) -> torch.Tensor:
    """s * (q - z) in float64, [N, K]."""
    k = q.shape[1]
    group = torch.arange(k) // (k if group_size == -1 else group_size)
    return s.double()[:, group] * (q.double() - z.double()[:, group])


def quantize_groups(w: torch.Tensor, group_size: int, sym: bool, lowest_zero: int) -> tuple[torch.Tensor, ...]:
    """A plain per-group int4 quantizer (not AWQ's or GPTQ's search, only their storage): symmetric z = 8,
    s = absmax / 7; else s = (max - min) / 15, z = round(-min / s) within lowest_zero .. 15."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    blocks = w.double().reshape(n, k // g, g)
    if sym:
        s = (blocks.abs().amax(-1) / 7).to(torch.float16)
        z = torch.full(s.shape, 8, dtype=torch.int64)
    else:
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        s = ((hi - lo) / 15).to(torch.float16)
        z = torch.round(-lo / s.double()).clamp(lowest_zero, 15).to(torch.int64)
    q = torch.round(blocks / s.double().unsqueeze(-1) + z.unsqueeze(-1)).clamp(0, 15).to(torch.int64)
    return q.reshape(n, k), s, z


def quant_config(method: str, fmt: str | None, sym: bool, group_size: int) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True}
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": sym,
        "checkpoint_format": fmt,
    }


def write_int4_checkpoint(dense_dir: Path, out: Path, method: str, fmt: str | None, sym: bool, group_size: int) -> Path:
    """`dense_dir`'s model with its decoder linears quantized and packed as `method` / `fmt` into `out`; beside it,
    `out`-dense holds the same weights dense (s * (q - z) in fp32). Returns `out`."""
    tensors = load_file(str(dense_dir / "model.safetensors"))
    packed, dense = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight").rpartition(".")[2]
        if module not in LINEARS or not name.endswith(".weight"):
            packed[name] = dense[name] = tensor
            continue
        q, s, z = quantize_groups(tensor, group_size, sym, lowest_zero=1 if fmt == "gptq" else 0)
        prefix = name.removesuffix(".weight")
        packed.update({f"{prefix}.{part}": t for part, t in pack_layer(q, s, z, method, fmt, group_size).items()})
        dense[name] = exact_values(q, s, z, group_size).float()
    for directory, weights in ((out, packed), (out.with_name(out.name + "-dense"), dense)):
        shutil.copytree(dense_dir, directory)
        (directory / "model.safetensors").unlink()
        save_file(weights, str(directory / "model.safetensors"))
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = quant_config(method, fmt, sym, group_size)
    (out / "config.json").write_text(json.dumps(config))
    return out


def random_layer(n: int, k: int, group_size: int, fmt: str | None, seed: int) -> tuple[torch.Tensor, ...]:
    """Random codes: q in 0..15, zeros over the format's whole range (GPTQ "gptq": 1..16), fp16 scales of both
    signs and a wide range of magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // (k if group_size == -1 else group_size)
    q = torch.randint(0, 16, (n, k), generator=gen)
    low = 1 if fmt == "gptq" else 0
    z = torch.randint(low, low + 16, (n, groups), generator=gen)
    s = torch.randn(n, groups, generator=gen) * 10.0 ** torch.randint(-4, 2, (n, groups), generator=gen)
    return q, s.to(torch.float16), z


def int4_tensor(q, s, z, method, fmt, group_size) -> Int4Tensor:
    scheme = Int4Scheme(method, group_size, 1 if fmt == "gptq" else 0)
    return Int4Tensor("layer", scheme, pack_layer(q, s, z, method, fmt, group_size))


# ---------------------------------------------------------------------------------------------------------
# (a) one weight: exact codes and scales, mins within the stated fp16 bound


@pytest.mark.parametrize("method, fmt", [("awq", None), ("gptq", "gptq"), ("gptq", "gptq_v2")])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_a_packed_weight_dequantizes_to_s_times_q_minus_z(method, fmt, group_size) -> None:
    n, k = 48, 256
    q, s, z = random_layer(n, k, group_size, fmt, seed=group_size + 7)
    tensor = int4_tensor(q, s, z, method, fmt, group_size)
    exact = exact_values(q, s, z, group_size)
    assert tensor.shape == (n, k)
    assert torch.equal(tensor.read().double(), exact)  # dense: exact in float32
    weight = tensor.quantized()
    group = torch.arange(0, k, 32) // (k if group_size == -1 else group_size)
    assert weight.format == "q4" and torch.equal(unpack_q4(weight.qs).long(), q)
    assert torch.equal(weight.scales, s[:, group])
    # the only rounding: min = -s z to fp16, |error| <= 2^-11 |s z| (+ 2^-25 below fp16's normal range); the
    # dequantization's own fp32 sum s q + min adds at most 2^-24 (|s q| + |min|)
    sz = (s.double() * z.double())[:, group]
    assert ((weight.mins.double() + sz).abs() <= 2.0**-11 * sz.abs() + 2.0**-25).all()
    bound = (
        (2.0**-11 * sz.abs() + 2.0**-25).repeat_interleave(32, dim=1)
        + 2.0**-23 * exact.abs()
        + 2.0**-23 * (s.double()[:, group].abs() * 15 + sz.abs()).repeat_interleave(32, dim=1)
    )
    assert ((dequantize(weight).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("method, fmt", [("awq", None), ("gptq", "gptq")])
def test_a_narrowed_weight_equals_the_narrowed_dense_tensor(method, fmt) -> None:
    """(d) what a tensor-parallel rank reads: rows anywhere (across AWQ's 8-column words), columns in blocks."""
    q, s, z = random_layer(40, 192, 64, fmt, seed=3)
    tensor = int4_tensor(q, s, z, method, fmt, 64)
    full = tensor.read()
    for dim, start, length in [(0, 3, 13), (0, 8, 16), (0, 0, 40), (1, 32, 64), (1, 96, 96), (-1, 0, 32)]:
        view = tensor.narrow(dim, start, length)
        assert torch.equal(view.read(), full.narrow(dim, start, length))
        assert torch.equal(dequantize(view.quantized()), dequantize(tensor.quantized()).narrow(dim, start, length))
    both = tensor.narrow(0, 5, 30).narrow(1, 64, 128).narrow(0, 2, 9)
    assert torch.equal(both.read(), full[7:16, 64:192])
    with pytest.raises(ValueError, match="whole blocks of 32"):
        tensor.narrow(1, 16, 32)
    with pytest.raises(ValueError, match="cannot narrow"):
        tensor.narrow(0, 30, 11)


# ---------------------------------------------------------------------------------------------------------
# (b) a whole model


@pytest.fixture(scope="module")
def int4_dir(tiny_model_dir, tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(arch: str, method: str, fmt: str | None, sym: bool, group_size: int) -> Path:
        key = (arch, method, fmt, sym, group_size)
        if key not in made:
            out = tmp_path_factory.mktemp("int4") / f"{arch}-{method}-{fmt}-{sym}-{group_size}"
            made[key] = write_int4_checkpoint(tiny_model_dir(arch), out, method, fmt, sym, group_size)
        return made[key]

    return make


def dense_twin(path: Path) -> Path:
    return path.with_name(path.name + "-dense")


@pytest.mark.parametrize("method, fmt, sym", VARIANTS)
@pytest.mark.parametrize("arch, group_size", [("llama", 32), ("llama", 64), ("llama", -1), ("mistral", 32)])
def test_an_int4_checkpoint_stays_within_the_activation_bound_of_its_dense_values(
    int4_dir, arch, group_size, method, fmt, sym
) -> None:
    """Kept in q4, the model differs from the dense model of the same values s (q - z) by the int8 activations
    and the fp16 mins only (ACTIVATION_BOUND). AWQ and GPTQ packings of the same codes give the same logits."""
    path = int4_dir(arch, method, fmt, sym, group_size)
    dense = load_model(dense_twin(path), torch.float32, CPU, quantization="none")
    int4 = load_model(path, torch.float32, CPU)  # "auto"
    formats = quantized_layers(int4)
    assert formats["model.layers.0.self_attn.qkv_proj"] == formats["model.layers.1.mlp.down_proj"] == "q4"
    assert formats["model.embed_tokens"] is None and formats["lm_head"] is None
    ids = token_ids(48, dense.vocab_size, 5)
    kl, top1 = kl_and_top1(prefill_logits(dense, ids), prefill_logits(int4, ids))
    max_kl, min_top1 = ACTIVATION_BOUND
    assert kl < max_kl and top1 >= min_top1, (kl, top1)


@pytest.mark.parametrize("method, fmt, sym", [VARIANTS[0], VARIANTS[2]])
def test_quantization_none_gives_exactly_the_dense_model(int4_dir, method, fmt, sym) -> None:
    path = int4_dir("mistral", method, fmt, sym, 32)
    ours = dict(load_model(path, torch.float32, CPU, quantization="none").named_parameters())
    theirs = dict(load_model(dense_twin(path), torch.float32, CPU, quantization="none").named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_the_engine_serves_an_awq_checkpoint_as_its_dense_values(int4_dir) -> None:
    """The whole path (EngineConfig, the engine's loader, greedy decoding): with quantization "none" the tokens
    are those of the dense checkpoint; kept in q4 they run through the quantized kernels, and a suspend / resume
    that reloads the weights from the checkpoint keeps them."""
    path = int4_dir("llama", "awq", None, False, 64)
    assert greedy(new_engine(path, quantization="none"), "n") == greedy(new_engine(dense_twin(path)), "d")
    engine = new_engine(path)
    assert quantized_layers(engine.model)["model.layers.0.mlp.gate_up_proj"] == "q4"
    tokens = greedy(engine, "a")
    assert [len(t) for t in tokens] == [8, 8, 8]
    engine.suspend()
    engine.resume()
    assert greedy(engine, "b") == tokens


def test_a_tensor_parallel_rank_reads_its_shard_of_the_packed_tensors(int4_dir) -> None:
    """(d) rank 1 of 2: rows of q / k / v and gate / up, whole blocks of columns of o_proj and down_proj, out of
    the GPTQ tensors, dense and kept in q4."""
    from transformers import AutoConfig

    from infer.worker.loading.loader import materialize, pack_weights, quant_plan
    from infer.worker.models.layers import deferred_weights

    path = int4_dir("llama", "gptq", "gptq", False, 32)
    config = AutoConfig.from_pretrained(str(path))
    tp = TensorParallel(rank=1, size=2)
    files = weight_files(path)
    dense = build_model(config, torch.float32, "cpu", tp=tp)
    load_named_tensors(dense, file_tensors(files))
    whole = load_file(str(dense_twin(path) / "model.safetensors"))
    ours = dict(dense.named_parameters())
    layer = "model.layers.1."
    qkv = torch.cat(
        [
            whole[layer + "self_attn.q_proj.weight"][32:64],
            whole[layer + "self_attn.k_proj.weight"][16:32],
            whole[layer + "self_attn.v_proj.weight"][16:32],
        ]
    )
    assert torch.equal(ours[layer + "self_attn.qkv_proj.weight"], qkv)
    assert torch.equal(ours[layer + "self_attn.o_proj.weight"], whole[layer + "self_attn.o_proj.weight"][:, 32:])
    assert torch.equal(ours[layer + "mlp.down_proj.weight"], whole[layer + "mlp.down_proj.weight"][:, 64:])

    with deferred_weights():
        quant = build_model(config, torch.float32, "cpu", tp=tp)
    materialize(quant, quant_plan(quant, files, "auto"), "cpu")
    load_named_tensors(quant, file_tensors(files))
    pack_weights(quant)
    for name, module in quant.named_modules():
        if isinstance(module, QuantStorage) and module.quant is not None:
            exact = ours[f"{name}.weight"]  # |s z| is about the group's |min|: the fp16 min's bound is below
            assert (dequantize(module.quant) - exact).abs().max() <= 2.0**-10 * exact.abs().max(), name


# ---------------------------------------------------------------------------------------------------------
# (c) refusals


@pytest.mark.parametrize(
    "quant, field",
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits"),
        ({"quant_method": "awq", "bits": 4, "group_size": 48, "version": "gemm"}, "group_size"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ],
)
def test_what_is_not_loaded_is_refused_naming_the_field(quant, field) -> None:
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        scheme_of({"quantization_config": quant})


def test_a_dense_config_has_no_scheme() -> None:
    assert scheme_of({"model_type": "llama"}) is None
    assert scheme_of({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64}}) == Int4Scheme(
        "awq", 64, 0
    )


def test_act_order_with_a_shuffled_g_idx_is_refused(int4_dir, tmp_path) -> None:
    path = tmp_path / "act-order"
    shutil.copytree(int4_dir("llama", "gptq", "gptq", True, 32), path)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name][torch.randperm(tensors[name].numel(), generator=torch.Generator().manual_seed(0))]
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="down_proj.g_idx .*desc_act"):
        load_model(path, torch.float32, CPU)


def test_an_unsupported_method_is_refused_at_load(tiny_model_dir, tmp_path) -> None:
    path = tmp_path / "bnb"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    for quantization in ("auto", "none"):
        with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
            load_model(path, torch.float32, CPU, quantization=quantization)


def test_a_zero_bias_of_a_layer_without_one_is_skipped_a_nonzero_one_refused(int4_dir, tmp_path) -> None:
    """Older AutoGPTQ wrote a bias for every layer it quantized; Llama's linears have none."""
    source = int4_dir("llama", "gptq", "gptq", True, 32)
    for value, name in ((0.0, "zero"), (0.5, "nonzero")):
        path = tmp_path / name
        shutil.copytree(source, path)
        tensors = load_file(str(path / "model.safetensors"))
        for prefix in [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]:
            tensors[f"{prefix}.bias"] = torch.full((tensors[f"{prefix}.scales"].shape[1],), value, dtype=torch.float16)
        save_file(tensors, str(path / "model.safetensors"))
        if value == 0.0:
            ours = dict(load_model(path, torch.float32, CPU, quantization="none").named_parameters())
            theirs = dict(load_model(dense_twin(source), torch.float32, CPU, quantization="none").named_parameters())
            assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
        else:
            with pytest.raises(ValueError, match="bias' .*matches no parameter"):
                load_model(path, torch.float32, CPU)
