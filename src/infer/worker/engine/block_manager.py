"""BlockManager: bookkeeping of the paged KV cache (which block holds which tokens), torch-free.

The pool has `num_blocks` blocks of `block_size` token slots. A request's `block_table[i]` is the block
holding its tokens `[i * block_size, (i + 1) * block_size)`.

Prefix caching keeps the KV of full blocks reusable across requests. Block `i` of a token sequence is
named by a hash chain, `hash_i = xxh64(hash_{i-1} as 8 bytes + tokens of block i as int64)`
(protocol/prefix_hash.py, which the coordinator computes too; the first block's parent is the request's
`cache_salt`: its LoRA adapter's, from the adapter's name), and `request.block_hashes` caches those hashes so they
are computed once per request. A hash only finds
candidates: a hit also needs equal tokens, the same parent and the same adapter (see `_Content`), so a hash
collision can cost a hit but never gives a request the KV of other tokens or of another adapter (the base model
and each adapter compute other K / V for the same prompt).

Free blocks wait in one queue; allocation takes blocks from its front (evicting any cached content
they still hold). A freed block that holds cached content keeps it and can be revived by a later hit
until the allocator hands it out again.

A tier beyond the pool (`attach_tier`: worker/kv/offload.py, over host memory and / or disk files): base-model blocks
evicted from the pool are listed in `evicted` (block id, hash, prefix digest) for the engine to copy out before any
forward overwrites them; `plan_restore` finds a waiting request's leading blocks missing from the pool but in the tier,
and `restore` puts those the engine could read back into free blocks as cached content (most recently used), where
the request's admission finds them as ordinary hits. With a tier, every base-model block also carries its prefix
digest (protocol/prefix_hash.py: the proof a file is checked against; a 64-bit hash alone is never trusted), and a
hash stays held for the KV events while the tier holds it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from infer.protocol.prefix_hash import hash_block_tokens, prefix_digest
from infer.worker.engine.request import Request
from infer.worker.kv.events import KvEventLog

# A block-table entry whose block was given back (`release_before`): its positions are out of every layer's
# sliding window, so no step reads them again. The tensors the kernels get name block 0 (or the step graphs'
# scratch block) there.
RELEASED = -1


__all__ = ["RELEASED", "BlockManager", "LowerTier", "hash_block_tokens"]


class LowerTier(Protocol):
    """Where evicted blocks go (worker/kv/offload.py's KvOffload: host memory, disk, or both). Called from the
    engine's thread only, but its answers may change between calls (the disk's writer thread): `holds` is true while
    a hash is stored or queued to be; `loadable` only once it could be read back now."""

    def holds(self, block_hash: int) -> bool: ...

    def loadable(self, block_hash: int) -> bool: ...

    def hashes(self) -> Iterable[int]: ...


@dataclass(frozen=True)
class _Content:
    """What a cached block holds. `key` is unique to this registration, so a block later handed out for
    other tokens never matches an old reference to it. `parent_key` is the key of the block holding the
    previous block of the same sequence (None for a sequence's first block): a chain of verified parents
    plus equal tokens proves the whole prefix equal, whatever the hashes do. `lora_id`: the adapter whose K / V it
    holds (0: the base model). `digest`: with a tier beyond the pool, a base-model block's prefix digest."""

    key: int
    hash: int
    parent_key: int | None
    token_ids: tuple[int, ...]
    lora_id: int = 0
    digest: bytes | None = None


@dataclass
class _Block:
    """One block of the pool; `content` is set iff it holds registered (cached) prefix content."""

    block_id: int
    ref_count: int = 0
    content: _Content | None = None


class BlockManager:
    """Ref-counted blocks, an eviction-ordered free queue and a prefix cache over full blocks.

    Invariants (checked by `check_invariants`):
    - every block is either free (ref_count 0, in the free queue exactly once) or held
      (ref_count > 0 = the number of block-table entries naming it, not in the free queue);
    - `_cached[h]` holds exactly the cached blocks whose hash is h, and holds no empty sets;
    - a request's table has no repeated block, and its cached blocks form a leading run (blocks are
      registered in order, and a held block keeps its registration);
    - entries RELEASED (blocks given back out of every window) form a leading run of the table, and with prefix
      caching never reach its last registered block (the parent of the next one to register).

    Free order: when a request frees its blocks, blocks that hold cached content go to the back of the
    queue in reverse table order (a sequence's tail is evicted before its head, as in vLLM); blocks with
    no cached content go to the front, since reusing them first loses nothing. Allocation takes from the
    front, so among cached blocks the least recently freed is evicted first (LRU).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = next out
        self._cached: dict[int, dict[int, None]] = {}  # hash -> ids of cached blocks with that hash
        self._next_key = 0
        self.num_queried_tokens = 0  # tokens of first-scheduled requests looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens served from the cache
        self.num_evicted_blocks = 0  # cached blocks handed out for new content
        self.events: KvEventLog | None = None  # the cache's changes for the coordinator, once publishing
        self.tier: LowerTier | None = None  # the tier beyond the pool (attach_tier)
        self.evicted: list[tuple[int, int, bytes]] = []  # (block id, hash, digest) evicted, not yet copied out

    def attach_tier(self, tier: LowerTier) -> None:
        """Spill evicted base-model blocks to `tier` and restore them from it (see the module docstring). Before the
        first registration: every block must carry its digest."""
        if not self.enable_prefix_caching:
            raise ValueError("a KV tier beyond the pool needs prefix caching")
        if self._cached:
            raise ValueError("attach the KV tier before any block is cached")
        self.tier = tier

    def holds(self, block_hash: int) -> bool:
        """Whether a pool block with this hash is cached (held by a request or free)."""
        return block_hash in self._cached

    def _held_hashes(self) -> list[int]:
        """What the KV events say this worker holds: the pool's cached hashes and the tier's."""
        held = list(self._cached)
        if self.tier is not None:
            held.extend(self.tier.hashes())
        return held

    def publish_events(self, on: bool) -> KvEventLog | None:
        """Start (again, from a snapshot of every hash held) or stop logging the prefix cache's changes: a hash is
        `stored` when its first cached block appears and `removed` when its last one goes (worker/kv/events.py).
        Nothing to log without prefix caching."""
        if not on or not self.enable_prefix_caching:
            self.events = None
        elif self.events is None:
            self.events = KvEventLog(self._held_hashes, max_pending=max(2 * self.num_blocks, 4096))
        else:
            self.events.restart()
        return self.events

    # ---- sizes -----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (free cached blocks included: they are evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding reusable prefix content, held or free."""
        return sum(len(ids) for ids in self._cached.values())

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup ---------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Ids of cached blocks holding the request's leading full blocks, in table order.

        Takes no references. Covers at most `request.num_tokens - 1` tokens (the last token is always
        computed, to produce logits), so it returns at most `(num_tokens - 1) // block_size` blocks.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        found: list[int] = []
        parent_key: int | None = None
        for i in range(max_blocks):
            hit = self._lookup(hashes[i], parent_key, self._block_tokens(request, i), request.lora_id)
            if hit is None:
                break
            found.append(hit[0])
            parent_key = hit[1].key
        return found

    def _lookup(
        self, block_hash: int, parent_key: int | None, token_ids: tuple[int, ...], lora_id: int
    ) -> tuple[int, _Content] | None:
        """The cached block (id, content) with this hash, parent and tokens, if any: equal hashes alone
        are never trusted."""
        for block_id in self._cached.get(block_hash, ()):
            content = self._blocks[block_id].content
            if (
                content is not None
                and content.parent_key == parent_key
                and content.token_ids == token_ids
                and content.lora_id == lora_id
            ):
                return block_id, content
        return None

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """`request.block_hashes`, extended (once, cached on the request) to cover `num_full_blocks`."""
        hashes = request.block_hashes
        while len(hashes) < num_full_blocks:
            parent = hashes[-1] if hashes else request.cache_salt
            hashes.append(hash_block_tokens(parent, self._block_tokens(request, len(hashes))))
        return hashes

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        """What names block `index`'s content besides its parent: its tokens, then the keys of the images whose
        tokens it holds (Request.image_tags), which the hash chain and the hit check both take in; the same image
        tokens of another image never hit."""
        start = index * self.block_size
        tokens = tuple(request.token_ids[start : start + self.block_size])
        return tokens + request.image_tags(start, start + self.block_size) if request.images else tokens

    # ---- allocation ------------------------------------------------------------------------------

    def num_blocks_to_allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = (), num_draft_tokens: int = 0
    ) -> int:
        """Free blocks that `allocate(request, num_new_tokens, cached_blocks, num_draft_tokens)` would consume:
        new blocks plus cached blocks revived out of the free queue. Validates like `allocate`."""
        self._check_allocation(request, num_new_tokens, cached_blocks, num_draft_tokens)
        num_cached_tokens = len(cached_blocks) * self.block_size
        total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = max(0, self.blocks_for_tokens(total) - len(request.block_table) - len(cached_blocks))
        num_revived = sum(1 for block_id in cached_blocks if self._blocks[block_id].ref_count == 0)
        return num_new_blocks + num_revived + self.num_cross_blocks_to_allocate(request)

    def num_cross_blocks_to_allocate(self, request: Request) -> int:
        """Blocks an encoder-decoder request's cross-attention K/V still needs (all of them at its first
        allocation, none after): they are taken with its first blocks and freed with them."""
        if request.encoder_token_ids is None or request.cross_block_table:
            return 0
        return self.blocks_for_tokens(len(request.encoder_token_ids))

    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = (), num_draft_tokens: int = 0
    ) -> bool:
        """Grow `request.block_table` to cover its computed tokens plus `num_new_tokens`.

        `cached_blocks` (from `find_cached_prefix`, only when the request holds no blocks yet) are
        referenced first and count as computed: `num_computed_tokens` and `num_cached_tokens` become
        `len(cached_blocks) * block_size`, and `num_new_tokens` is counted after them.
        `num_draft_tokens`: the last that many of `num_new_tokens` are speculative draft tokens past the
        request's tokens (their slots are given back by `trim` when they are rejected).
        Returns False, changing nothing, when the free queue is too short.
        """
        if self.num_blocks_to_allocate(request, num_new_tokens, cached_blocks, num_draft_tokens) > len(self._free):
            return False
        if not request.block_table:
            self._start(request, cached_blocks)
        for _ in range(self.num_cross_blocks_to_allocate(request)):
            request.cross_block_table.append(self._take_free_block())
        total = request.num_computed_tokens + num_new_tokens
        while len(request.block_table) < self.blocks_for_tokens(total):
            request.block_table.append(self._take_free_block())
        return True

    def _check_allocation(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int], num_draft_tokens: int = 0
    ) -> None:
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be a positive integer, got {num_new_tokens!r}")
        if cached_blocks:
            self._check_cached_blocks(request, cached_blocks)
        end = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be a non-negative integer, got {num_draft_tokens!r}")
        if end > request.num_tokens + num_draft_tokens:
            raise ValueError(
                f"request {request.request_id!r}: cannot allocate up to token {end}, "
                f"it has only {request.num_tokens} tokens (+ {num_draft_tokens} draft tokens)"
            )
        if request.num_computed_tokens > len(request.block_table) * self.block_size:
            raise ValueError(
                f"request {request.request_id!r}: {request.num_computed_tokens} computed tokens "
                f"but only {len(request.block_table)} blocks"
            )

    def _check_cached_blocks(self, request: Request, cached_blocks: Sequence[int]) -> None:
        if request.block_table or request.num_computed_tokens:
            raise ValueError(
                f"request {request.request_id!r}: cached blocks can only be given when it holds "
                f"no blocks and has no computed tokens"
            )
        if len(cached_blocks) * self.block_size > request.num_tokens - 1:
            raise ValueError(
                f"request {request.request_id!r}: {len(cached_blocks)} cached blocks cover its "
                f"last token; at most {request.num_tokens - 1} tokens may come from the cache"
            )
        if len(set(cached_blocks)) != len(cached_blocks):
            raise ValueError(f"cached blocks repeat a block: {list(cached_blocks)}")
        for block_id in cached_blocks:
            if not 0 <= block_id < self.num_blocks or self._blocks[block_id].content is None:
                raise ValueError(f"block {block_id} holds no cached content (a stale find_cached_prefix result?)")

    def _start(self, request: Request, cached_blocks: Sequence[int]) -> None:
        """First allocation of a request: reference its cache hits and count the lookup."""
        for block_id in cached_blocks:
            self._ref(block_id)
            request.block_table.append(block_id)
        request.num_computed_tokens = request.num_cached_tokens = len(cached_blocks) * self.block_size
        if self.enable_prefix_caching:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += request.num_cached_tokens

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]  # revive a free cached block
        block.ref_count += 1

    def _take_free_block(self) -> int:
        """Pop the front of the free queue, evicting the cached content it may hold."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        content = block.content
        if content is not None:
            self._uncache(block, content)
            self.num_evicted_blocks += 1
            if self.tier is not None and content.digest is not None:
                self.evicted.append((block_id, content.hash, content.digest))
        block.ref_count = 1
        return block_id

    def _uncache(self, block: _Block, content: _Content) -> None:
        ids = self._cached[content.hash]
        del ids[block.block_id]
        if not ids:
            del self._cached[content.hash]
            if self.events is not None and (self.tier is None or not self.tier.holds(content.hash)):
                self.events.removed(content.hash)
        block.content = None

    # ---- registration and freeing ----------------------------------------------------------------

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full and computed, so later requests can hit them.

        Call after advancing `num_computed_tokens`. Idempotent; registers each block once, in order.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        hashes = self._block_hashes(request, num_full)
        first = num_full
        while (
            first > 0
            and request.block_table[first - 1] != RELEASED
            and self._blocks[request.block_table[first - 1]].content is None
        ):
            first -= 1
        for i in range(first, num_full):
            self._register(
                self._blocks[request.block_table[i]],
                hashes[i],
                self._parent(request, i),
                self._block_tokens(request, i),
                request.lora_id,
            )

    def _parent(self, request: Request, index: int) -> _Content | None:
        if index == 0:
            return None
        parent = self._blocks[request.block_table[index - 1]].content
        if parent is None:  # unreachable while cached blocks form a leading run of every table
            raise ValueError(f"request {request.request_id!r}: block {index - 1} is not cached before block {index}")
        return parent

    def _register(
        self, block: _Block, block_hash: int, parent: _Content | None, token_ids: tuple[int, ...], lora_id: int = 0
    ) -> None:
        digest = None
        if self.tier is not None and lora_id == 0 and (parent is None or parent.digest is not None):
            digest = prefix_digest(None if parent is None else parent.digest, token_ids)
        parent_key = None if parent is None else parent.key
        block.content = _Content(self._next_key, block_hash, parent_key, token_ids, lora_id, digest)
        self._next_key += 1
        ids = self._cached.get(block_hash)
        if ids is None:
            ids = self._cached[block_hash] = {}
            if self.events is not None:
                self.events.stored(block_hash)
        ids[block.block_id] = None

    def trim(self, request: Request) -> int:
        """Give back the blocks past those `request.token_ids` need (slots of rejected draft tokens: their K/V
        is never read, and is overwritten when the slots are used again). Such blocks hold no cached content
        (they hold no full computed block). Returns the number of blocks freed."""
        keep = self.blocks_for_tokens(request.num_tokens)
        if request.num_computed_tokens > keep * self.block_size:
            raise ValueError(
                f"request {request.request_id!r}: {request.num_computed_tokens} computed tokens "
                f"but only {request.num_tokens} tokens"
            )
        surplus = request.block_table[keep:]
        for block_id in reversed(surplus):
            self._unref(block_id)
        del request.block_table[keep:]
        return len(surplus)

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give `child` (new: no blocks, nothing computed) the KV of `parent`'s computed tokens without copying
        them: the blocks they fill are shared (each one's ref count up), and the partial last block, which both
        will write into, is copied into a block of the child's own (copy-on-write at the fork). Returns that copy
        as (parent's block, child's block) for the caller to apply to the pool, or None (no partial block).
        Raises ValueError, changing nothing, when the free queue is empty and a copy is needed."""
        if child.block_table or child.num_computed_tokens:
            raise ValueError(f"request {child.request_id!r} must hold no blocks to be forked into")
        if RELEASED in parent.block_table:
            raise ValueError(f"request {parent.request_id!r} gave blocks back (sliding window): it cannot be forked")
        num_computed = parent.num_computed_tokens
        num_full, partial = divmod(num_computed, self.block_size)
        if partial and not self._free:
            raise ValueError(f"no free block to fork request {parent.request_id!r} into")
        for block_id in parent.block_table[:num_full]:
            self._ref(block_id)
            child.block_table.append(block_id)
        child.num_computed_tokens = num_computed
        child.block_hashes = list(parent.block_hashes[:num_full])
        if not partial:
            return None
        block_id = self._take_free_block()
        child.block_table.append(block_id)
        return parent.block_table[num_full], block_id

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's content (the KV it holds is no longer valid: new weights, or a pool
        released by suspend). Raises ValueError, changing nothing, while any block is held: its request's
        KV would be registered again later. Returns the number of blocks forgotten."""
        if len(self._free) != self.num_blocks:
            raise ValueError(f"cannot reset the prefix cache while {self.num_used_blocks} block(s) are held")
        forgotten, events, self.events = 0, self.events, None  # one reset instead of an event a block
        for block in self._blocks:
            if block.content is not None:
                self._uncache(block, block.content)
                forgotten += 1
        self.evicted.clear()
        self.events = events
        if events is not None:
            if self.tier is None:
                events.cleared()
            else:
                events.restart()  # a snapshot: what the tier still holds
        return forgotten

    def release_before(self, request: Request, position: int) -> int:
        """Give back the request's leading blocks that hold only positions < `position` (out of every layer's
        window for all its later queries), keeping with prefix caching its last registered block. Their table
        entries become RELEASED; cached ones join the free queue as a freed request's do. Returns how many."""
        count = max(0, position) // self.block_size
        if self.enable_prefix_caching:
            count = min(count, request.num_computed_tokens // self.block_size - 1)
        released = 0
        for index in range(min(count, len(request.block_table))):
            block_id = request.block_table[index]
            if block_id != RELEASED:
                self._unref(block_id)
                request.block_table[index] = RELEASED
                released += 1
        return released

    def free(self, request: Request) -> None:
        """Drop the request's references (tail first), clear its table and its computed count.

        A block whose count reaches 0 joins the free queue (see the class docstring for where).
        Raises ValueError, changing nothing, if the table names a block more often than it is
        referenced (a double free).
        """
        held = [block_id for block_id in request.block_table if block_id != RELEASED]
        for block_id, count in Counter(held).items():
            if self._blocks[block_id].ref_count < count:
                raise ValueError(f"request {request.request_id!r} frees block {block_id}, which is already free")
        for block_id in reversed(held):
            self._unref(block_id)
        for block_id in request.cross_block_table:  # never cached: to the front of the free queue
            self._unref(block_id)
        request.block_table.clear()
        request.cross_block_table.clear()
        request.encoder_computed = False
        request.num_computed_tokens = 0

    def _unref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.content is None:
                self._free.move_to_end(block_id, last=False)

    # ---- the tier beyond the pool ----------------------------------------------------------------

    def take_evicted(self) -> list[tuple[int, int, bytes]]:
        """(block id, hash, digest) of the blocks evicted since the last call: their KV is still in the pool until
        the next forward or block copy writes there."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def plan_restore(self, request: Request) -> tuple[list[int], list[tuple[int, bytes]]]:
        """The request's pool hits (`find_cached_prefix`) and (hash, prefix digest) of the blocks right after them
        that the tier could load, in order, up to the first it lacks: what `restore` could add. A base-model request
        that holds no blocks only."""
        if self.tier is None or request.lora_id or request.block_table:
            return [], []
        hits = self.find_cached_prefix(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        parent = self._blocks[hits[-1]].content if hits else None
        digest = None if parent is None else parent.digest
        if parent is not None and digest is None:
            return hits, []
        wanted: list[tuple[int, bytes]] = []
        for i in range(len(hits), max_blocks):
            if not self.tier.loadable(hashes[i]):
                break
            digest = prefix_digest(digest, self._block_tokens(request, i))
            wanted.append((hashes[i], digest))
        return hits, wanted

    def restore(self, request: Request, hits: Sequence[int], loaded: Sequence[tuple[int, bytes]]) -> list[int]:
        """Give `loaded` (the leading part of `plan_restore`'s list, read back and checked by the caller, right
        after that call) free blocks as cached content, free and most recently used, right after the request's
        `hits`; the hits are moved to the recent end too, so that nothing taken here evicts them, and as many are
        restored as the free queue holds beside them. Returns the block ids in order: the caller writes their KV
        (after copying out what `take_evicted` lists: taking them may evict other content) before any forward."""
        free_hits = [block_id for block_id in hits if self._blocks[block_id].ref_count == 0]
        self._touch(free_hits)
        parent = self._blocks[hits[-1]].content if hits else None
        restored: list[int] = []
        for block_hash, _digest in loaded[: max(0, len(self._free) - len(free_hits))]:
            block_id = self._take_free_block()
            tokens = self._block_tokens(request, len(hits) + len(restored))
            self._register(self._blocks[block_id], block_hash, parent, tokens, request.lora_id)
            parent = self._blocks[block_id].content
            restored.append(block_id)
        for block_id in reversed(restored):
            self._unref(block_id)  # free and cached: to the recent end, the tail first
        self._touch(free_hits)
        return restored

    def _touch(self, free_blocks: Sequence[int]) -> None:
        """Move free cached blocks of one sequence (in table order) to the recent end, the head last (evicted last)."""
        for block_id in reversed(free_blocks):
            self._free.move_to_end(block_id)

    # ---- checks ----------------------------------------------------------------------------------

    def check_invariants(self, holders: Iterable[Request] | None = None) -> None:
        """Raise ValueError if the pool is inconsistent. With `holders` (every request that holds
        blocks), also check that each block's ref count equals the table entries naming it."""
        self._check_free_queue()
        self._check_cache_map()
        if holders is not None:
            self._check_ref_counts(holders)

    def _check_free_queue(self) -> None:
        for block in self._blocks:
            if block.ref_count < 0:
                raise ValueError(f"block {block.block_id} has a negative ref count {block.ref_count}")
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise ValueError(
                    f"block {block.block_id} has ref count {block.ref_count} but is "
                    f"{'' if block.block_id in self._free else 'not '}in the free queue"
                )
        if len(self._free) != sum(1 for b in self._blocks if b.ref_count == 0):
            raise ValueError("the free queue names a block that does not exist")

    def _check_cache_map(self) -> None:
        for block_hash, ids in self._cached.items():
            if not ids:
                raise ValueError(f"hash {block_hash:#x} maps to no blocks")
            for block_id in ids:
                content = self._blocks[block_id].content
                if content is None or content.hash != block_hash:
                    raise ValueError(f"hash {block_hash:#x} maps to block {block_id}, which does not hold it")
        for block in self._blocks:
            if block.content is None:
                continue
            if block.block_id not in self._cached.get(block.content.hash, {}):
                raise ValueError(f"cached block {block.block_id} is missing from the hash map")
            # a block's tokens, then its image tags in (key, offset) pairs (Request.image_tags)
            extra = len(block.content.token_ids) - self.block_size
            if extra < 0 or extra % 2:
                raise ValueError(f"cached block {block.block_id} holds {len(block.content.token_ids)} tokens and tags")

    def _check_ref_counts(self, holders: Iterable[Request]) -> None:
        counts = [0] * self.num_blocks
        for request in holders:
            held = [block_id for block_id in request.block_table if block_id != RELEASED]
            if len(set(held)) != len(held):
                raise ValueError(f"request {request.request_id!r} names a block twice: {request.block_table}")
            if request.block_table[: len(request.block_table) - len(held)] != [RELEASED] * (
                len(request.block_table) - len(held)
            ):
                raise ValueError(
                    f"request {request.request_id!r}: released entries are no leading run: {request.block_table}"
                )
            for block_id in held + request.cross_block_table:
                counts[block_id] += 1
        for block, count in zip(self._blocks, counts, strict=True):
            if block.ref_count != count:
                raise ValueError(f"block {block.block_id} has ref count {block.ref_count} but {count} table entries")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
