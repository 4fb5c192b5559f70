"""Fused expert MLPs (kernels/moe.py): the Triton grouped GEMM and the twin against a float64 per-row
reference.

The reference runs every row through its own expert one at a time in float64 (gate and up rounded to the
dtype, as the op defines them), so it shares no grouping logic with either implementation. Cases cover
experts with no rows, one expert taking every row, N = 0, row counts that are not multiples of a tile, a
non-power-of-two hidden size (spanning several K blocks) and strided inputs. Outputs start poisoned with
NaN, so a row or column that is never written fails.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, assert_close, poisoned, requires_triton

from infer.kernels.dispatch import kernels_for
from infer.kernels.moe import _align_to_tiles, fused_experts_torch, fused_experts_triton

TWIN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # the twin is the CPU path, bf16 included


def reference(x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """[N, H] float64, one row at a time."""
    inter = w13.shape[1] // 2
    out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    for n in range(x.shape[0]):
        e = int(expert_ids[n])
        gate_up = (w13[e].double() @ x[n].double()).to(x.dtype).double()
        gate, up = gate_up[:inter], gate_up[inter:]
        out[n] = w2[e].double() @ (torch.nn.functional.silu(gate) * up)
    return out


def inputs(
    n: int, h: int, inter: int, num_experts: int, routing: str, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(n, h, generator=g, device=DEVICE).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, h, generator=g, device=DEVICE) * h**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, h, inter, generator=g, device=DEVICE) * inter**-0.5).to(dtype)
    if routing == "random":
        ids = torch.randint(0, num_experts, (n,), generator=g, device=DEVICE)
    elif routing == "one-expert":  # every row to the last expert, the others idle
        ids = torch.full((n,), num_experts - 1, device=DEVICE)
    else:  # "sparse": only experts 1 and 4 (of 6) get rows, interleaved
        ids = torch.tensor([1, 4], device=DEVICE).repeat(n)[:n]
    return x, ids.to(torch.int64), w13, w2


# (N rows, H, I, E experts, routing); the Triton tiles are 16 rows and 64 x 32 weight blocks
CASES = [
    (37, 64, 32, 8, "random"),  # some experts with 0 rows at this N, tiles padded
    (5, 100, 48, 6, "sparse"),  # H not a power of two (4 K blocks, last partial), I < BLOCK_N
    (40, 64, 96, 4, "one-expert"),  # one expert takes all rows: 3 tiles of it
    (1, 32, 16, 4, "random"),  # a decode row
    (0, 64, 32, 4, "random"),  # nothing to do
]


@pytest.fixture
def seed(request) -> int:
    return zlib.crc32(request.node.nodeid.encode())


def check(op, case: tuple, dtype: torch.dtype, seed: int) -> None:
    n, h, inter, num_experts, routing = case
    x, ids, w13, w2 = inputs(n, h, inter, num_experts, routing, dtype, seed)
    expected = reference(x, ids, w13, w2)
    out = poisoned((n, h), dtype)
    got = op(x, ids, w13, w2, out=out)
    assert got is out and got.dtype == dtype
    assert_close(got, expected, dtype, f"{op.__name__} {case}")
    fresh = op(x, ids, w13, w2)
    assert fresh.shape == (n, h) and fresh.dtype == dtype


@pytest.mark.parametrize("dtype", TWIN_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_twin_matches_reference(case, dtype, seed):
    check(fused_experts_torch, case, dtype, seed)


@requires_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference_and_twin(case, dtype, seed):
    check(fused_experts_triton, case, dtype, seed)
    x, ids, w13, w2 = inputs(*case, dtype, seed)
    twin = fused_experts_torch(x, ids, w13, w2)
    assert_close(fused_experts_triton(x, ids, w13, w2), twin, dtype, "vs twin")


@requires_triton
def test_triton_reads_strided_inputs_and_writes_a_strided_output(seed):
    dtype = torch.float32
    x, ids, w13, w2 = inputs(19, 64, 32, 4, "random", dtype, seed)
    x_wide = torch.zeros(19, 128, dtype=dtype, device=DEVICE)
    x_wide[:, ::2] = x  # column stride 2
    out_wide = poisoned((19, 128), dtype)
    out = out_wide[:, 64:]  # row stride 128
    fused_experts_triton(x_wide[:, ::2], ids, w13, w2, out=out)
    assert_close(out, reference(x, ids, w13, w2), dtype, "strided")
    assert torch.isnan(out_wide[:, :64]).all(), "wrote outside the output view"


def test_dispatch_uses_the_twin_off_cuda(seed):
    x, ids, w13, w2 = inputs(9, 32, 16, 4, "random", torch.float32, seed)
    if DEVICE.type == "cpu":
        fused_experts = kernels_for(DEVICE).fused_experts
        assert torch.equal(fused_experts(x, ids, w13, w2), fused_experts_torch(x, ids, w13, w2))


def test_tiles_hold_each_expert_rows_in_order():
    ids = torch.tensor([2, 0, 2, 2, 0, 3, 2], dtype=torch.int64)
    slot_rows, tile_experts = _align_to_tiles(ids, num_experts=5, block_m=2)
    # tiles: expert 0 rows (1, 4); expert 2 rows (0, 2), (3, 6); expert 3 row 5 + padding; then surplus tiles
    num_real_tiles = 4
    assert tile_experts[:num_real_tiles].tolist() == [0, 2, 2, 3]
    assert (tile_experts[num_real_tiles:] == -1).all()
    assert slot_rows[: 2 * num_real_tiles].tolist() == [1, 4, 0, 2, 3, 6, 5, -1]
    assert (slot_rows[2 * num_real_tiles :] == -1).all()


def test_bad_shapes_are_rejected():
    x, ids, w13, w2 = inputs(4, 32, 16, 4, "random", torch.float32, 0)
    with pytest.raises(ValueError, match="do not fit"):
        fused_experts_torch(x[:, :16], ids, w13, w2)
    with pytest.raises(ValueError, match="int64"):
        fused_experts_torch(x, ids.int(), w13, w2)
    with pytest.raises(ValueError, match="outside"):
        fused_experts_torch(x, torch.full((4,), 4, dtype=torch.int64), w13, w2)
