"""Token bitmask: the Triton kernel against its twin and a per-token reference, over awkward shapes (a
vocabulary that is not a multiple of 32 or of the kernel's block, a mask wider than the vocabulary, rows out of
order, the sign bit of a word), and xgrammar's own CPU implementation on the same layout."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, KERNEL_DTYPES, requires_triton

from infer.kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


def case(batch: int, vocab: int, rows: list[int], words: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g)
    words = words or -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    return logits, bitmask, rows


CASES = {
    "vocab 70, two rows": (3, 70, [2, 0]),
    "vocab 1100 (past one block)": (2, 1100, [1]),
    "wider mask than vocab": (2, 40, [0, 1], 4),
    "all rows": (4, 33, [0, 1, 2, 3]),
}


@pytest.mark.parametrize("name", CASES)
def test_the_twin_matches_the_reference(name):
    logits, bitmask, rows = case(*CASES[name])
    expected = reference(logits, bitmask, rows)
    apply_token_bitmask_torch(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)


@requires_triton
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_the_kernel_matches_the_twin(name, dtype):
    logits, bitmask, rows = case(*CASES[name], seed=3)
    logits = logits.to(DEVICE, dtype)
    expected = logits.clone()
    apply_token_bitmask_torch(expected, bitmask.to(DEVICE), torch.tensor(rows, device=DEVICE))
    apply_token_bitmask_triton(logits, bitmask.to(DEVICE), torch.tensor(rows, device=DEVICE))
    assert torch.equal(logits, expected)


def test_the_twin_agrees_with_xgrammars_cpu_implementation():
    xgr = pytest.importorskip("xgrammar")
    logits, bitmask, rows = case(5, 1000, [4, 1, 2], seed=9)
    ours = logits.clone()
    apply_token_bitmask_torch(ours, bitmask, torch.tensor(rows))
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, full, indices=rows)
    assert torch.equal(ours, theirs)


def test_bad_shapes_are_refused():
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="covers 64 tokens, fewer than the vocabulary"):
        apply_token_bitmask_torch(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask_torch(logits, torch.zeros(1, 4, dtype=torch.int64), torch.tensor([0]))
