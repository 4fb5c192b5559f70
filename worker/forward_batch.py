"""ForwardBatch: everything one model forward needs, built once per step by the model runner.

Layout of the flattened token dimension T: sequences are concatenated in order; the first
`num_decodes` sequences contribute exactly one query token each (decodes), the others are prefill
chunks of `query_lens[i]` tokens that attend causally to their cached prefix plus themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

# Decodes whose context lengths differ by more than this factor go to separate attention calls, so that
# padding every sequence of a call to its longest costs at most ~25% extra work.
DECODE_GROUP_SPREAD = 1.25


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor     # [T] int64, block_id * block_size + offset; -1 = padding (not written)
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with 0 past each sequence's blocks
    seq_lens: torch.Tensor         # [B] int32, context length after this step (computed + new tokens)
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (offsets into T)
    logits_indices: torch.Tensor   # [B] int64, row of T whose hidden state gives each sequence's logits
    num_decodes: int               # the first num_decodes sequences have query length 1
    query_lens: tuple[int, ...]    # host copies, for loops over prefill chunks
    context_lens: tuple[int, ...]  # host copy of seq_lens
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def decode_groups(self) -> tuple[tuple[torch.Tensor, int], ...]:
        """The decodes split into groups of similar context length: (row indices [G] int64, longest context).

        Computed once per step (on the host copies) and reused by every layer.
        """
        order = sorted(range(self.num_decodes), key=self.context_lens.__getitem__)
        groups: list[list[int]] = []
        for row in order:
            if groups and self.context_lens[row] <= DECODE_GROUP_SPREAD * self.context_lens[groups[-1][0]]:
                groups[-1].append(row)
            else:
                groups.append([row])
        device = self.input_ids.device
        return tuple((torch.tensor(g, dtype=torch.int64, device=device), self.context_lens[g[-1]]) for g in groups)


@dataclass
class KVCache:
    """The paged KV pool: per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return int(self.k[0].shape[0])

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Invariant: the pool holds only finite values. Attention reads whole blocks and masks the
        # positions past a sequence's length, and a masked position still poisons the result if it holds
        # NaN/inf (0 * NaN = NaN), so the pool starts zeroed rather than uninitialised.
        return cls(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
