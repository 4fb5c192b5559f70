"""The native batch-1 GEMV (kernels/cpu/gemv.c) against float64 and F.linear, and the linear layers' dispatch to it,
in every build this CPU runs (the `isa` fixture): AVX512-BF16 products by pairs, AVX2's bf16 weights widened to
fp32 with fp32 activations or bf16 ones, and the generic build, which has none and leaves the layers on oneDNN.

N = 960 / 3072 / 576 and K = 576 / 1536 are SmolLM2's projections; 1, 7, 9 and 13 rows leave a tail after the
blocks of 8 (and after the tiles' 4), and K = 1, 31, 33 and 100 a tail after the chunks of 32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import cpu_kernels
from infer.kernels.cpu_kernels import (
    GEMV_BF16_FP32_CORE,
    GEMV_BF16_PAIRS,
    GEMV_F32X,
    gemv,
    gemv_bf16w_f32x,
    gemv_paths,
    gemv_takes,
)
from infer.worker.models.layers import ColumnLinear, RowLinear, onednn_packs_bf16

pytestmark = pytest.mark.usefixtures("isa")  # every test once per build this CPU runs (conftest.py)


@pytest.fixture
def native_gemv(isa: str) -> int:
    """The build's GEMV paths; a build without a GEMV (generic) skips: `test_each_build_has_the_gemv_it_should`
    checks that it is only that one."""
    paths = gemv_paths()
    if not paths & (GEMV_BF16_PAIRS | GEMV_BF16_FP32_CORE):
        pytest.skip(f"the {isa} build has no native GEMV: the linears keep oneDNN")
    return paths


def test_each_build_has_the_gemv_it_should(isa: str) -> None:
    """avx512: bf16 pairs where the CPU has AVX512-BF16, else the fp32 core; avx2: the fp32 core; generic: none,
    and then no weight is taken (the layers keep oneDNN)."""
    flags = cpu_kernels._cpu_flags().split()
    want = {
        "avx512": (GEMV_BF16_PAIRS if "avx512_bf16" in flags else GEMV_BF16_FP32_CORE) | GEMV_F32X,
        "avx2": GEMV_BF16_FP32_CORE | GEMV_F32X,
        "generic": 0,
    }[isa]
    assert gemv_paths() == want
    _, w = operands(16, 64, seed=0)
    assert gemv_takes(w) == (want != 0)


def operands(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).div_(k**0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize(
    "n,k", [(960, 576), (3072, 576), (576, 1536), (1, 576), (7, 33), (9, 31), (13, 100), (1000, 1), (4099, 64)]
)
def test_gemv_matches_float64_and_oneDNN(n: int, k: int, native_gemv: int) -> None:
    x, w = operands(n, k, seed=n * 7 + k)
    x_before, w_before = x.clone(), w.clone()
    got = gemv(x, w)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    assert torch.equal(x, x_before) and torch.equal(w, w_before)
    exact = x.double() @ w.double().t()
    # one rounding to bf16 (2^-9 relative) plus fp32 sums over k products
    bound = exact.abs() * 2.0**-8 + (x.double().abs() @ w.double().abs().t()) * k * 2.0**-23
    assert ((got.double() - exact).abs() <= bound).all()
    ours, theirs = got.view(torch.int16).int(), F.linear(x, w).view(torch.int16).int()
    apart = (ours - theirs).abs()
    assert apart.max() <= 1 and (apart > 0).float().mean() < 0.05  # the sums' order differs from oneDNN's


def test_gemv_threads_split_the_rows_without_gaps_or_overlap(native_gemv: int) -> None:
    """Each thread's range of blocks: every output written once, whatever the thread count."""
    x, w = operands(8 * 37 + 5, 64, seed=3)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outs.append(gemv(x, w))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("rows", [2, 3, 5, 8])
