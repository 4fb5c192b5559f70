"""Step-graph shapes: which padded batch a decode step runs at, and what its padding rows hold. No torch.

A step graph (worker/engine/step_graphs.py) is made once per batch-size bucket: compiled on CPU, captured on CUDA. A
decode step of n rows (a row a sequence, or k + 1 for a speculative verification) runs in the smallest bucket >= n;
its rows past n are padding: token 0 at position 0, slot -1 (the KV append skips it, or the CPU twin sends it to the
pool's scratch slot), a block table of scratch blocks and length 1, so it attends to something finite and is never
sampled. Steps with a prefill, or more rows than the largest bucket, run eagerly.

The block table is padded too: to the full width (max_model_len / block_size) under CUDA graphs, whose
kernels stop at each sequence's length; on CPU to the step's longest table rounded up to `granularity`
blocks, since the compiled twin reads every column (the width is the graph's one dynamic dimension).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


def batch_buckets(max_rows: int, max_bucket: int) -> tuple[int, ...]:
    """1, 2, 4, ... (powers of two) below min(max_rows, max_bucket), then that limit itself. `max_rows`: the most
    rows a step brings (its sequences; a speculative verification's k + 1 rows a request)."""
    if max_rows < 1 or max_bucket < 1:
        raise ValueError(f"max_rows and max_bucket must be >= 1, got {max_rows} and {max_bucket}")
    limit = min(max_rows, max_bucket)
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit)
    return tuple(sizes)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds num_seqs rows (buckets ascending), or None past the largest."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if num_seqs >= 1 and i < len(buckets) else None


def table_width(longest: int, max_width: int, granularity: int) -> int:
    """Columns of a step's padded block table: its longest table (in blocks) rounded up to `granularity`,
    at least 2 (a compiled dynamic dimension is never 0 or 1), at most max_width (itself >= 2 then)."""
    if not 1 <= longest <= max_width:
        raise ValueError(f"a block table of {longest} blocks does not fit the width {max_width}")
    rounded = -(-longest // granularity) * granularity
    return min(max(rounded, 2), max(max_width, 2))


@dataclass(frozen=True)
class DecodeRow:
    """One decode row: the token it feeds, that token's position, and its sequence's block table (a verification
    brings k + 1 rows of one sequence, at consecutive positions over the same table)."""

    token_id: int
    position: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class PaddedDecode:
    """A padded decode step as flat host lists, one per input buffer (`bucket` rows, `width` columns)."""

    num_seqs: int
    bucket: int
    width: int
    input_ids: list[int]  # [bucket]
    positions: list[int]  # [bucket]
    slot_mapping: list[int]  # [bucket], -1 on padding rows
    block_tables: list[int]  # [bucket * width] row-major; scratch_block past each table and on padding rows
    seq_lens: list[int]  # [bucket], 1 on padding rows


def pad_decode(rows: Sequence[DecodeRow], bucket: int, width: int, block_size: int, scratch_block: int) -> PaddedDecode:
    """Lay out `rows` (len <= bucket, each table within `width`) and the padding rows after them."""
    if not 1 <= len(rows) <= bucket:
        raise ValueError(f"{len(rows)} rows do not fit a bucket of {bucket}")
    input_ids, positions, slots, lens = [], [], [], []
    tables: list[int] = []
    for row in rows:
        table = row.block_table
        if len(table) > width or len(table) * block_size <= row.position:
            raise ValueError(
                f"position {row.position} with {len(table)} blocks of {block_size} does not fit "
                f"a table of width {width}"
            )
        input_ids.append(row.token_id)
        positions.append(row.position)
        slots.append(table[row.position // block_size] * block_size + row.position % block_size)
        tables.extend(block if block >= 0 else scratch_block for block in table)  # released (-1): never read
        tables.extend([scratch_block] * (width - len(table)))
        lens.append(row.position + 1)
    num_padding = bucket - len(rows)
    return PaddedDecode(
        num_seqs=len(rows),
        bucket=bucket,
        width=width,
        input_ids=input_ids + [0] * num_padding,
        positions=positions + [0] * num_padding,
        slot_mapping=slots + [-1] * num_padding,
        block_tables=tables + [scratch_block] * (num_padding * width),
        seq_lens=lens + [1] * num_padding,
    )
