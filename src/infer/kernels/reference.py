"""The definitions in plain PyTorch: one sequence at a time, no tiling, no fusion.

Not on any hot path. Benchmarks measure the kernels against these ("the simplest correct formulation"),
and the engine tests swap them in to check that the kernels change no greedy token.
"""

from __future__ import annotations

import torch


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q [T, H, D]; caches [Hkv, NB, bs, D]; block_tables [B, max_blocks]; seq_lens [B];
    query_start_loc [B + 1]. Sequence i's queries are its last q_len_i positions and attend causally, to keys
    in (p - window, p] with a sliding window > 0.
    Scores and softmax in float32; returns out [T, H, D] in q's dtype."""
    num_heads = q.shape[1]
    num_kv_heads, _, block_size, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    for i, context_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(context_len, device=q.device)
        blocks = block_tables[i].long()[positions // block_size]
        offsets = positions % block_size
        keys = k_cache[:, blocks, offsets].float().repeat_interleave(num_heads // num_kv_heads, dim=0)  # [H, ctx, D]
        values = v_cache[:, blocks, offsets].float().repeat_interleave(num_heads // num_kv_heads, dim=0)
        start, end = starts[i], starts[i + 1]
        queries = q[start:end].float().transpose(0, 1)  # [H, n, D]
        scores = queries @ keys.transpose(1, 2) * scale  # [H, n, ctx]
        query_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        hidden = positions[None, None, :] > query_pos[None, :, None]
        if window:
            hidden |= positions[None, None, :] <= query_pos[None, :, None] - window
        scores.masked_fill_(hidden, float("-inf"))
        out[start:end] = (scores.softmax(dim=-1) @ values).transpose(0, 1).to(q.dtype)
    return out
