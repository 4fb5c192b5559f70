"""Weight-only quantized matmul (kernels/quant_triton.py): the twin against a float64 product of the layout
decoded independently here, and both Triton kernels (gemv, dot), split and unsplit, against the twin.

Tiny shapes run everywhere (under TRITON_INTERPRET=1 on a CPU): N = 40 leaves ragged column tiles, K = 96 a
ragged K step, M = 3 and 17 partial row tiles. The real shapes (SmolLM2-135M's and a 1B Llama's projections,
bf16) run on CUDA only.

Tolerance (kernel vs twin, per element): both accumulate in fp32 and round the result to x's dtype once, and
the dot kernel also rounds each dequantized weight to x's dtype, so
    |kernel - twin| <= (u + K * 2^-23) * (|x| @ (|scale * q| + |min|)^T) + 2 * u * |twin|,
u the unit roundoff of x's dtype (fp32 2^-24, fp16 2^-11, bf16 2^-8).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, requires_triton

from infer.kernels.dispatch import kernels_for
from infer.kernels.quant import BLOCK, QuantWeight, quantize
from infer.kernels.quant_triton import (
    GEMV_MAX_M,
    _plan,
    quant_matmul_torch,
    quant_matmul_triton,
)


def quant_matmul_gpu(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """What the engine runs for a quantized weight on DEVICE where the native CPU kernel does not take it."""
    return kernels_for(DEVICE).quant_matmul(x, weight, False)


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
FORMATS = ["q4", "q8", "q8-affine"]
requires_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="real shapes and bf16 need a CUDA GPU")
# The tiny kernel cases: fp32 and fp16 in the interpreter; on a GPU bf16 only (each dtype is another dozen
# compilations; fp16 is compiled by the real-shape cases below).
TINY_DTYPES = [torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32, torch.float16]


def random_weight(fmt: str, n: int, k: int, seed: int, device: torch.device = DEVICE) -> QuantWeight:
    """Random storage covering every code (q4 0..15, q8 -128..127), scales ~ 1/sqrt(K) scaled, mins around 0."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // BLOCK
    scales = ((torch.rand(n, blocks, generator=g) + 0.5) * (4 / k**0.5)).to(torch.float16)
    if fmt == "q4":
        qs = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        mins = (-8 * scales.float() * (1 + 0.2 * torch.randn(n, blocks, generator=g))).to(torch.float16)
    else:
        qs = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scales = (scales.float() / 16).to(torch.float16)
        mins = (
            (scales.float() * torch.randn(n, blocks, generator=g) * 4).to(torch.float16) if fmt == "q8-affine" else None
        )
    return QuantWeight(fmt[:2], qs.to(device), scales.to(device), None if mins is None else mins.to(device))


