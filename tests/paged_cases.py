"""Test fixtures for the paged-KV kernels: random pools, random block tables, and float64 references."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernel_checks import DEVICE


@dataclass
class PagedBatch:
    """Sequences laid out in a random pool: sequence i's context of seq_lens[i] tokens, its last
    query_lens[i] of which are this step's queries (flattened into q's T rows)."""

    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [Hkv, NB, bs, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    query_lens: list[int]


def random_pool(
    num_kv_heads: int,
    num_blocks: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    device: torch.device = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools of random values (the blocks no table uses hold values too: a kernel reading a wrong
    block gets a wrong answer, not a lucky zero)."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return (
        torch.randn(shape, generator=generator).to(dtype).to(device),
        torch.randn(shape, generator=generator).to(dtype).to(device),
    )


def random_tables(
    seq_lens: list[int], num_blocks: int, block_size: int, generator: torch.Generator, device: torch.device = DEVICE
) -> torch.Tensor:
    """Distinct random (non-contiguous, unordered) blocks per sequence, padded with block 0."""
    needed = [-(-n // block_size) for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError("pool too small for the test's sequences")
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(needed)
    rows, used = [], 0
    for n in needed:
        rows.append(perm[used : used + n] + [0] * (width - n))
        used += n
    return torch.tensor(rows, dtype=torch.int32, device=device)


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    spare_blocks: int = 7,
    device: torch.device = DEVICE,
) -> PagedBatch:
    """The batch's tensors on `device` (the Triton kernels' by default; the native CPU kernels' tests ask for the
    CPU, also on a CUDA machine)."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + spare_blocks
    k_cache, v_cache = random_pool(num_kv_heads, num_blocks, block_size, head_dim, dtype, generator, device)
    tables = random_tables(seq_lens, num_blocks, block_size, generator, device)
    total = sum(query_lens)
    q = torch.randn(total, num_heads, head_dim, generator=generator).to(dtype).to(device)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return PagedBatch(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        list(query_lens),
    )


def context_of(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [Hkv, NB, bs, D] -> the sequence's first `length` tokens, [length, Hkv, D], token by token."""
    block_size = cache.shape[2]
    positions = torch.arange(length, device=cache.device)
    blocks = table.long()[positions // block_size]
    return cache[:, blocks, positions % block_size].transpose(0, 1)


def reference_attention(
    batch: PagedBatch, scale: float, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """float64, one sequence and one head at a time: the definition, [T, H, D]. `window` > 0: the query at
    position p sees keys in (p - window, p] only; `softcap` > 0: scores s become softcap * tanh(s / softcap);
    `sinks` [H]: head h's softmax denominator also holds exp(sinks[h]) (a logit that attends to nothing)."""
    num_heads = batch.q.shape[1]
    group = num_heads // batch.k_cache.shape[0]
    out = torch.empty(batch.q.shape, dtype=torch.float64, device=batch.q.device)
    starts = batch.query_start_loc.tolist()
    for i, context_len in enumerate(batch.seq_lens.tolist()):
        keys = context_of(batch.k_cache, batch.block_tables[i], context_len).double()
        values = context_of(batch.v_cache, batch.block_tables[i], context_len).double()
        start, end = starts[i], starts[i + 1]
        n = end - start
        query_pos = torch.arange(context_len - n, context_len, device=out.device)
        key_pos = torch.arange(context_len, device=out.device)[None, :]
        visible = key_pos <= query_pos[:, None]  # [n, ctx]
        if window:
            visible &= key_pos > query_pos[:, None] - window
        for h in range(num_heads):
            scores = batch.q[start:end, h].double() @ keys[:, h // group].T * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                sink = torch.full((n, 1), float(sinks[h]), dtype=torch.float64, device=out.device)
                probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[:, :-1]
            else:
                probs = scores.softmax(dim=-1)
            out[start:end, h] = probs @ values[:, h // group]
    return out
