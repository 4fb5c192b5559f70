"""FP8 block-wise checkpoints (worker/loading/fp8.py, the loader's wiring) load as their dense values.

There is no FP8 checkpoint here, and transformers' own FP8 path wants a GPU, so this file writes them: every decoder
linear of a tiny random model quantized per block [bo, bi] as DeepSeek's and Qwen's releases are (scale = the
block's amax / 448, weight = (w / scale) in float8_e4m3fn, weight_scale_inv = scale), config.json given their
quantization_config; beside it an ordinary float32 checkpoint of the dequantized values (each FP8 value times its
block's scale, computed here by a repeat of the scale grid), which transformers serves as the oracle. Block sizes
that do not divide the tiny shapes exercise the partial last blocks (ceil(out / bo) x ceil(in / bi) scales).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from family_models import FAMILIES, tiny_checkpoint
from hf_reference import transformers_greedy
from model_batches import quantized_layers
from moe_models import tiny_mixtral, tiny_qwen3_moe
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.loading.fp8 import Fp8Scheme, Fp8Tensor, fp8_scheme_of
from infer.worker.loading.loader import build_model, file_tensors, load_model, load_named_tensors, weight_files

CPU = torch.device("cpu")
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DEEPSEEK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
# arch -> weight_block_size: none divides every linear's rows and columns (tiny llama: 64 / 128 / 32 wide; qwen2: 80
# wide, qkv biases; qwen3: q 128 x 64; deepseek_v3: q_a_proj 24 rows, kv_a_proj 48, kv_b_proj 160 x 32, experts
# 32 x 64; qwen3_moe: experts 48 x 64; mixtral: experts w1 / w2 / w3 96 x 64)
BLOCKS = {
    "llama": [24, 40],
    "qwen2": [32, 32],
    "qwen3": [16, 16],
    "deepseek_v3": [32, 32],
    "qwen3_moe": [16, 24],
    "mixtral": [40, 24],
}
# arch -> (expert 5's down projection in the checkpoint, our fused parameter of the layer's experts)
EXPERT_5_DOWN = {
    "deepseek_v3": ("model.layers.2.mlp.experts.5.down_proj", "model.layers.2.mlp.experts.down_proj"),
    "qwen3_moe": ("model.layers.1.mlp.experts.5.down_proj", "model.layers.1.mlp.experts.down_proj"),
    "mixtral": ("model.layers.1.block_sparse_moe.experts.5.w2", "model.layers.1.mlp.experts.down_proj"),
}
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5, 17, 300, 41, 9, 77, 1023, 64, 12, 88, 301, 7, 450, 33, 2, 19, 600], [1000, 2000, 3000], [42]]


# ---------------------------------------------------------------------------------------------------------
# The reference quantizer and dequantizer


def quantize_blocks(w: torch.Tensor, block: list[int], fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (FP8 [N, K], float32 scales [ceil(N / bo), ceil(K / bi)]): scale = amax / FP8 max per block."""
    (n, k), (bo, bi) = w.shape, block
    scales = torch.empty(-(-n // bo), -(-k // bi))
    values = torch.empty(n, k, dtype=FP8_DTYPE[fmt])
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].float()
            scales[i, j] = part.abs().amax().clamp(min=1e-12) / FP8_MAX[fmt]
            values[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (part / scales[i, j]).to(FP8_DTYPE[fmt])
    return values, scales


def scale_grid(scales: torch.Tensor, block: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """float32 [N, K]: each element's block scale (the grid repeated over its blocks)."""
    (n, k), (bo, bi) = shape, block
    return scales.float().repeat_interleave(bo, dim=0)[:n].repeat_interleave(bi, dim=1)[:, :k]


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The dense float32 values: each FP8 value times its block's scale."""
    return values.float() * scale_grid(scales, block, tuple(values.shape))


def is_linear(name: str, tensor: torch.Tensor) -> bool:
    """A decoder linear's weight (q_proj ... down_proj, MLA's q_a / kv_a / kv_b, experts', Mixtral's w1 / w2 / w3),
    not a router."""
    module = name.removesuffix(".weight").rpartition(".")[2]
    return name.endswith(".weight") and tensor.dim() == 2 and ("proj" in module or module in ("w1", "w2", "w3"))


def write_fp8_checkpoint(dense_dir: Path, out: Path, block: list[int] | None, **quant) -> Path:
    """`dense_dir`'s model with its decoder linears in FP8 (per block, or per tensor with block None: one scale)
    into `out`; `out`-dense holds the dequantized values in float32. `quant` overrides quantization_config's
    fields (fmt, activation_scheme, ...). Returns `out`."""
    fmt = quant.get("fmt", "e4m3")
    tensors = load_file(str(dense_dir / "model.safetensors"))
    fp8, dense = {}, {}
    for name, tensor in tensors.items():
        if not is_linear(name, tensor):
            fp8[name] = dense[name] = tensor
            continue
        values, scales = quantize_blocks(tensor, block or list(tensor.shape), fmt)
        prefix = name.removesuffix(".weight")
        fp8[name], fp8[f"{prefix}.weight_scale_inv"] = values, scales if block else scales.reshape(1)
        dense[name] = dequantize_blocks(values, scales, block or list(tensor.shape))
    for directory, weights in ((out, fp8), (dense_twin(out), dense)):
        shutil.copytree(dense_dir, directory)
        (directory / "model.safetensors").unlink()
        save_file(weights, str(directory / "model.safetensors"))
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = {**DEEPSEEK, **({"weight_block_size": block} if block else {}), **quant}
    (out / "config.json").write_text(json.dumps(config))
    return out


def dense_twin(path: Path) -> Path:
    return path.with_name(path.name + "-dense")


def edited(source: Path, out: Path, tensors=None, quant=None) -> Path:
    """A copy of checkpoint `source` whose tensors `tensors(dict)` rewrites and whose quantization_config `quant`
    updates (a None value removes the field)."""
    shutil.copytree(source, out)
    if tensors is not None:
        weights = load_file(str(out / "model.safetensors"))
        tensors(weights)
        save_file({name: t.contiguous() for name, t in weights.items()}, str(out / "model.safetensors"))
    if quant is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"].update(quant)
        config["quantization_config"] = {k: v for k, v in config["quantization_config"].items() if v is not None}
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dir, tmp_path_factory, smollm2_tokenizer):
    """fp8_dir(arch) -> its FP8 checkpoint in BLOCKS[arch] (the dense twin beside it); deepseek_v3: MLA + MoE."""
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            where = tmp_path_factory.mktemp(f"{arch}-source") / "m"
            if arch == "deepseek_v3":
                model_type, fields = FAMILIES[arch]
                source = tiny_checkpoint(where, smollm2_tokenizer, model_type, **fields)
            elif arch in ("qwen3_moe", "mixtral"):
                source = (tiny_qwen3_moe if arch == "qwen3_moe" else tiny_mixtral)(where, tokenizer=smollm2_tokenizer)
            else:
                source = tiny_model_dir(arch)
            out = tmp_path_factory.mktemp("fp8") / arch
            made[arch] = write_fp8_checkpoint(source, out, BLOCKS[arch])
        return made[arch]

    return make


def params(path: Path, dtype: torch.dtype = torch.float32, **options) -> dict[str, torch.Tensor]:
    return dict(load_model(path, dtype, CPU, **options).named_parameters())


def llm(path: Path, **options) -> LLM:
    base = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": 4_000_000, "num_threads": 1, "block_size": 4}
    return LLM(model=str(path), **{**base, **options})


# ---------------------------------------------------------------------------------------------------------
# One weight


def random_fp8(n: int, k: int, block: list[int], fmt: str = "e4m3", seed: int = 0):
    """A random weight of magnitudes over 10^-4 .. 10 by block, quantized: (FP8 values, scales)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 10.0 ** torch.randint(-4, 2, (n, 1), generator=gen).float()
    return quantize_blocks(w, block, fmt)


class Recorded:
    """A checkpoint tensor that records each narrowing read of it: (dim, start, length)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape, self.dtype, self.reads = tensor, tuple(tensor.shape), tensor.dtype, []

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self.reads.append((dim, start, length))
        return self.tensor.narrow(dim, start, length)

    def read(self) -> torch.Tensor:
        self.reads.append("all")
        return self.tensor


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float8_e8m0fnu, "e8m0 bytes"])
def test_a_block_weight_reads_as_each_value_times_its_block_scale_exactly(fmt, scale_dtype) -> None:
    values, scales = random_fp8(70, 100, [16, 24], fmt)
    ue8m0 = scale_dtype in (torch.float8_e8m0fnu, "e8m0 bytes")
    if ue8m0:  # powers of two (DeepSeek-V3.1's scale_fmt "ue8m0")
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    stored = scales.to(torch.float8_e8m0fnu) if ue8m0 else scales.to(scale_dtype)
    if scale_dtype == "e8m0 bytes":
        stored = stored.view(torch.uint8)
    scheme = Fp8Scheme((16, 24), fmt, "ue8m0" if ue8m0 else "float")
    tensor = Fp8Tensor("w.weight", scheme, values, stored, "w.weight_scale_inv")
    assert tensor.shape == (70, 100) and tensor.block == (16, 24)
    grid = scale_grid(scales.to(scale_dtype) if scale_dtype == torch.bfloat16 else scales, [16, 24], (70, 100))
    # the exact product (4 by 24 significant bits: exact in float64) rounded once to float32
    want = (values.double() * grid.double()).float()
    assert tensor.read().dtype == torch.float32 and torch.equal(tensor.read(), want)