def decoded64(weight: QuantWeight, absolute: bool = False) -> torch.Tensor:
    """The weight [N, K] in float64, read from the layout element by element (not through quant.dequantize):
    element k of a row is in block k // 32; for q4 in byte 16 * (k // 32) + k % 16 of the row, the low nibble
    for k % 32 < 16, else the high one. `absolute`: |scale * q| + |min| instead, the size of the terms the
    kernels round (the gemv applies the min to the block's sum of x, apart from scale * q)."""
    n, k = weight.shape
    ks = torch.arange(k, device=weight.qs.device)
    if weight.format == "q4":
        packed = weight.qs[:, 16 * (ks // 32) + ks % 16].long()
        q = torch.where(ks % 32 < 16, packed & 15, packed >> 4)
    else:
        q = weight.qs.long()
    values = q.double() * weight.scales.double()[:, ks // 32]
    mins = weight.mins.double()[:, ks // 32] if weight.mins is not None else torch.zeros_like(values)
    return values.abs() + mins.abs() if absolute else values + mins


def assert_within_bound(got: torch.Tensor, twin: torch.Tensor, x: torch.Tensor, weight: QuantWeight, what: str) -> None:
    """The module docstring's bound, elementwise; NaN anywhere fails."""
    assert got.shape == twin.shape and got.dtype == twin.dtype, (got.shape, got.dtype, twin.shape, twin.dtype)
    assert not torch.isnan(got).any(), f"{what}: NaN in the output"
    u = UNIT_ROUNDOFF[x.dtype]
    magnitude = x.double().abs() @ decoded64(weight, absolute=True).t()
    bound = (u + x.shape[1] * 2.0**-23) * magnitude + 2 * u * twin.double().abs()
    excess = (got.double() - twin.double()).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{what}: element {divmod(worst, got.shape[1])} is {got.flatten()[worst]} vs twin "
        f"{twin.flatten()[worst]}, bound {bound.flatten()[worst]:.3g}"
    )


def operands(fmt: str, m: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, QuantWeight]:
    seed = zlib.crc32(repr((fmt, m, n, k, dtype)).encode())
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    return x, random_weight(fmt, n, k, seed + 1)


# ---------------------------------------------------------------------------------------------------------
# The twin


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_twin_is_the_float64_product_of_the_layout(fmt, dtype):
    x, weight = operands(fmt, 5, 40, 96, dtype)
    twin = quant_matmul_torch(x, weight)
    assert twin.shape == (5, 40) and twin.dtype == dtype
    exact = x.double() @ decoded64(weight).t()
    u = UNIT_ROUNDOFF[dtype]
    bound = 96 * 2.0**-23 * (x.double().abs() @ decoded64(weight).abs().t()) + u * exact.abs()
    assert ((twin.double() - exact).abs() <= bound).all()


def test_twin_of_our_own_quantizer_is_close_to_the_dense_product():
    """quantize() then the twin: within the quantization error of the dense weight."""
    g = torch.Generator().manual_seed(7)
    dense = torch.randn(48, 128, generator=g) / 128**0.5
    x = torch.randn(3, 128, generator=g)
    for fmt, relative in (("q8", 0.02), ("q4", 0.2)):
        got = quant_matmul_torch(x, quantize(dense, fmt))
        exact = x @ dense.t()
        assert (got - exact).norm() <= relative * exact.norm(), fmt


# ---------------------------------------------------------------------------------------------------------
# The kernels against the twin


PLANS = {
    "auto": {},
    "gemv": {"kernel": "gemv"},
    "dot": {"kernel": "dot"},
    "gemv-unsplit": {"kernel": "gemv", "splits": 1},
    "dot-unsplit": {"kernel": "dot", "splits": 1},
}
CASES = [(m, plan) for m in (1, 3, 17) for plan in PLANS if not (m > 16 and PLANS[plan].get("kernel") == "gemv")]


@requires_triton
@pytest.mark.parametrize("dtype", TINY_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,plan", CASES, ids=[f"M{m}-{plan}" for m, plan in CASES])
@pytest.mark.parametrize("k", [64, 96])
def test_kernels_match_the_twin(k, m, plan, fmt, dtype):
    x, weight = operands(fmt, m, 40, k, dtype)
    before = {name: t.clone() for name, t in weight.tensors().items()}
    got = quant_matmul_triton(x, weight, **PLANS[plan])
    assert_within_bound(got, quant_matmul_torch(x, weight), x, weight, f"{fmt} {plan} M={m} K={k}")
    assert all(torch.equal(t, before[name]) for name, t in weight.tensors().items()), "the weight was modified"


def test_plans_cover_both_kernels_split_and_unsplit():
    """Under the interpreter the tiny cases above reach every launch shape: gemv and dot (both row tiles), with
    and without splits (on a GPU the real shapes split)."""
    cpu = torch.device("cpu")
    seen = {
        (p.kernel, p.block_m, p.splits > 1)
        for m, plan in CASES
        for k in (64, 96)
        for p in [_plan(m, 40, k // BLOCK, cpu, **PLANS[plan])]
    }
    for kernel, block_m in (("gemv", 1), ("gemv", 4), ("dot", 16), ("dot", 64)):
        assert (kernel, block_m, True) in seen and (kernel, block_m, False) in seen, (kernel, block_m, seen)


@requires_triton
@pytest.mark.parametrize("kernel", ["gemv", "dot"])
def test_strided_x_rows_and_columns(kernel):
    """x as a column slice of a wider buffer (row stride > K), and as a transposed buffer (column stride > 1)."""
    dtype = torch.float16
    weight = random_weight("q4", 40, 96, seed=11)
    wide = torch.randn(3, 200, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    for x in (wide[:, 50:146], wide[:, 50:146].t().contiguous().t()):
        got = quant_matmul_triton(x, weight, kernel=kernel)
        assert_within_bound(got, quant_matmul_torch(x.contiguous(), weight), x, weight, f"strides {x.stride()}")


@requires_triton
@pytest.mark.parametrize("kernel", ["gemv", "dot"])
def test_weight_rows_past_32_bit_offsets(kernel):
    """Weight rows 2^30 bytes apart (untouched pages are never mapped): row 3 of qs starts past 2^31."""
    n, k, row = 4, 64, 2**30
    dense = random_weight("q4", n, k, seed=5)
    qs = torch.empty(row * (n - 1) + k // 2, dtype=torch.uint8, device=DEVICE).as_strided((n, k // 2), (row, 1))
    qs.copy_(dense.qs)
    weight = QuantWeight("q4", qs, dense.scales, dense.mins)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert_within_bound(
        quant_matmul_triton(x, weight, kernel=kernel), quant_matmul_torch(x, dense), x, dense, "far rows"
    )


@pytest.mark.parametrize(
    "impl", [quant_matmul_torch, pytest.param(quant_matmul_triton, marks=requires_triton), quant_matmul_gpu]
)
def test_no_rows_give_an_empty_result(impl):
    x, weight = operands("q4", 0, 40, 64, torch.float32)
    out = impl(x, weight)
    assert out.shape == (0, 40) and out.dtype == torch.float32


@pytest.mark.parametrize("impl", [quant_matmul_torch, quant_matmul_triton, quant_matmul_gpu])
def test_bad_arguments_are_value_errors(impl):
    x, weight = operands("q8", 2, 40, 64, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        impl(x[:, :32], weight)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        impl(x[0], weight)
    with pytest.raises(ValueError, match="x must be one of"):
        impl(x.to(torch.float64), weight)
    with pytest.raises(ValueError, match="must be a QuantWeight"):
        impl(x, weight.qs)


def test_kernel_specific_refusals():
    x, weight = operands("q8", 17, 40, 64, torch.float32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        quant_matmul_triton(x, weight, kernel="gemv")
    with pytest.raises(ValueError, match="'gemv' or 'dot'"):
        quant_matmul_triton(x, weight, kernel="mma")
    wide = torch.zeros(40, 128, dtype=torch.int8, device=DEVICE)
    strided = QuantWeight("q8", wide[:, ::2], weight.scales)
    with pytest.raises(ValueError, match="contiguous along K"):
        quant_matmul_triton(x, strided)


def test_dispatch_runs_the_twin_off_cuda_and_the_gemv_for_few_rows():
    x, weight = operands("q4", 2, 40, 64, torch.float32)
    if DEVICE.type != "cuda":
        assert torch.equal(quant_matmul_gpu(x, weight), quant_matmul_torch(x, weight))
    assert _plan(GEMV_MAX_M, 4096, 64, DEVICE).kernel == "gemv"
    assert _plan(GEMV_MAX_M + 1, 4096, 64, DEVICE).kernel == "dot"


# ---------------------------------------------------------------------------------------------------------
# Real shapes, bf16, on a GPU

SMOLLM2 = [(576, 576), (960, 576), (3072, 576), (576, 1536)]  # [N, K]: o, qkv, gate_up, down
LLAMA_1B = [(2048, 2048), (3072, 2048), (16384, 2048), (2048, 8192)]  # o, qkv, gate_up, down


REAL_CASES = [(shape, m) for shape in SMOLLM2 for m in (1, 8)] + [(shape, m) for shape in LLAMA_1B for m in (1, 8, 100)]


@requires_cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,m", REAL_CASES, ids=[f"{n}x{k}-M{m}" for (n, k), m in REAL_CASES])
def test_real_shapes_in_bf16_on_cuda(shape, m, fmt):
    n, k = shape
    x, weight = operands(fmt, m, n, k, torch.bfloat16)
    got = quant_matmul_gpu(x, weight)
    assert_within_bound(got, quant_matmul_torch(x, weight), x, weight, f"{fmt} {n}x{k} M={m}")


@requires_cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 8])
def test_fp16_on_cuda(m, fmt):
    x, weight = operands(fmt, m, 2048, 2048, torch.float16)
    assert_within_bound(quant_matmul_gpu(x, weight), quant_matmul_torch(x, weight), x, weight, f"{fmt} M={m}")


@requires_cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", [1, None])
def test_gemv_at_eight_rows_and_unsplit_on_cuda(fmt, splits):
    """The benchmark's other launches: gemv at M = 8 (past GEMV_MAX_M), and both kernels with one split."""
    x, weight = operands(fmt, 8, 2048, 8192, torch.bfloat16)
    twin = quant_matmul_torch(x, weight)
    for kernel, rows in (("gemv", x), ("gemv", x[:1]), ("dot", x)):
        got = quant_matmul_triton(rows, weight, kernel=kernel, splits=splits)
        assert_within_bound(got, twin[: rows.shape[0]], rows, weight, f"{fmt} {kernel} M={rows.shape[0]}")
