"""The native batch-1 GEMV (kernels/cpu/gemv.c) against float64 and F.linear, and the linear layers' dispatch to it.

N = 960 / 3072 / 576 and K = 576 / 1536 are SmolLM2's projections; 1, 7, 9 and 13 rows leave a tail after the
blocks of 8, and K = 1, 31, 33 and 100 a tail after the chunks of 32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import cpu_kernels
from infer.kernels.cpu_kernels import gemv, gemv_takes
from infer.worker.models.layers import ColumnLinear, RowLinear

pytestmark = pytest.mark.skipif(not (cpu_kernels._library() is not None and cpu_kernels._has_avx512_bf16()),
                                reason="needs a C compiler and a CPU with AVX512-BF16: oneDNN runs instead")


def operands(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).div_(k ** 0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536), (1, 576), (7, 33), (9, 31), (13, 100),
                                 (1000, 1), (4099, 64)])
def test_gemv_matches_float64_and_oneDNN(n: int, k: int) -> None:
    x, w = operands(n, k, seed=n * 7 + k)
    x_before, w_before = x.clone(), w.clone()
    got = gemv(x, w)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    assert torch.equal(x, x_before) and torch.equal(w, w_before)
    exact = x.double() @ w.double().t()
    # one rounding to bf16 (2^-9 relative) plus fp32 sums over k products
    bound = exact.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().t()) * k * 2.0 ** -23
    assert ((got.double() - exact).abs() <= bound).all()
    ours, theirs = got.view(torch.int16).int(), F.linear(x, w).view(torch.int16).int()
    apart = (ours - theirs).abs()
    assert apart.max() <= 1 and (apart > 0).float().mean() < 0.05   # the sums' order differs from oneDNN's


def test_gemv_threads_split_the_rows_without_gaps_or_overlap() -> None:
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
def test_each_of_several_rows_gets_what_it_gets_alone(rows: int) -> None:
    """Rows of x read from a wider buffer (row stride > K): each output row is the one-row GEMV's, bit for bit
    (each weight row is read once for all of them, each sum taken as for one row)."""
    wide = torch.randn(rows, 600, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    x = wide[:, 7:583]
    _, w = operands(1000, 576, seed=rows)
    got = gemv(x, w)
    assert got.shape == (rows, 1000)
    for m in range(rows):
        assert torch.equal(got[m], gemv(x[m:m + 1].contiguous(), w)[0]), m


def test_nine_rows_are_refused() -> None:
    x, w = operands(16, 64, seed=1)
    with pytest.raises(ValueError, match="takes 1-8 rows"):
        gemv(x.expand(9, 64), w)


def test_layers_take_the_gemv_for_one_to_eight_bf16_rows(monkeypatch) -> None:
    rows_seen: list[int] = []
    monkeypatch.setattr("infer.worker.models.layers.gemv", lambda x, w: rows_seen.append(x.shape[0]) or gemv(x, w))
    layer = ColumnLinear(64, 48, bias=True, dtype=torch.bfloat16)
    x, w = operands(48, 64, seed=5)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.linspace(-1, 1, 48))
    layer.pack_weights()
    assert layer.gemv_ready
    one = layer(x)
    assert rows_seen == [1]
    assert torch.equal(one, gemv(x, w).add_(layer.bias))                # the bias after the product
    eight = layer(x.expand(8, 64).contiguous())
    assert rows_seen == [1, 8] and torch.equal(eight[7], one[0])
    layer(x.expand(9, 64).contiguous())                                  # nine rows: oneDNN
    layer(torch.cat([x, x], dim=1)[:, ::2])                              # a column stride of 2: oneDNN
    assert rows_seen == [1, 8]
    fp32 = RowLinear(64, 48, bias=False, dtype=torch.float32)
    fp32.weight.data.copy_(w.float())
    fp32.pack_weights()
    assert not fp32.gemv_ready and not gemv_takes(w.t())                 # fp32, and a transposed weight