def test_a_narrow_reads_only_its_rows_or_columns_and_the_blocks_they_touch() -> None:
    """What a tensor-parallel rank reads: rows (column-parallel) or columns (row-parallel) anywhere, across block
    boundaries; only that window of the weight and the scales of its blocks."""
    values, scales = random_fp8(70, 100, [16, 24], seed=1)
    full = dequantize_blocks(values, scales, [16, 24])
    for dim, start, length, scale_read in [
        (0, 0, 35, (0, 0, 3)),  # rows 0..34: row blocks 0..2
        (0, 35, 35, (0, 2, 3)),  # rows 35..69: row blocks 2..4
        (1, 0, 50, (1, 0, 3)),  # columns 0..49: column blocks 0..2
        (1, 50, 50, (1, 2, 3)),  # columns 50..99: column blocks 2..4
        (-1, 23, 2, (1, 0, 2)),  # two columns across a block boundary
    ]:
        weight, scale = Recorded(values), Recorded(scales)
        view = Fp8Tensor("w.weight", Fp8Scheme((16, 24)), weight, scale, "w.weight_scale_inv").narrow(
            dim, start, length
        )
        assert weight.reads == [] and scale.reads == []  # lazy
        assert torch.equal(view.read(), full.narrow(dim, start, length))
        assert weight.reads == [(dim % 2, start, length)] and scale.reads == [scale_read]
    both = Fp8Tensor("w.weight", Fp8Scheme((16, 24)), values, scales, "s").narrow(0, 5, 60).narrow(1, 30, 41)
    assert torch.equal(both.narrow(0, 7, 20).read(), full[12:32, 30:71])
    for bad, message in [
        (torch.zeros(4, 3, 2), "has shape \\[4, 3, 2\\]"),
        (torch.zeros(0, 8), "has shape \\[0, 8\\]: a linear weight is \\[out, in\\], not empty"),
    ]:
        with pytest.raises(ValueError, match=f"FP8 weight w.weight {message}"):
            Fp8Tensor("w.weight", Fp8Scheme((16, 24)), bad.to(torch.float8_e4m3fn), scales, "s")
    with pytest.raises(ValueError, match="cannot narrow dim 0 to \\[60, 71\\)"):
        Fp8Tensor("w.weight", Fp8Scheme((16, 24)), values, scales, "s").narrow(0, 60, 11)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_scale_of_one_value_scales_the_whole_weight(shape) -> None:
    """Per-tensor FP8 (no weight_block_size; older checkpoints' weight_scale): one scale, any narrowing."""
    values, scales = random_fp8(40, 30, [40, 30], seed=2)
    for block in (None, (16, 16)):
        tensor = Fp8Tensor("w.weight", Fp8Scheme(block), values, scales.reshape(shape), "w.weight_scale")
        assert torch.equal(tensor.read(), values.float() * scales.reshape(()))
        assert torch.equal(tensor.narrow(1, 7, 9).read(), values.float()[:, 7:16] * scales.reshape(()))


