"""RMSNorm (optionally fused with the residual add): the Triton kernel, the native CPU one and the twin against
float64.

The reference rounds the residual sum to the storage dtype (the op defines it there) and does everything
else in float64; the op's two further roundings (x / rms(x) to the dtype, then the weight product) stay
within each dtype's tolerance. H = 576 is SmolLM2's hidden size, 100 is not a power of two.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, assert_close, poisoned, requires_triton

from infer.kernels.cpu_kernels import RMS_NORM_MIN_ROWS, rms_norm_native
from infer.kernels.rmsnorm import rms_norm_cpu, rms_norm_torch, rms_norm_triton

TWIN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # the twin is the CPU path, bf16 included
EPS = 1e-5


def reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed output, new residual) in float64."""
    s = x.double() if residual is None else (x.double() + residual.double()).to(x.dtype).double()
    normed = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * normed, None if residual is None else s


def inputs(
    n: int, h: int, dtype: torch.dtype, seed: int, device: torch.device = DEVICE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, generator=g, device=device).mul_(3).to(dtype)
    weight = (1 + 0.5 * torch.randn(h, generator=g, device=device)).to(dtype)
    residual = torch.randn(n, h, generator=g, device=device).mul_(2).to(dtype)
    return x, weight, residual


def check(
    op, n: int, h: int, dtype: torch.dtype, with_residual: bool, seed: int, device: torch.device = DEVICE
) -> None:
    x, weight, residual = inputs(n, h, dtype, seed, device)
    x_before = x.clone()
    expected, expected_residual = reference(x, weight, EPS, residual if with_residual else None)
    out = poisoned((n, h), dtype, device)
    got = op(x, weight, EPS, residual if with_residual else None, out=out)
    assert got is out and got.dtype == dtype
    assert_close(got, expected, dtype, "output")
    assert torch.equal(x, x_before), "x must not be written"
    if with_residual:
        assert_close(residual, expected_residual, dtype, "residual")
    fresh = op(x, weight, EPS, None)  # without `out`: a new tensor of x's shape and dtype
    assert fresh.shape == x.shape and fresh.dtype == dtype and fresh.is_contiguous()


CASES = [(n, h, res) for n in (1, 37) for h in (576, 100) for res in (False, True)]


