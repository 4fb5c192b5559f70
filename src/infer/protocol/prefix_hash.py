"""The prefix cache's block keys, torch-free: what a worker's cache names a block by (worker/engine/block_manager.py)
and what the coordinator computes for a prompt to find the workers that hold it (coordinator/kv_index.py). One
definition, so both sides always agree.

Block `i` of a token sequence is `h_i = xxh64(h_{i-1} as 8 bytes little-endian + tokens of block i as int64
little-endian)`; the first block's parent is the sequence's salt: None for the base model, `adapter_salt(name)` for
a LoRA adapter (the base model and each adapter compute other K / V for the same tokens). A hash only finds
candidates: the worker checks tokens, parent and adapter before it reuses a block, so a collision costs a hit, never
correctness; at the coordinator a collision costs a routing choice.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

import xxhash

_SWAP = sys.byteorder != "little"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    tokens = array("q", token_ids)
    if _SWAP:
        tokens.byteswap()
    return tokens.tobytes()


def prefix_digest(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A 16-byte blake2b digest chained like the hashes (the parent's digest, None for a sequence's first block,
    then the block's tokens as int64 little-endian): what a block spilled beyond the pool is checked against when it
    is read back (worker/kv/offload_store.py). Unlike the 64-bit hash it proves the whole prefix's tokens, since a
    file outlives the pool's own checks (tokens, parent, adapter)."""
    h = hashlib.blake2b(digest_size=16, person=b"infer-kv-prefix")
    h.update(b"root" if parent is None else parent)
    h.update(_token_bytes(token_ids))
    return h.digest()


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chain hash of one full block: xxh64 over the parent's hash (8 bytes, absent for a first block without a
    salt) followed by the block's token ids as int64, both little-endian."""
    parent = b"" if parent_hash is None else parent_hash.to_bytes(8, "little")
    return xxhash.xxh64_intdigest(parent + _token_bytes(token_ids))


def adapter_salt(lora_name: str | None) -> int | None:
    """The chain's root for requests of a LoRA adapter (None: the base model). From the adapter's name, so every
    worker and the coordinator agree; an adapter loaded again under its name gets the same salt, and the worker's
    own check (its engine id in the cached block) keeps the old adapter's blocks from being reused."""
    if lora_name is None:
        return None
    return xxhash.xxh64_intdigest(b"lora\0" + lora_name.encode("utf-8", "surrogatepass"))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: int | None, max_blocks: int) -> list[int]:
    """The hashes of the first `max_blocks` full blocks of `token_ids` (fewer if it has fewer), equal to what
    `hash_block_tokens` chains block by block; the tokens are converted once (a coordinator hashes every prompt it
    routes)."""
    count = min(max_blocks, len(token_ids) // block_size)
    if count <= 0:
        return []
    data = _token_bytes(token_ids[: count * block_size])
    width = block_size * 8
    hashes: list[int] = []
    parent = salt
    for i in range(count):
        chunk = data[i * width : (i + 1) * width]
        parent = xxhash.xxh64_intdigest(chunk if parent is None else parent.to_bytes(8, "little") + chunk)
        hashes.append(parent)
    return hashes