# ---------------------------------------------------------------------------------------------------------
# A whole model: (1) exact weights, (2) transformers' tokens, (3) tensor parallel, (4) int8 on top


@pytest.mark.parametrize("arch", list(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_loaded_are_the_dequantized_values_in_the_dtype(fp8_dir, arch, dtype) -> None:
    """Every parameter equals the dense twin's (the same values in float32, cast by the same loader), fused q / k /
    v, gate / up and DeepSeek's experts included; one weight checked against the cast directly."""
    path = fp8_dir(arch)
    ours, theirs = params(path, dtype), params(dense_twin(path), dtype)
    assert ours.keys() == theirs.keys()
    assert all(ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]) for name in ours)
    tensors = load_file(str(path / "model.safetensors"))
    prefix = "model.layers.1.self_attn.o_proj"
    want = dequantize_blocks(tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale_inv"], BLOCKS[arch])
    assert ours[f"{prefix}.weight"].dtype == dtype and torch.equal(ours[f"{prefix}.weight"], want.to(dtype))
    if arch in EXPERT_5_DOWN:  # the routed experts are FP8 too: expert 5's down projection in the fused parameter
        down, fused = EXPERT_5_DOWN[arch]
        want = dequantize_blocks(tensors[f"{down}.weight"], tensors[f"{down}.weight_scale_inv"], BLOCKS[arch])
        assert torch.equal(ours[fused][5], want.to(dtype))


@pytest.mark.parametrize("arch", list(BLOCKS))
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(fp8_dir, arch) -> None:
    path = fp8_dir(arch)
    want = transformers_greedy(dense_twin(path), PROMPTS, MAX_NEW)
    assert [c.token_ids for c in llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)] == want


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_each_tensor_parallel_rank_loads_its_shard_of_the_dequantized_values(fp8_dir, arch) -> None:
    """Ranks 0 and 1 of 2: column-parallel rows and row-parallel columns cut across the blocks (llama: q's 32 rows
    a rank against blocks of 24; DeepSeek's kv_b_proj, o_proj and every expert's slice), equal to the same rank
    loaded from the dense twin."""
    from transformers import AutoConfig

    path = fp8_dir(arch)
    config = AutoConfig.from_pretrained(str(path))
    for rank in (0, 1):
        ours = build_model(config, torch.float32, "cpu", tp=TensorParallel(rank=rank, size=2))
        load_named_tensors(ours, file_tensors(weight_files(path)))
        theirs = build_model(config, torch.float32, "cpu", tp=TensorParallel(rank=rank, size=2))
        load_named_tensors(theirs, file_tensors(weight_files(dense_twin(path))))
        mine, want = dict(ours.named_parameters()), dict(theirs.named_parameters())
        assert mine.keys() == want.keys() and all(torch.equal(mine[name], want[name]) for name in mine)


