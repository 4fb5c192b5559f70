"""The native batch-1 GEMV (kernels/cpu/gemv.c) against float64 and F.linear, and the linear layers' dispatch to it,
in every build this CPU runs (the `isa` fixture): AVX512-BF16 products by pairs, AVX2's bf16 weights widened to
fp32 with fp32 activations or bf16 ones, and the generic build, which has none and leaves the layers on oneDNN.

N = 960 / 3072 / 576 and K = 576 / 1536 are SmolLM2's projections; 1, 7, 9 and 13 rows leave a tail after the
blocks of 8, and K = 1, 31, 33 and 100 a tail after the chunks of 32.
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
from infer.worker.models.layers import ColumnLinear, RowLinear

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


@pytest.mark.parametrize("rows", [9, 16, 17, 40])
def test_more_than_eight_rows_each_get_what_they_get_alone(rows: int, native_gemv: int) -> None:
    """Past 8 rows (the native decode step's verification rows) the GEMV takes each weight row once for groups of 8
    rows (AVX512-BF16) or tiles them (the fp32 core): each output row is still the one-row GEMV's, bit for bit."""
    _, w = operands(960, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = gemv(x, w)
    assert got.shape == (rows, 960)
    for m in range(rows):
        assert torch.equal(got[m], gemv(x[m : m + 1].contiguous(), w)[0]), m


@pytest.mark.parametrize("rows", [9, 10, 11, 96, 97, 200])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (7, 33), (9, 31), (1, 100)])
def test_a_prefill_s_rows_on_the_fp32_core_have_the_bits_of_a_gemv(rows: int, n: int, k: int, native_gemv: int) -> None:
    """Past 8 rows the fp32 core multiplies in tiles (3 rows x 2 weight rows, x widened 96 rows at a time): each
    output has the bits of the one-row GEMV's (so a prefill row equals the decode of it), within float64's bound,
    bf16 rows and fp32 ones alike. Rows of x from a wider buffer; tails of rows, weight rows and K."""
    if not native_gemv & GEMV_BF16_FP32_CORE:
        pytest.skip("AVX512-BF16 builds multiply more than 8 bf16 rows with oneDNN")
    g = torch.Generator().manual_seed(rows * 31 + n)
    wide = torch.randn(rows, k + 9, generator=g).to(torch.bfloat16)
    x = wide[:, 5 : 5 + k]
    w = torch.randn(n, k, generator=g).div_(k**0.5).to(torch.bfloat16)
    got, got32 = gemv(x, w), gemv_bf16w_f32x(x.float(), w)
    assert got.shape == got32.shape == (rows, n)
    exact = x.double() @ w.double().t()
    assert ((got32.double() - exact).abs() <= (x.double().abs() @ w.double().abs().t()) * (k + 2) * 2.0**-24).all()
    assert torch.equal(got, got32.to(torch.bfloat16))
    for m in sorted({0, 1, 2, 3, rows // 2, rows - 2, rows - 1}):
        assert torch.equal(got[m], gemv(x[m : m + 1].contiguous(), w)[0]), m
        assert torch.equal(got32[m], gemv_bf16w_f32x(x[m : m + 1].float(), w)[0]), m


@pytest.mark.parametrize("onednn_packs_bf16", [True, False], ids=["packed", "no-onednn-bf16"])
def test_layers_take_the_gemv_for_one_to_eight_bf16_rows(monkeypatch, native_gemv: int, onednn_packs_bf16) -> None:
    """Also where oneDNN packs no bf16 weight (an AVX2 CPU: it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT): the GEMV
    is the fast path there most of all (it was once tied to the packing, and an AVX2 machine's bf16 decode ran on
    ATen's bf16 matmul at 0.84x llama.cpp's speed), and there the fp32 core takes a prefill's rows too."""
    if not onednn_packs_bf16:
        monkeypatch.setattr("infer.worker.models.layers._pack_for_cpu", lambda w: None)
    rows_seen: list[int] = []
    monkeypatch.setattr(
        "infer.worker.models.layers.gemv", lambda x, w, b=None: rows_seen.append(x.shape[0]) or gemv(x, w, b)
    )
    layer = ColumnLinear(64, 48, bias=True, dtype=torch.bfloat16)
    x, w = operands(48, 64, seed=5)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.linspace(-1, 1, 48))
    layer.pack_weights()
    assert layer.gemv_native
    one = layer(x)
    assert rows_seen == [1]
    assert torch.equal(one, gemv(x, w, layer.bias))  # the bias fused (one rounding)
    eight = layer(x.expand(8, 64).contiguous())
    assert rows_seen == [1, 8] and torch.equal(eight[7], one[0])
    nine = layer(x.expand(9, 64).contiguous())  # nine rows: oneDNN where it packs
    layer(torch.cat([x, x], dim=1)[:, ::2])  # a column stride of 2: not the GEMV
    takes_nine = layer.packed is None and bool(native_gemv & GEMV_BF16_FP32_CORE)  # (ONEDNN_MAX_CPU_ISA=AVX2 too)
    assert rows_seen == ([1, 8, 9] if takes_nine else [1, 8])
    if takes_nine:
        assert torch.equal(nine[8], one[0])
    fp32 = RowLinear(64, 48, bias=False, dtype=torch.float32)
    fp32.weight.data.copy_(w.float())
    fp32.pack_weights()
    assert not fp32.gemv_native and not gemv_takes(w.t())  # fp32, and a transposed weight


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