@pytest.fixture
def seed(request) -> int:
    """A different, reproducible seed for every test case (from its id): fresh inputs per case."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.mark.parametrize("dtype", TWIN_DTYPES)
@pytest.mark.parametrize("n, h, with_residual", CASES)
def test_twin_matches_float64(n: int, h: int, with_residual: bool, dtype: torch.dtype, seed: int) -> None:
    check(rms_norm_torch, n, h, dtype, with_residual, seed)


@requires_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n, h, with_residual", CASES)
def test_triton_matches_float64_and_twin(n: int, h: int, with_residual: bool, dtype: torch.dtype, seed: int) -> None:
    check(rms_norm_triton, n, h, dtype, with_residual, seed)
    x, weight, residual = inputs(n, h, dtype, seed + 1)
    twin_residual = residual.clone()
    got = rms_norm_triton(x, weight, EPS, residual if with_residual else None)
    twin = rms_norm_torch(x, weight, EPS, twin_residual if with_residual else None)
    assert_close(got, twin, dtype, "triton vs twin")
    assert torch.equal(residual, twin_residual), "the residual sum is one rounding of x + residual in both"


requires_native = pytest.mark.usefixtures("isa")  # once per build of the C kernels (conftest.py)


def fp32_bound(h: int) -> float:
    """What the native kernel promises an fp32 output, relative to float64: its sum of h squares in fp32 in an
    order each build picks (vector lanes, partial sums) is within (h - 1) ulps of the exact sum (the textbook
    bound of any order of a sum of non-negative terms), halved by the square root; then the mean, eps, sqrt,
    reciprocal, s * inv and the weight product round once each."""
    return ((h - 1) / 2 + 6) * 2.0**-24


@requires_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n, h, with_residual", [(n, h, res) for n in (1, 64, 200) for h in (576, 100, 4096) for res in (False, True)]
)
def test_native_matches_float64_and_the_twin(
    n: int, h: int, with_residual: bool, dtype: torch.dtype, seed: int
) -> None:
    """Within the dtype's tolerance of float64 (fp32: the bound the kernel's arithmetic gives, `fp32_bound`); the
    residual sum bit for bit the twin's (one rounding of x + residual), a bf16 output the twin's but for an
    occasional last bit (the squares summed in another order)."""
    x, weight, residual = (t.cpu() for t in inputs(n, h, dtype, seed))
    check(rms_norm_native, n, h, dtype, with_residual, seed, torch.device("cpu"))  # also on a CUDA machine
    expected, _ = reference(x, weight, EPS, residual if with_residual else None)
    twin_residual = residual.clone()
    got = rms_norm_native(x, weight, EPS, residual if with_residual else None)
    twin = rms_norm_torch(x, weight, EPS, twin_residual if with_residual else None)
    assert torch.equal(residual, twin_residual)
    if dtype == torch.bfloat16:  # in fp32 one ulp of 1 / rms moves every element of the row by an ulp
        assert (got != twin).float().mean().item() < 1e-3
        torch.testing.assert_close(got, twin, rtol=2**-6, atol=0)
    else:
        assert ((got.double() - expected).abs() <= expected.abs() * fp32_bound(h)).all()


@requires_native
def test_cpu_dispatch_takes_the_native_kernel_for_bf16_and_an_fp32_prefills_rows(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(
        "infer.kernels.rmsnorm.rms_norm_native", lambda *a: calls.append(a[0].shape[0]) or rms_norm_native(*a)
    )
    for n in (1, RMS_NORM_MIN_ROWS - 1, RMS_NORM_MIN_ROWS, 300):
        x, weight, residual = (t.cpu() for t in inputs(n, 576, torch.float32, seed=n))
        rms_norm_cpu(x, weight, EPS, residual)
    assert calls == [RMS_NORM_MIN_ROWS, 300]
    calls.clear()
    for n in (1, RMS_NORM_MIN_ROWS - 1):
        x, weight, residual = (t.cpu() for t in inputs(n, 576, torch.bfloat16, seed=n))
        rms_norm_cpu(x, weight, EPS, residual)
    assert calls == [1, RMS_NORM_MIN_ROWS - 1]
    calls.clear()
    x, weight, _ = (t.cpu() for t in inputs(80, 7 * 16, torch.float32, seed=7))
    q = x[:, : 4 * 16].view(80, 4, 16)[:, :3]  # heads that do not flatten into rows: the twin
    expected, _ = reference(q, weight[:16], EPS, None)
    assert_close(rms_norm_cpu(q, weight[:16].contiguous(), EPS), expected, torch.float32, "strided heads")
    assert calls == []


@pytest.mark.parametrize("op", [rms_norm_torch, pytest.param(rms_norm_triton, marks=requires_triton)])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_strided_rows_and_in_place_output(op, dtype: torch.dtype, seed: int) -> None:
    """x and residual as row views of wider buffers (row stride != H); `out` may be x itself; a 3-D
    strided x (per-head q norm on a view into the qkv output) is normalised per head."""
    n, h = 37, 100
    x_wide, weight, residual_wide = inputs(n, h + 28, dtype, seed)
    weight = weight[:h].contiguous()
    x, residual = x_wide[:, 14 : 14 + h], residual_wide[:, :h]
    expected, expected_residual = reference(x, weight, EPS, residual)
    untouched = residual_wide[:, h:].clone()
    got = op(x, weight, EPS, residual, out=x)
    assert got is x
    assert_close(x, expected, dtype, "output written over x")
    assert_close(residual, expected_residual, dtype, "residual")
    assert torch.equal(residual_wide[:, h:], untouched), "columns past the residual view were written"

    qkv, weight, _ = inputs(5, 7 * 16, dtype, seed + 1)
    q = qkv[:, : 4 * 16].view(5, 4, 16)  # token stride 112, head stride 16
    expected, _ = reference(q, weight[:16], EPS, None)
    assert_close(op(q, weight[:16].contiguous(), EPS), expected, dtype, "per-head norm of a strided view")


def test_twin_is_transformers_llama_rmsnorm_bitwise() -> None:
    """fp32 and bf16: bit for bit transformers' LlamaRMSNorm (the model tests compare logits to it)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        # on CPU tensors: CUDA's reduction kernels differ from op to op, and there the engine runs Triton
        x, weight, residual = (t.cpu() for t in inputs(37, 576, dtype, seed=5))
        hf = LlamaRMSNorm(576, eps=EPS).to(dtype)
        hf.weight.data.copy_(weight)
        with torch.inference_mode():
            assert torch.equal(rms_norm_torch(x, weight, EPS), hf(x)), dtype
            expected = hf(x + residual)
            assert torch.equal(rms_norm_torch(x, weight, EPS, residual), expected), dtype


def test_dispatch_and_shape_errors() -> None:
    x, weight, residual = (t.cpu() for t in inputs(3, 8, torch.float32, seed=6))
    expected = rms_norm_torch(x, weight, EPS)
    assert torch.equal(rms_norm_cpu(x, weight, EPS), expected)  # CPU tensors: the twin
    with pytest.raises(ValueError, match=r"weight of shape \(7,\) does not match x of shape \(3, 8\)"):
        rms_norm_cpu(x, weight[:7], EPS)
    with pytest.raises(ValueError, match=r"residual \(1, 8\) torch.float32 does not match x \(3, 8\)"):
        rms_norm_cpu(x, weight, EPS, residual[:1])
    with pytest.raises(ValueError, match="out .* torch.float16 does not match x"):
        rms_norm_cpu(x, weight, EPS, out=x.half())