def test_a_tensor_parallel_rank_reads_half_the_fp8_weights_one_tensor_at_a_time(fp8_dir, monkeypatch) -> None:
    """Every tiny Llama linear is sharded over 2 ranks: a rank reads exactly half of the FP8 elements from the files
    (its rows or columns, by narrowing; never a whole FP8 tensor), and each weight is read just before it is copied
    (one float32 tensor in flight, not the checkpoint)."""
    from transformers import AutoConfig

    from infer.worker.loading import loader

    path = fp8_dir("llama")
    total = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values() if t.dtype in FP8_DTYPE.values())
    events: list[tuple[str, int]] = []
    narrow, whole, copy = loader.FileTensor.narrow, loader.FileTensor.read, loader.load_tensor

    def counted(what: str, tensor: torch.Tensor) -> torch.Tensor:
        events.append((what if tensor.dtype in FP8_DTYPE.values() else "other", tensor.numel()))
        return tensor

    monkeypatch.setattr(loader.FileTensor, "narrow", lambda self, *a: counted("narrow", narrow(self, *a)))
    monkeypatch.setattr(loader.FileTensor, "read", lambda self: counted("read", whole(self)))
    monkeypatch.setattr(loader, "load_tensor", lambda *a: events.append(("copy", 0)) or copy(*a))
    for rank in (0, 1):
        events.clear()
        model = build_model(AutoConfig.from_pretrained(str(path)), torch.float32, "cpu", tp=TensorParallel(rank, 2))
        loader.load_named_tensors(model, loader.file_tensors(weight_files(path)))
        assert sum(n for what, n in events if what == "narrow") == total // 2
        assert not any(what == "read" for what, _ in events)
        kinds = [what for what, _ in events if what != "other"]  # each FP8 read, then its copy
        assert all(kinds[i + 1] == "copy" for i, what in enumerate(kinds) if what == "narrow")


def test_tensor_parallel_size_2_serves_transformers_tokens(fp8_dir) -> None:
    path = fp8_dir("llama")
    want = transformers_greedy(dense_twin(path), PROMPTS, MAX_NEW)
    with llm(path, tensor_parallel_size=2) as served:
        assert [c.token_ids for c in served.generate(PROMPTS, GREEDY, use_tqdm=False)] == want


