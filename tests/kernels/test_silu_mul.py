"""SiLU * mul, the MLP's activation: the native CPU kernel (bf16) against float64 and against torch's two ops
(`F.silu(gate).mul_(up)`, what the CPU's `silu_and_mul` (kernels/dispatch.py) runs elsewhere), and its dispatch.

d = 1536 is SmolLM2's intermediate size; 1, 15, 17 and 100 leave a tail past the kernel's 16-lane vectors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.kernels.cpu_kernels import silu_and_mul_native, silu_and_mul_takes
from infer.kernels.dispatch import kernels_for

requires_native = pytest.mark.usefixtures("isa")  # once per build of the C kernels (conftest.py)


def torch_ops(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def reference(x: torch.Tensor) -> torch.Tensor:
    """float64, with the op's rounding of silu(gate) to the type before the product."""
    gate, up = x.double().chunk(2, dim=-1)
    silu = (gate * torch.sigmoid(gate)).to(x.dtype).double()
    return silu * up


def inputs(rows: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2 * d, generator=g).mul_(4).to(torch.bfloat16)


@requires_native
@pytest.mark.parametrize("rows,d", [(1, 1536), (16, 1536), (200, 1536), (33, 1), (2, 15), (40, 17), (64, 100)])
def test_native_matches_float64_and_torch(rows: int, d: int) -> None:
    x = inputs(rows, d, seed=rows * 1000 + d)
    before = x.clone()
    got = silu_and_mul_native(x)
    assert got.shape == (rows, d) and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(x, before), "x must not be written"
    expected = reference(x)
    # one rounding of the product to bf16 (half an ulp: 2^-9 relative) plus the fp32 exp's error
    assert ((got.double() - expected).abs() <= expected.abs() * 2.0**-8 + 1e-30).all()
    # torch's own bits: its exp is another fp32 exp, so at most a rare element lands one bf16 ulp apart
    ours, theirs = got.view(torch.int16).int(), torch_ops(x).view(torch.int16).int()
    apart = (ours - theirs).abs()
    assert apart.max() <= 1 and (apart > 0).float().mean() < 1e-3


@requires_native
def test_native_fp32_rows_match_float64() -> None:
    """The kernel's fp32 path (the dispatch keeps torch's ops for fp32, but the kernel takes both types)."""
    x = inputs(40, 100, seed=11).float() + torch.randn(40, 200, generator=torch.Generator().manual_seed(12)) * 1e-3
    got = silu_and_mul_native(x)
    assert got.dtype == torch.float32
    assert ((got.double() - reference(x)).abs() <= reference(x).abs() * 1e-6 + 1e-30).all()


@requires_native
def test_special_values_follow_torch() -> None:
    """NaN, infinities, zeros and extremes as torch gives them, but for gates below -87, where silu is under
    1e-35 in magnitude: the kernel's exp flushes those to zero."""
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e-40, -3e38, 3e38]
    gate = torch.tensor(specials * 2, dtype=torch.float32)
    up = torch.tensor([1.5] * len(specials) + [-2.0] * len(specials))
    x = torch.cat([gate, up]).to(torch.bfloat16).expand(3, -1).contiguous()
    got, expected = silu_and_mul_native(x), torch_ops(x)
    assert torch.equal(got.isnan(), expected.isnan())
    got, expected = got[~got.isnan()], expected[~expected.isnan()]
    tiny = expected.abs() < 1e-30
    assert torch.equal(got[~tiny], expected[~tiny]) and (got[tiny].abs() < 1e-30).all()


@requires_native
def test_strided_rows_read_in_place() -> None:
    """Rows of x farther apart than 2d (a view into a wider buffer) are read where they are."""
    wide = inputs(5, 80, seed=7)
    x = wide[:, :64]  # rows 160 elements apart, [gate | up] of d = 32
    assert not x.is_contiguous() and silu_and_mul_takes(x)
    assert torch.equal(silu_and_mul_native(x), silu_and_mul_native(x.contiguous()))


@requires_native
def test_dispatch_takes_bf16_rows_only(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(
        "infer.kernels.cpu_kernels.silu_and_mul_native", lambda x: calls.append(x.shape[0]) or silu_and_mul_native(x)
    )
    silu_and_mul = kernels_for("cpu").silu_and_mul
    silu_and_mul(inputs(1, 64, seed=1))  # one row (a decode at batch 1)
    silu_and_mul(inputs(40, 64, seed=2))
    fp32 = inputs(40, 64, seed=3).float()
    assert torch.equal(silu_and_mul(fp32), torch_ops(fp32))  # fp32 keeps torch's bits
    assert calls == [1, 40]
    assert not silu_and_mul_takes(inputs(40, 64, seed=4).t())  # columns not unit-strided
    assert not silu_and_mul_takes(inputs(40, 64, seed=5)[:, :127])  # odd width: no gate | up
