"""Batches for driving a model directly: `Pager` (random, non-contiguous block ids from a shuffled pool) builds
ForwardBatches, `new_cache` a KV pool full of finite garbage, `token_ids` seeded random prompts."""

from __future__ import annotations

import itertools

import torch

from infer.worker.engine.forward_batch import ForwardBatch, KVCache

CPU = torch.device("cpu")


class Pager:
    """Gives each sequence random, non-contiguous blocks from a shuffled pool and builds ForwardBatches."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=generator).tolist()
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}

    def batch(self, entries: list[tuple[str, list[int], int, int]], num_padding: int = 0) -> ForwardBatch:
        """entries: (sequence key, all its token ids, num_cached, num_new), decodes (num_new == 1) first.
        `num_padding` tokens with slot -1 are appended after the last sequence."""
        bs = self.block_size
        input_ids, positions, slots, tables, query_lens, context_lens = [], [], [], [], [], []
        for key, token_ids, num_cached, num_new in entries:
            seq_len = num_cached + num_new
            table = self.tables.setdefault(key, [])
            while len(table) * bs < seq_len:
                table.append(self.free.pop())
            input_ids += token_ids[num_cached:seq_len]
            positions += range(num_cached, seq_len)
            slots += [table[p // bs] * bs + p % bs for p in range(num_cached, seq_len)]
            tables.append(table)
            query_lens.append(num_new)
            context_lens.append(seq_len)
        input_ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [-1] * num_padding
        width = max(len(t) for t in tables)
        starts = [0, *itertools.accumulate(query_lens)]
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            logits_indices=torch.tensor(starts[1:], dtype=torch.int64) - 1,
            num_decodes=num_decodes,
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            block_size=bs,
        )


def new_cache(model, num_blocks: int, block_size: int) -> KVCache:
    cache = KVCache.allocate(
        model.num_layers,
        num_blocks,
        block_size,
        model.num_kv_heads,
        model.head_dim,
        model.dtype,
        CPU,
        shared_kv=bool(getattr(model, "kv_shared", False)),
    )
    for t in cache.k + cache.v:  # stale slots (finite garbage, as the pool's invariant allows) must be masked
        t.normal_(0, 1000.0)
    return cache


def token_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kl_and_top1(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference || other), top-1 agreement) of two [positions, vocab] logit tensors, in float64."""
    p, q = reference.double().log_softmax(-1), other.double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return kl, (reference.argmax(-1) == other.argmax(-1)).double().mean().item()


def quantized_layers(model) -> dict[str, str | None]:
    """Each layer's weight storage: its quantized format, or None for dense."""
    from infer.worker.models.layers import QuantStorage

    return {name: m.quant_format for name, m in model.named_modules() if isinstance(m, QuantStorage)}