@pytest.mark.parametrize("quantization, fmt", [("int8", "q8"), ("int4", "q4")])
def test_int8_and_int4_quantize_the_dequantized_values_at_load(fp8_dir, quantization, fmt) -> None:
    """--quantization on top of an FP8 checkpoint: our blocks of 32 quantized from its float32 values, exactly those
    of the dense twin (the same quantizer on the same values); the engine's tokens then equal the twin's."""
    path = fp8_dir("llama")
    model = load_model(path, torch.bfloat16, CPU, quantization=quantization)
    assert quantized_layers(model)["model.layers.0.mlp.gate_up_proj"] == fmt
    ours, theirs = dict(model.named_parameters()), params(dense_twin(path), torch.bfloat16, quantization=quantization)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    if quantization == "int8":
        tokens = [c.token_ids for c in llm(path, quantization="int8").generate(PROMPTS, GREEDY, use_tqdm=False)]
        twin = llm(dense_twin(path), quantization="int8").generate(PROMPTS, GREEDY, use_tqdm=False)
        assert tokens == [c.token_ids for c in twin]


def test_auto_keeps_an_fp8_checkpoint_dense(fp8_dir) -> None:
    model = load_model(fp8_dir("qwen3"), torch.bfloat16, CPU)
    assert set(quantized_layers(model).values()) == {None}


# ---------------------------------------------------------------------------------------------------------
# Other variants that load


def test_per_tensor_e5m2_static_checkpoints_load_and_skip_their_activation_scales(tiny_model_dir, tmp_path) -> None:
    """No weight_block_size: one scale a weight (named weight_scale, as older per-tensor checkpoints do; a 0-d one
    for the embedding, FP8 too as transformers' modules_to_convert makes it); e5m2 weights; activation_scheme
    "static" with input_scale tensors and a KV cache scale, which are skipped (the activations and the KV cache are
    in --dtype)."""
    source = write_fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "pt", None, fmt="e5m2")
    embed = "model.embed_tokens.weight"
    values, scale = quantize_blocks(load_file(str(source / "model.safetensors"))[embed], [1 << 20] * 2, "e5m2")

    def static(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
            prefix = name.removesuffix(".weight_scale_inv")
            tensors[f"{prefix}.weight_scale"] = tensors.pop(name)
            tensors[f"{prefix}.input_scale"] = torch.tensor([0.02])
        tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(1.0)
        tensors[embed], tensors["model.embed_tokens.weight_scale"] = values, scale.reshape(())

    path = edited(source, tmp_path / "static", static, {"activation_scheme": "static"})
    assert fp8_scheme_of(json.loads((path / "config.json").read_text())) == Fp8Scheme(None, "e5m2")
    ours, theirs = params(path), params(dense_twin(source))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs if name != embed)
    assert torch.equal(ours[embed], values.float() * scale.reshape(()))


def test_dense_modules_beside_fp8_ones_load_as_they_are(fp8_dir, tmp_path) -> None:
    """modules_to_not_convert: a linear stored dense in an FP8 checkpoint (DeepSeek's router, Qwen's lm_head)."""
    path = fp8_dir("qwen3")
    name = "model.layers.0.mlp.down_proj"
    twin = load_file(str(dense_twin(path) / "model.safetensors"))

    def dense_down(tensors: dict) -> None:
        del tensors[f"{name}.weight_scale_inv"]
        tensors[f"{name}.weight"] = twin[f"{name}.weight"].to(torch.bfloat16)

    edited_path = edited(path, tmp_path / "mixed", dense_down, {"modules_to_not_convert": [name, "lm_head"]})
    ours = params(edited_path)
    assert torch.equal(ours[f"{name}.weight"], twin[f"{name}.weight"].to(torch.bfloat16).float())
    assert torch.equal(ours["model.layers.1.mlp.down_proj.weight"], twin["model.layers.1.mlp.down_proj.weight"])


# ---------------------------------------------------------------------------------------------------------
# (5) refusals, naming the field or the tensor


@pytest.mark.parametrize(
    "quant, message",
    [
        ({"fmt": "e3m4"}, "quantization_config.fmt 'e3m4' is not supported"),
        ({"weight_block_size": [128]}, "quantization_config.weight_block_size must be two positive integers"),
        ({"weight_block_size": [0, 128]}, "quantization_config.weight_block_size"),
        ({"weight_block_size": "128x128"}, "quantization_config.weight_block_size"),
        ({"activation_scheme": "tensorwise"}, "quantization_config.activation_scheme 'tensorwise'"),
        ({"scale_fmt": "e4m3"}, "quantization_config.scale_fmt 'e4m3'"),
        ({"expert_dtype": "fp4"}, "quantization_config.expert_dtype 'fp4'"),
    ],
)
def test_a_config_we_do_not_load_is_refused_naming_the_field(quant, message) -> None:
    with pytest.raises(ValueError, match=message):
        fp8_scheme_of({"quantization_config": {**DEEPSEEK, "weight_block_size": [128, 128], **quant}})


