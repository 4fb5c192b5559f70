"""ForwardBatch: everything one model forward needs, built once per step by the model runner.

Layout of the flattened token dimension T: sequences are concatenated in order; the first
`num_decodes` sequences contribute exactly one query token each (decodes), the others are prefill
chunks of `query_lens[i]` tokens that attend causally to their cached prefix plus themselves.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; -1 = padding (not written)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each sequence's blocks
    seq_lens: torch.Tensor  # [B] int32, context length after this step (computed + new tokens)
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (offsets into T)
    logits_indices: torch.Tensor  # [B] int64, row of T whose hidden state gives each sequence's logits
    num_decodes: int  # the first num_decodes sequences have query length 1
    query_lens: tuple[int, ...]  # host copies, for loops over prefill chunks
    context_lens: tuple[int, ...]  # host copy of seq_lens
    block_size: int
    # Step graphs (worker/engine/step_graphs.py): every row is a decode, rows past the real ones are padding (slot -1,
    # length 1 over the pool's scratch block), and no host copy of the lengths is read, so the forward traces
    # into one graph. `pad_slot` is where the CPU twin writes the padding rows' K/V (KVCache.pad_slot).
    step_graph: bool = False
    pad_slot: int | None = None
    # Context tokens per split of the GPU decode kernel, fixed per engine (kernels.paged_attention.
    # decode_split_tokens): a sequence's attention then has the same bits in any batch, graph or eager.
    decode_split_tokens: int | None = None
    # [B - num_decodes] int32, each prefill sequence's prompt length: its rows from there on (generated tokens
    # computed again: a failover's resumed stream, a recompute after preemption) take the decode kernel's
    # arithmetic in the CPU prefill kernel, as they did when they were decoded (None: every row the prefill's)
    prefill_decode_from: torch.Tensor | None = None
    # Speculative verification (worker/speculative/verification.py): a verification chunk's k + 1 tokens are k + 1
    # decode rows, each its own sequence here; `decode_runs` [R] int32 gives the decode rows of each request in order (1
    # for a plain decode, k + 1 for a verification; summing to num_decodes), so that the native CPU decode step reads a
    # request's K and V once for all its rows (worker/models/native_decode.py). None: one row a request.
    decode_runs: torch.Tensor | None = None
    # Images (worker/engine/vision.py): the rows of T that hold image tokens [R] int64 and the features that replace
    # their token embeddings [R, hidden] (None: no image token in this step)
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # A model whose image tokens attend to each other both ways (Gemma 3; worker/engine/attention.py
    # image_span_attention): (sequence index, image offset, image end) of each image a chunk of this step computes
    # (None: none)
    image_spans: tuple[tuple[int, int, int], ...] | None = None
    # M-RoPE (Qwen2-VL: worker/engine/vision.py step_mrope_positions): [3, T] int64 (temporal, height, width) position
    # of each token, set where they differ (a step that computes image tokens; elsewhere `positions` holds the shared
    # one); `rope_cache` [T, head_dim] float32: the cos | sin row of each token that the model's M-RoPE builds from
    # them, which `positions` (then 0 .. T-1) index in place of the model's cos/sin cache
    mrope_positions: torch.Tensor | None = None
    rope_cache: torch.Tensor | None = None
    # Encoder-decoder models (worker/engine/encoder_decoder.py): each real row's request's cross-attention block table
    # [T, max cross blocks] int32 (padded with 0) and encoder length [T] int32 (None: a decoder-only model)
    cross_block_tables: torch.Tensor | None = None
    cross_lens: torch.Tensor | None = None
    # values every layer needs, derived once by the first layer that asks (e.g. the decode twin's plan)
    per_step: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def num_real_tokens(self) -> int:
        """Tokens that belong to a sequence; rows of T past them are padding."""
        return sum(self.query_lens)

    @cached_property
    def max_prefill_len(self) -> int:
        """The longest prefill chunk (0 without prefills): sizes the prefill kernel's grid."""
        return max(self.query_lens[self.num_decodes :], default=0)

    @cached_property
    def prefill_query_start_loc(self) -> torch.Tensor:
        """[B - num_decodes + 1] int32: query_start_loc of the prefill sequences, offsets from their first
        token (computed once per step, shared by every layer)."""
        return self.query_start_loc[self.num_decodes :] - self.num_decodes