def test_each_of_several_rows_gets_what_it_gets_alone(rows: int, native_gemv: int) -> None:
    """Rows of x read from a wider buffer (row stride > K): each output row is the one-row GEMV's, bit for bit
    (each weight row is read once for all of them, each sum taken as for one row)."""
    wide = torch.randn(rows, 600, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    x = wide[:, 7:583]
    _, w = operands(1000, 576, seed=rows)
    got = gemv(x, w)
    assert got.shape == (rows, 1000)
    for m in range(rows):
        assert torch.equal(got[m], gemv(x[m : m + 1].contiguous(), w)[0]), m


@pytest.mark.parametrize("rows", [9, 10, 11, 96, 97, 200])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (7, 33), (9, 31), (1, 100), (4099, 64), (13, 4100)])
def test_a_prefill_s_rows_have_the_bits_of_a_gemv(rows: int, n: int, k: int, native_gemv: int) -> None:
    """Past 8 rows the GEMV multiplies in tiles (AVX512-BF16: 2 rows x 4 weight rows, 96 rows of x a pass; the fp32
    core: 3 x 2, x widened 96 rows at a time): each output has the bits of the one-row GEMV's (so a prefill row
    equals the decode of it), the bias fused, within float64's bound. On the fp32 core the fp32 outputs too. Rows
    of x from a wider buffer; tails of rows, weight rows (not whole tiles, not whole threads' shares) and K; K past
    2048 (AVX512-BF16 sums it in passes, the accumulators carried)."""
    g = torch.Generator().manual_seed(rows * 31 + n)
    wide = torch.randn(rows, k + 9, generator=g).to(torch.bfloat16)
    x = wide[:, 5 : 5 + k]
    w = torch.randn(n, k, generator=g).div_(k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    got, biased = gemv(x, w), gemv(x, w, bias)
    assert got.shape == biased.shape == (rows, n)
    exact = x.double() @ w.double().t()
    bound = exact.abs() * 2.0**-8 + (x.double().abs() @ w.double().abs().t()) * k * 2.0**-23
    assert ((got.double() - exact).abs() <= bound).all()
    for m in sorted({0, 1, 2, 3, rows // 2, rows - 2, rows - 1}):
        assert torch.equal(got[m], gemv(x[m : m + 1].contiguous(), w)[0]), m
        assert torch.equal(biased[m], gemv(x[m : m + 1].contiguous(), w, bias)[0]), m
    if native_gemv & GEMV_BF16_FP32_CORE:
        got32 = gemv_bf16w_f32x(x.float(), w)
        assert ((got32.double() - exact).abs() <= (x.double().abs() @ w.double().abs().t()) * (k + 2) * 2.0**-24).all()
        assert torch.equal(got, got32.to(torch.bfloat16))
        for m in sorted({0, rows // 2, rows - 1}):
            assert torch.equal(got32[m], gemv_bf16w_f32x(x[m : m + 1].float(), w)[0]), m


def test_layers_send_every_bf16_row_to_the_gemv_and_keep_one_copy(monkeypatch, native_gemv: int) -> None:
    """A bf16 linear takes the GEMV at every row count (1-8 streamed, more in tiles), each row with the bits it has
    alone, and keeps no oneDNN-packed copy beside its weight (on AVX512-BF16 that copy once doubled the weights'
    memory; on an AVX2 CPU oneDNN packs no bf16 weight at all, and ATen's bf16 matmul ran at 0.84x llama.cpp's
    speed). A column stride of 2 is copied to unit stride first. fp32 weights keep oneDNN's packed path. (A CPU
    with AMX-BF16 keeps the packed copy for prefills: the next test; here the layer is told it has none.)"""
    monkeypatch.setattr("infer.worker.models.layers.amx_bf16", lambda: False)
    rows_seen: list[int] = []
    monkeypatch.setattr(
        "infer.worker.models.layers.gemv", lambda x, w, b=None: rows_seen.append(x.shape[0]) or gemv(x, w, b)
    )
    layer = ColumnLinear(64, 48, bias=True, dtype=torch.bfloat16)
    x, w = operands(48, 64, seed=5)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.linspace(-1, 1, 48))
    layer.pack_weights()
    assert layer.gemv_native and layer.packed is None
    one = layer(x)
    assert torch.equal(one, gemv(x, w, layer.bias))  # the bias fused (one rounding)
    eight = layer(x.expand(8, 64).contiguous())
    nine = layer(x.expand(9, 64).contiguous())
    strided = layer(torch.stack([x, -x], dim=2).reshape(1, 128)[:, ::2])  # x, column stride 2
    assert rows_seen == [1, 8, 9, 1]
    assert torch.equal(eight[7], one[0]) and torch.equal(nine[8], one[0]) and torch.equal(strided, one)
    fp32 = RowLinear(64, 48, bias=False, dtype=torch.float32)
    fp32.weight.data.copy_(w.float())
    fp32.pack_weights()
    assert not fp32.gemv_native and not gemv_takes(w.t())  # fp32, and a transposed weight
    assert (fp32.packed is not None) == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("why", ["amx", "prepack"])
def test_an_amx_cpu_or_prepack_keeps_onednn_s_packed_copy_for_more_than_eight_rows(
    monkeypatch, native_gemv: int, why: str
) -> None:
    """With AMX-BF16 oneDNN multiplies a prefill's rows on the AMX tiles, and `prepack` asks for its copy anywhere:
    the layer keeps its packed copy for more than 8 rows and the GEMV for 1-8. prepack False drops it on AMX too. Where
    oneDNN cannot pack bf16 (AVX2 without AVX-NE-CONVERT) there is no copy to keep: the GEMV takes every row."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    twin = onednn_packs_bf16()
    if why == "amx":
        monkeypatch.setattr("infer.worker.models.layers.amx_bf16", lambda: True)
    else:
        monkeypatch.setattr(ColumnLinear, "prepack", True)
    rows_seen: list[int] = []
    monkeypatch.setattr(
        "infer.worker.models.layers.gemv", lambda x, w, b=None: rows_seen.append(x.shape[0]) or gemv(x, w, b)
    )
    layer = ColumnLinear(64, 48, bias=False, dtype=torch.bfloat16)
    x, w = operands(48, 64, seed=6)
    layer.weight.data.copy_(w)
    layer.pack_weights()
    assert layer.gemv_native and (layer.packed is not None) == twin
    eight, nine = layer(x.expand(8, 64).contiguous()), layer(x.expand(9, 64).contiguous())
    assert rows_seen == ([8] if twin else [8, 9])
    assert nine.shape == (9, 48) and (nine.float() - F.linear(x.float(), w.float())).abs().max() < 0.05  # oneDNN's
    assert torch.equal(eight[0], gemv(x, w)[0])
    monkeypatch.setattr(ColumnLinear, "prepack", False)
    layer.pack_weights()
    assert layer.gemv_native and layer.packed is None


# ---- bf16 weights, fp32 activations (the fp32 core) ---------------------------------------------------------


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (7, 33), (9, 31), (1000, 1), (4099, 64)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_bf16_weights_fp32_rows_match_float64_and_each_row_alone(n: int, k: int, rows: int, native_gemv: int) -> None:
    """fp32 outputs within the bound of fp32 sums over k products of float64 (each FMA rounds once), and each row
    the bits it gets alone."""
    g = torch.Generator().manual_seed(n + k + rows)
    wide = torch.randn(rows, k + 5, generator=g)
    x = wide[:, 2 : k + 2]  # rows of a wider buffer: row stride > K
    w = torch.randn(n, k, generator=g).div_(k**0.5).to(torch.bfloat16)
    got = gemv_bf16w_f32x(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    exact = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * (k + 2) * 2.0**-24
    assert ((got.double() - exact).abs() <= bound).all()
    for m in range(rows):
        assert torch.equal(got[m], gemv_bf16w_f32x(x[m : m + 1].contiguous(), w)[0]), m


def test_on_the_fp32_core_the_bf16_gemv_is_the_fp32_one_rounded(native_gemv: int) -> None:
    """Where the bf16 GEMV runs on the fp32 core (AVX2), bf16 rows give the fp32 variant's sums rounded once to
    bf16, bit for bit (x is widened exactly); with bf16 pairs (AVX512-BF16) the two are within a bf16 ulp."""
    x, w = operands(3072, 576, seed=9)
    x = x.expand(5, 576).contiguous().mul_(torch.linspace(0.5, 2, 5).to(torch.bfloat16)[:, None])
    rounded = gemv_bf16w_f32x(x.float(), w).to(torch.bfloat16)
    if native_gemv & GEMV_BF16_FP32_CORE:
        assert torch.equal(gemv(x, w), rounded)
    else:
        apart = (gemv(x, w).view(torch.int16).int() - rounded.view(torch.int16).int()).abs()
        assert apart.max() <= 1


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 40])
def test_a_bias_is_added_to_the_fp32_sums_before_their_one_rounding(rows: int, native_gemv: int) -> None:
    """gemv(x, w, bias) rounds sum + bias once, as a fused linear does (rounding the product, then the sum with the
    bias, rounds twice: on GPT-OSS's biased router that flipped experts and put its bf16 logits 5x further from fp32
    than transformers' bf16). On the fp32 core the bits are those of the fp32 sums plus the bias, rounded; with bf16
    pairs within a bf16 ulp of them; each row the bits it gets alone, past 8 rows too."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    w = torch.randn(200, 96, generator=g).div_(96**0.5).to(torch.bfloat16)
    bias = (torch.randn(200, generator=g) * 3).to(torch.bfloat16)
    got = gemv(x, w, bias)
    fused = (gemv_bf16w_f32x(x.float(), w) + bias.float()).to(torch.bfloat16)
    if native_gemv & GEMV_BF16_FP32_CORE:
        assert torch.equal(got, fused)
    else:
        assert (got.view(torch.int16).int() - fused.view(torch.int16).int()).abs().max() <= 1
    for m in {0, rows - 1}:
        assert torch.equal(got[m], gemv(x[m : m + 1].contiguous(), w, bias)[0])
    twice = gemv(x, w).add_(bias)
    assert not torch.equal(got, twice)  # (the double rounding this replaces differs somewhere on these operands)
    with pytest.raises(ValueError, match="contiguous bf16 bias of \\[200\\]"):
        gemv(x, w, bias.float())


def test_fp32_rows_are_checked(native_gemv: int) -> None:
    x, w = operands(16, 64, seed=2)
    with pytest.raises(ValueError, match="takes fp32 rows"):
        gemv_bf16w_f32x(x, w)  # bf16 rows
    with pytest.raises(ValueError, match="takes at least one row"):
        gemv_bf16w_f32x(x.float()[:0], w)