def test_other_configs_have_no_fp8_scheme() -> None:
    assert fp8_scheme_of({"model_type": "llama"}) is None
    assert fp8_scheme_of({"quantization_config": {"quant_method": "awq"}}) is None
    assert fp8_scheme_of({"quantization_config": {**DEEPSEEK, "weight_block_size": [128, 128]}}) == Fp8Scheme(
        (128, 128), "e4m3", "float"
    )


DOWN = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop(f"{DOWN}.weight_scale_inv"),
            f"FP8 weight '{DOWN}.weight' lacks its scale {DOWN}.weight_scale_inv",
        ),
        (
            lambda t: t.update({f"{DOWN}.weight_scale_inv": t[f"{DOWN}.weight_scale_inv"][:, :2]}),
            f"{DOWN}.weight_scale_inv has shape \\[3, 2\\]; the FP8 weight {DOWN}.weight \\[64, 128\\] in blocks of "
            "\\[24, 40\\] \\(quantization_config.weight_block_size\\) needs \\[3, 4\\]",
        ),
        (
            lambda t: t.update({f"{DOWN}.weight_scale_inv": t[f"{DOWN}.weight_scale_inv"].to(torch.int32)}),
            f"{DOWN}.weight_scale_inv is torch.int32",
        ),
        (
            lambda t: t.update({f"{DOWN}.weight": t[f"{DOWN}.weight"].float().to(torch.float8_e5m2)}),
            f"{DOWN}.weight is torch.float8_e5m2, but quantization_config.fmt 'e4m3' stores torch.float8_e4m3fn",
        ),
        (
            lambda t: t[f"{DOWN}.weight_scale_inv"].__setitem__((1, 1), float("nan")),
            f"{DOWN}.weight_scale_inv: a scale is not finite",
        ),
        (
            lambda t: (
                t.update({"model.layers.1.mlp.gate_proj.weight_scale_inv": torch.ones(3, 2)})
                or t.pop("model.layers.1.mlp.gate_proj.weight")
            ),
            "'model.layers.1.mlp.gate_proj.weight_scale_inv' scales a weight the checkpoint lacks",
        ),
        (
            lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn)}),
            "FP8 weight 'model.norm.weight' lacks its scale",
        ),
    ],
    ids=["no scale", "scale shape", "scale dtype", "weight format", "nan scale", "orphan scale", "fp8 norm"],
)
def test_a_bad_tensor_is_refused_naming_it(fp8_dir, tmp_path, edit, message) -> None:
    path = edited(fp8_dir("llama"), tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, CPU)


def test_block_scales_without_a_block_size_are_refused(fp8_dir, tmp_path) -> None:
    path = edited(fp8_dir("llama"), tmp_path / "no-block", quant={"weight_block_size": None})
    with pytest.raises(
        ValueError, match="weight_scale_inv has shape \\[.*\\]: without quantization_config.weight_block"
    ):
        load_model(path, torch.float32, CPU)


def test_fp8_tensors_without_an_fp8_quantization_config_are_refused(fp8_dir, tmp_path) -> None:
    """Without quantization_config nothing says what scales an FP8 tensor: refused by name, not cast unscaled."""
    path = tmp_path / "undeclared"
    shutil.copytree(fp8_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match='is float8_e4m3fn, but config.json has no quantization_config with quant_method "fp8"'
    ):
        load_model(path, torch.float32, CPU)


def test_the_worker_exits_2_naming_the_tensor_without_a_traceback(fp8_dir, tmp_path) -> None:
    """A bad checkpoint never crashes the daemon: its fatal line names the tensor, exit 2 (a usage error)."""
    path = edited(fp8_dir("llama"), tmp_path / "bad", lambda t: t.pop(f"{DOWN}.weight_scale_inv"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "infer.worker.service.daemon",
            "--coordinator",
            "tcp://127.0.0.1:9",
            "--model",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 2, log[-2000:]
    assert f"lacks its scale {DOWN}.weight_scale_inv" in log and "Traceback" not in log, log[-2000:]