@dataclass
class KVCache:
    """The paged KV pool: per layer, K and V of shape [num_kv_heads, num_blocks, block_size, head_dim].

    Head-major: one KV head's block is a contiguous [block_size, head_dim] tile (what the Triton kernels
    load), and one head's blocks gathered in table order are directly the [L, head_dim] operand of the CPU
    twins' matmuls, with no transpose copy.

    One block past `num_blocks`, the scratch block, belongs to no sequence: padding rows of step graphs
    write their K/V there and attend to it (`pad_slot`), so a padded step needs no host-side filtering.

    `shared_kv`: each layer's V is its K tensor (MLA's latent row is both: stored once, `v[i] is k[i]`).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    _shape: tuple | None = None  # (shape, dtype, device) of each tensor while released
    shared_kv: bool = False

    @property
    def num_blocks(self) -> int:
        """Blocks sequences can own (the scratch block not counted)."""
        return int(self.shape[1]) - 1

    @property
    def scratch_block(self) -> int:
        return int(self.shape[1]) - 1

    @property
    def pad_slot(self) -> int:
        return self.scratch_block * int(self.shape[2])

    @property
    def shape(self) -> tuple[int, ...]:
        """[num_kv_heads, num_blocks + 1, block_size, head_dim] of each layer's K (and V), released or not."""
        return tuple(self.k[0].shape) if self._shape is None else self._shape[0]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        shared_kv: bool = False,
    ) -> KVCache:
        shape = (num_kv_heads, num_blocks + 1, block_size, head_dim)  # + the scratch block
        # Invariant: the pool holds only finite values. The CPU twins read whole blocks and mask the
        # positions past a sequence's length, and a masked position still poisons the result if it holds
        # NaN/inf (0 * NaN = NaN), so the pool starts zeroed rather than uninitialised.
        k = [zeroed_pool(shape, dtype, device) for _ in range(num_layers)]
        v = list(k) if shared_kv else [zeroed_pool(shape, dtype, device) for _ in range(num_layers)]
        return cls(k=k, v=v, shared_kv=shared_kv)

    @property
    def _pools(self) -> tuple[list[torch.Tensor], ...]:
        """The lists of distinct tensors: K and V, or K alone when V is K."""
        return (self.k,) if self.shared_kv else (self.k, self.v)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds now (0 while released)."""
        return sum(t.numel() * t.element_size() for pool in self._pools for t in pool)

    def resident_bytes(self) -> int:
        """Bytes of the pool in memory now: a CPU pool's pages that steps have touched (each pool tensor is a
        memory map of its own: `zeroed_pool`; read from /proc/self/smaps), a GPU pool's whole size."""
        tensors = [t for pool in self._pools for t in pool]
        if not tensors or tensors[0].device.type != "cpu":
            return self.nbytes
        starts = {t.data_ptr() for t in tensors if t.numel()}
        return sum(rss for start, rss in _mapping_rss() if start in starts)

    @property
    def released(self) -> bool:
        return self._shape is not None

    def release(self) -> int:
        """Free the pool's memory (suspend); its shape is kept for `restore`. Returns the bytes freed: on a CPU
        the pool's resident bytes (its pages that steps touched; `resident_bytes`), else its size. The lists
        keep their identity (the model runner holds this object), only their tensors change."""
        if self._shape is not None:
            return 0
        freed = self.resident_bytes()
        self._shape = (tuple(self.k[0].shape), self.k[0].dtype, self.k[0].device)
        for pool in self._pools:
            for i, t in enumerate(pool):
                pool[i] = torch.empty(0, dtype=t.dtype, device=t.device)
        if self.shared_kv:
            self.v[:] = self.k
        return freed

    def restore(self) -> int:
        """Reallocate a released pool, zeroed (the finite-values invariant); returns the bytes allocated."""
        if self._shape is None:
            return 0
        shape, dtype, device = self._shape
        for pool in self._pools:
            for i in range(len(pool)):
                pool[i] = zeroed_pool(shape, dtype, device)
        if self.shared_kv:
            self.v[:] = self.k
        self._shape = None
        return self.nbytes

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer's K and V: a forked beam's partial last block
        (worker/engine/beam_groups.py). Destinations are distinct and never sources."""
        if not copies:
            return
        device = self.k[0].device
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
        for pool in self._pools:
            for t in pool:
                t.index_copy_(1, dst, t.index_select(1, src))

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[pool tensors (K and V of every layer, or K alone when V is K), num_kv_heads, block_size, head_dim]: one
        block of every tensor, as `read_blocks` / `write_block` move it."""
        heads, _, block_size, head_dim = self.shape
        return (sum(len(pool) for pool in self._pools), heads, block_size, head_dim)

    @property
    def block_bytes(self) -> int:
        """One block of every pool tensor (`block_shape`), in bytes: what a KV tier or a transfer moves a block as."""
        return torch.empty((), dtype=self.k[0].dtype).element_size() * math.prod(self.block_shape)

    def block_from_bytes(self, payload: bytes | memoryview) -> torch.Tensor:
        """A block's bytes (`block_bytes` of them) as a [*block_shape] tensor of the pool's dtype, on the host (a copy
        of `payload`), for `write_block`."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.k[0].dtype).view(self.block_shape)

    def _gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """These blocks of every pool tensor, on the pool's device: [len(block_ids), *block_shape]."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.k[0].device)
        # each [Hkv, n, bs, D] -> [n, Hkv, bs, D]; stacked on dim 1: [n, tensors, Hkv, bs, D]
        return torch.stack([t.index_select(1, index).transpose(0, 1) for pool in self._pools for t in pool], dim=1)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of these blocks: [len(block_ids), *block_shape], contiguous (the KV tier's spills)."""
        return self._gather(block_ids).to("cpu").contiguous()

    def copy_blocks_out(self, block_ids: Sequence[int], out: torch.Tensor, slots: Sequence[int]) -> None:
        """Copy these blocks into `out[slots]`: `out` is [num_slots, *block_shape] in host memory (the KV tier in
        host memory). From a GPU pool the copies are asynchronous (`out` pinned): the caller synchronizes the
        pool's stream before it reads them."""
        picked = self._gather(block_ids)
        for j, slot in enumerate(slots):  # one copy a block (on a CPU ~5x faster than index_copy_ in bf16)
            out[slot].copy_(picked[j], non_blocking=True)  # GPU -> pinned host: a DMA, asynchronous

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Write one block of every tensor from `data`: [*block_shape] in the pool's dtype (the KV tier's loads)."""
        data = data.to(self.k[0].device)
        for i, t in enumerate(t for pool in self._pools for t in pool):
            t[:, block_id].copy_(data[i])

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, shared_kv: bool = False
    ) -> int:
        copies = 1 if shared_kv else 2  # V is K, or a pool of its own
        return copies * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _mapping_rss() -> list[tuple[int, int]]:
    """(start address, resident bytes) of every memory mapping of this process (/proc/self/smaps)."""
    out, start = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start = int(head.split("-")[0], 16)
            elif head == "Rss:" and start is not None:
                out.append((start, int(line.split()[1]) * 1024))
    return out


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for the KV pool. On a CPU it is an anonymous memory map: the kernel's zero pages, made
    resident only where a step touches them, so a worker's resident memory grows with the KV it uses rather than
    with the pool's size (torch.zeros writes every byte: the default pool, 10% of the machine's memory, was
    resident from the start). Each is a shared anonymous map (Python's default), a mapping of its own that the
    kernel never merges with a neighbour, so `KVCache.resident_bytes` can read its resident pages. The tensor keeps
    the map alive; freeing it unmaps the memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
