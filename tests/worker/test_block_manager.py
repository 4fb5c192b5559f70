"""BlockManager: ref counts, free order, prefix-cache hits and their safety, and a property test that random
request lifecycles through the scheduler never leak, double-free or hand out wrong KV."""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_sim import finish_step, make_request

from infer.protocol.prefix_hash import prefix_digest
from infer.worker.engine import block_manager as bm_module
from infer.worker.engine.block_manager import BlockManager, hash_block_tokens
from infer.worker.engine.request import Request, RequestStatus
from infer.worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def compute(manager: BlockManager, request: Request, num_new_tokens: int, cached: list[int] | None = None) -> None:
    """Allocate, 'run' the tokens and register full blocks, as one engine step would."""
    assert manager.allocate(request, num_new_tokens, cached or [])
    request.num_computed_tokens += num_new_tokens
    manager.cache_full_blocks(request)


def prefilled(manager: BlockManager, i: int, prompt: list[int]) -> Request:
    request = make_request(i, prompt)
    cached = manager.find_cached_prefix(request)
    compute(manager, request, request.num_tokens - len(cached) * manager.block_size, cached)
    return request


# ---- allocation and ref counts ---------------------------------------------------------------------


def test_allocate_grow_and_free_keep_ref_counts():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    request = make_request(0, list(range(10)))
    assert manager.allocate(request, 10)
    assert len(request.block_table) == 3 and manager.num_free_blocks == 5
    assert all(manager.ref_count(b) == 1 for b in request.block_table)
    assert manager.usage == pytest.approx(3 / 8)
    request.num_computed_tokens = 10
    for token in (10, 11):  # decodes fill the third block: no new block
        request.append_token(token)
        assert manager.allocate(request, 1)
        request.num_computed_tokens += 1
    assert len(request.block_table) == 3
    request.append_token(12)
    assert manager.allocate(request, 1) and len(request.block_table) == 4
    manager.check_invariants(holders=[request])
    table = list(request.block_table)
    manager.free(request)
    assert request.block_table == [] and request.num_computed_tokens == 0
    assert manager.num_free_blocks == 8 and all(manager.ref_count(b) == 0 for b in table)
    manager.check_invariants(holders=[])


def test_allocation_that_does_not_fit_changes_nothing():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    big = make_request(0, list(range(12)))
    other = make_request(1, list(range(8)))
    assert manager.allocate(big, 12)
    assert not manager.allocate(other, 8)
    assert other.block_table == [] and manager.num_free_blocks == 1
    assert manager.allocate(other, 4)  # one block still fits
    manager.check_invariants(holders=[big, other])


def test_chunked_allocation_grows_with_the_chunks():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    request = make_request(0, list(range(30)))
    for expected_blocks, chunk in ((2, 7), (4, 7), (8, 16)):
        compute(manager, request, chunk)
        assert len(request.block_table) == expected_blocks
    assert request.num_computed_tokens == 30


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, r: m.allocate(r, 0), "num_new_tokens must be a positive integer"),
        (lambda m, r: m.allocate(r, 11), "cannot allocate up to token 11, it has only 10 tokens"),
        (lambda m, r: m.allocate(r, 2, [0]), "block 0 holds no cached content"),
        (lambda m, r: m.allocate(r, 1, [0, 1, 2]), "at most 9 tokens may come from the cache"),
    ],
)
def test_invalid_allocations_raise(call, message):
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match=message):
        call(manager, make_request(0, list(range(10))))


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 4, True), "num_blocks must be a positive integer"),
        ((8, 0, True), "block_size must be a positive integer"),
        ((8, True, True), "block_size must be a positive integer"),
        ((8, 4, 1), "enable_prefix_caching must be a bool"),
    ],
)
def test_bad_construction_raises(args, message):
    with pytest.raises(ValueError, match=message):
        BlockManager(*args)


def test_double_free_and_ref_mismatch_are_caught():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    request = make_request(0, list(range(6)))
    assert manager.allocate(request, 6)
    impostor = make_request(1, list(range(6)))
    impostor.block_table = list(request.block_table)  # a table naming blocks it holds no refs on
    with pytest.raises(ValueError, match="ref count 1 but 2 table entries"):
        manager.check_invariants(holders=[request, impostor])
    manager.free(request)
    with pytest.raises(ValueError, match="already free"):
        manager.free(impostor)
    with pytest.raises(ValueError, match="ref count 0 but 1 table entries"):
        manager.check_invariants(holders=[impostor])


# ---- prefix cache -----------------------------------------------------------------------------------


def test_two_requests_share_a_256_token_prefix():
    manager = BlockManager(num_blocks=64, block_size=16, enable_prefix_caching=True)
    prefix = [random.Random(0).randrange(50_000) for _ in range(256)]
    first = prefilled(manager, 0, prefix + [1, 2, 3])
    second = make_request(1, prefix + [7, 8, 9, 10])
    cached = manager.find_cached_prefix(second)
    assert cached == first.block_table[:16]
    assert manager.allocate(second, second.num_tokens - 256, cached)
    assert second.num_computed_tokens == second.num_cached_tokens == 256
    assert second.block_table[:16] == first.block_table[:16]
    assert second.block_table[16] != first.block_table[16]
    assert all(manager.ref_count(b) == 2 for b in cached)
    assert (manager.num_queried_tokens, manager.num_hit_tokens) == (259 + 260, 256)
    manager.check_invariants(holders=[first, second])
    manager.free(first)
    assert all(manager.ref_count(b) == 1 for b in cached)
    manager.free(second)
    assert manager.num_free_blocks == 64
    manager.check_invariants(holders=[])


def test_last_token_is_never_served_from_the_cache():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 108))  # exactly two full blocks
    prefilled(manager, 0, prompt)
    same = make_request(1, prompt)
    assert len(manager.find_cached_prefix(same)) == 1  # 4 tokens, not 8: the 8th must produce logits
    longer = make_request(2, prompt + [5])
    assert len(manager.find_cached_prefix(longer)) == 2
    assert manager.find_cached_prefix(make_request(3, prompt[:4])) == []
    assert manager.find_cached_prefix(make_request(4, prompt[:1])) == []


def test_only_full_computed_blocks_are_cached():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    request = make_request(0, list(range(10)))
    compute(manager, request, 6)  # block 1 half computed
    assert manager.num_cached_blocks == 1
    probe = make_request(1, list(range(10)))
    assert manager.find_cached_prefix(probe) == request.block_table[:1]
    compute(manager, request, 4)
    assert manager.num_cached_blocks == 2  # block 2 holds 2 of 4 tokens: not cached
    assert manager.find_cached_prefix(probe) == request.block_table[:2]


def test_prefix_caching_off_caches_nothing():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    prefilled(manager, 0, list(range(20)))
    assert manager.num_cached_blocks == 0
    assert manager.find_cached_prefix(make_request(1, list(range(20)))) == []


def test_freed_cached_blocks_are_evicted_least_recently_freed_first_tail_first():
    manager = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = prefilled(manager, 0, list(range(8)))
    b = prefilled(manager, 1, list(range(100, 108)))
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    manager.free(a)
    manager.free(b)
    probe_a, probe_b = make_request(2, list(range(8)) + [0]), make_request(3, list(range(100, 108)) + [0])
    assert manager.find_cached_prefix(probe_a) == a_blocks and manager.find_cached_prefix(probe_b) == b_blocks
    taker = make_request(4, list(range(200, 224)))
    assert manager.allocate(taker, 12)  # 2 never-used blocks, then a's tail block
    assert taker.block_table[2] == a_blocks[1] and manager.num_evicted_blocks == 1
    assert manager.find_cached_prefix(probe_a) == a_blocks[:1]
    taker.num_computed_tokens = 12
    assert manager.allocate(taker, 8)  # then a's head, then b's tail
    assert taker.block_table[3:] == [a_blocks[0], b_blocks[1]]
    assert manager.find_cached_prefix(probe_a) == [] and manager.find_cached_prefix(probe_b) == b_blocks[:1]
    manager.check_invariants(holders=[taker])


def test_blocks_without_cached_content_are_reused_before_cached_ones():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = prefilled(manager, 0, list(range(6)))  # block 0 full (cached), block 1 partial
    cached_block, partial_block = a.block_table
    manager.free(a)
    other = make_request(1, list(range(50, 62)))
    assert manager.allocate(other, 4)
    assert other.block_table == [partial_block]
    assert manager.find_cached_prefix(make_request(2, list(range(6)))) == [cached_block]


def test_a_hit_revives_a_freed_cached_block_and_counts_it_as_a_free_block():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = prefilled(manager, 0, list(range(9)))  # blocks: full, full, partial
    full_blocks = a.block_table[:2]
    manager.free(a)
    assert manager.num_free_blocks == 4
    again = make_request(1, list(range(9)) + [42, 43, 44, 45, 46, 47, 48])  # 16 tokens
    cached = manager.find_cached_prefix(again)
    assert cached == full_blocks
    assert manager.num_blocks_to_allocate(again, 8, cached) == 4  # 2 revived + 2 new
    assert manager.num_blocks_to_allocate(again, 4, cached) == 3
    assert manager.allocate(again, 4, cached)
    assert again.block_table[:2] == full_blocks and again.num_computed_tokens == 8
    assert manager.num_free_blocks == 1 and all(manager.ref_count(b) == 1 for b in full_blocks)
    manager.check_invariants(holders=[again])


def test_reviving_does_not_fit_changes_nothing():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = prefilled(manager, 0, list(range(9)))
    manager.free(a)
    hog = make_request(1, list(range(500, 504)))
    assert manager.allocate(hog, 4)  # takes the partial block; 3 left, 2 of them cached
    again = make_request(2, list(range(16)))
    cached = manager.find_cached_prefix(again)
    assert len(cached) == 2 and manager.num_blocks_to_allocate(again, 8, cached) == 4
    assert not manager.allocate(again, 8, cached)
    assert again.block_table == [] and again.num_computed_tokens == 0 and manager.num_free_blocks == 3
    assert all(manager.ref_count(b) == 0 for b in cached)
    manager.check_invariants(holders=[hog])


def test_block_hashes_are_computed_once_per_request():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    request = make_request(0, list(range(17)))
    calls = []

    def counting(parent, tokens):
        calls.append(tuple(tokens))
        return hash_block_tokens(parent, tokens)

    with mock.patch.object(bm_module, "hash_block_tokens", counting):
        manager.find_cached_prefix(request)
        manager.find_cached_prefix(request)
        compute(manager, request, 17)
    assert len(request.block_hashes) == 4
    assert len(calls) == 4  # 4 full blocks, each hashed once


def test_hash_chain_depends_on_the_parent_and_the_order():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(7, [1, 2])
    assert hash_block_tokens(7, [1, 2]) == hash_block_tokens(7, [1, 2])


def test_hash_collisions_never_give_wrong_kv(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens: 0)  # every block collides
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    a = prefilled(manager, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert manager.find_cached_prefix(make_request(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])) == []
    assert manager.find_cached_prefix(make_request(2, [1, 2, 3, 4, 0, 0, 0, 0, 9])) == a.block_table[:1]
    # Same tokens, other position: block [5,5,5,5] at position 0 is not the KV of [5,5,5,5] after [5,5,5,5].
    b = prefilled(manager, 3, [5, 5, 5, 5, 0])
    probe = make_request(4, [5] * 8 + [0])
    assert manager.find_cached_prefix(probe) == b.block_table[:1]
    c = prefilled(manager, 5, [5] * 8 + [1])
    assert c.num_cached_tokens == 4 and c.block_table[0] == b.block_table[0]
    assert manager.find_cached_prefix(probe) == c.block_table[:2]
    # Same tokens after a different prefix: no hit past the difference.
    assert manager.find_cached_prefix(make_request(6, [6, 6, 6, 6, 5, 5, 5, 5, 0])) == []
    manager.check_invariants(holders=[a, b, c])


# ---- property test through the scheduler ------------------------------------------------------------

MOD = (1 << 61) - 1


def prefix_fingerprints(token_ids: list[int]) -> list[int]:
    """fingerprints[p] names the exact prefix token_ids[:p + 1] (the KV at position p depends on it)."""
    out, h = [], 0
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % MOD
        out.append(h)
    return out


class FakeKV:
    """Slot contents of the paged pool, as fingerprints of the prefix whose KV each slot holds. Reading a
    slot that holds any other prefix means a request was given wrong KV."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def run(self, output: SchedulerOutput) -> None:
        for chunk in output.chunks:
            request, bs = chunk.request, self.block_size
            prints = prefix_fingerprints(request.token_ids[: chunk.end])
            for pos in range(chunk.end):
                slot = (request.block_table[pos // bs], pos % bs)
                if pos < chunk.start:
                    assert self.slots.get(slot) == prints[pos], f"{request.request_id}: wrong KV at {pos}"
                else:
                    self.slots[slot] = prints[pos]


def fake_next_token(token_ids: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(token_ids[-8:])) + len(token_ids)) % 11


def engine_step(scheduler: Scheduler, kv: FakeKV) -> SchedulerOutput:
    output = scheduler.schedule()
    kv.run(output)
    finish_step(scheduler, output, fake_next_token)
    return output


BASES = [[i % 5 for i in range(20)], [3] * 20, list(range(20))]
MAX_PROMPT, MAX_OUTPUT = 26, 8


def random_ops(rng: random.Random, count: int) -> list[tuple]:
    """A workload: adds (prompts sharing prefixes of a few bases), steps, aborts and early finishes."""
    kinds = rng.choices(["add", "step", "abort", "finish"], weights=[3, 5, 1, 1], k=count)

    def add() -> tuple:
        tail = [rng.randrange(5) for _ in range(rng.randint(0, 6))]
        return ("add", rng.randrange(3), rng.randint(0, 20), tail, rng.randint(1, MAX_OUTPUT))

    return [add() if kind == "add" else (kind, rng.randrange(40)) for kind in kinds]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 12),
    caching=st.booleans(),
    chunked=st.booleans(),
    weak_hash=st.booleans(),
)
def test_random_lifecycles_keep_invariants_and_leak_nothing(
    seed, block_size, extra_blocks, caching, chunked, weak_hash
):
    """Pools from "the largest request just fits" upwards; a weak hash makes collisions common. The fake KV
    checks every cached token a request reads is the KV of its own prefix."""
    num_blocks = -(-(MAX_PROMPT + MAX_OUTPUT) // block_size) + extra_blocks
    hash_fn = (lambda parent, tokens: sum(tokens) % 3) if weak_hash else hash_block_tokens
    with mock.patch.object(bm_module, "hash_block_tokens", hash_fn):
        config = SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=16 if chunked else 40,
            max_model_len=40,
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
        )
        scheduler, kv = Scheduler(config), FakeKV(block_size)
        requests: list[Request] = []
        for op in random_ops(random.Random(seed), 80):
            apply_op(scheduler, kv, requests, op)
            scheduler.check_invariants()
        for _ in range(2000):
            if not scheduler.has_unfinished():
                break
            engine_step(scheduler, kv)
        assert not scheduler.has_unfinished()
        assert scheduler.block_manager.num_free_blocks == num_blocks
        scheduler.block_manager.check_invariants(holders=[])
        for request in requests:
            assert request.is_finished and request.block_table == []
            if request.status is RequestStatus.FINISHED_LENGTH:
                assert request.num_output_tokens == request.max_tokens


def apply_op(scheduler: Scheduler, kv: FakeKV, requests: list[Request], op: tuple) -> None:
    kind = op[0]
    if kind == "add":
        _, base, keep, tail, max_tokens = op
        prompt = BASES[base][:keep] + tail or [1]
        request = make_request(len(requests), prompt, max_tokens)
        scheduler.add(request)
        requests.append(request)
    elif kind == "step":
        engine_step(scheduler, kv)
    elif kind == "abort" and requests:
        request = requests[op[1] % len(requests)]
        was_finished = request.is_finished
        assert scheduler.abort(request.request_id) is (None if was_finished else request)
        assert request.is_finished and request.block_table == []
    elif kind == "finish" and requests:
        request = requests[op[1] % len(requests)]
        if not request.is_finished:
            scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            assert request.block_table == [] and request.status is RequestStatus.FINISHED_STOPPED


# ---- the tier beyond the pool (worker/kv/offload.py's bookkeeping) -----------------------------------------------


class FakeTier:
    """A LowerTier whose 'disk' is a dict: hash -> digest (what the engine would have written)."""

    def __init__(self) -> None:
        self.disk: dict[int, bytes] = {}

    def holds(self, block_hash: int) -> bool:
        return block_hash in self.disk

    def loadable(self, block_hash: int) -> bool:
        return block_hash in self.disk

    def hashes(self) -> list[int]:
        return list(self.disk)


def tiered(num_blocks: int) -> tuple[BlockManager, FakeTier]:
    manager = BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True)
    tier = FakeTier()
    manager.attach_tier(tier)
    return manager, tier


def spill_all(manager: BlockManager, tier: FakeTier) -> list[int]:
    """What the engine does after a schedule: every evicted block goes to the tier; the evicted ids."""
    evicted = manager.take_evicted()
    for _, block_hash, digest in evicted:
        tier.disk[block_hash] = digest
    return [block_id for block_id, _, _ in evicted]


def test_evicted_blocks_are_listed_with_their_hash_and_prefix_digest():
    manager, _ = tiered(4)
    a = prefilled(manager, 0, list(range(13)))  # 3 full blocks + 1 token: all 4 blocks
    table, hashes = list(a.block_table), list(a.block_hashes)
    manager.free(a)
    assert manager.take_evicted() == []
    b = prefilled(manager, 1, [100 + i for i in range(9)])  # 3 blocks: a's partial one, then its tail first
    d0 = prefix_digest(None, range(4))
    d1 = prefix_digest(d0, range(4, 8))
    d2 = prefix_digest(d1, range(8, 12))
    assert manager.take_evicted() == [(table[2], hashes[2], d2), (table[1], hashes[1], d1)]
    assert manager.take_evicted() == []
    manager.check_invariants(holders=[b])


def test_a_waiting_request_gets_its_prefix_back_from_the_tier_behind_its_pool_hits():
    manager, tier = tiered(6)
    prompt = list(range(17))  # 4 full blocks + 1 token
    a = prefilled(manager, 0, prompt)
    manager.free(a)
    filler = prefilled(manager, 1, [500 + i for i in range(17)])  # evicts a's tail: blocks 3, 2, 1
    spill_all(manager, tier)
    manager.free(filler)  # a's head now sits second in the free queue: the next allocation but one takes it
    again = make_request(2, prompt)
    hits, wanted = manager.plan_restore(again)
    assert len(hits) == 1 and [h for h, _ in wanted] == a.block_hashes[1:4]
    assert [d for _, d in wanted] == [tier.disk[h] for h in a.block_hashes[1:4]]  # the same digest chain
    restored = manager.restore(again, hits, wanted)
    assert len(restored) == 3 and hits[0] not in restored
    assert manager.find_cached_prefix(again) == hits + restored  # ordinary hits now
    assert manager.num_free_blocks == 6  # restored blocks wait free and cached
    compute(manager, again, 1, manager.find_cached_prefix(again))
    assert again.num_cached_tokens == 16
    manager.check_invariants(holders=[again])


def test_restoring_never_evicts_the_requests_own_hits():
    manager, tier = tiered(5)
    prompt = list(range(13))
    a = prefilled(manager, 0, prompt)
    manager.free(a)
    held = prefilled(manager, 1, [300 + i for i in range(9)])  # holds 3 blocks: evicts a's block 2
    spill_all(manager, tier)
    again = make_request(2, prompt)
    hits, wanted = manager.plan_restore(again)
    assert len(hits) == 2 and len(wanted) == 1
    assert manager.restore(again, hits, wanted) == []  # the free queue holds only the hits
    assert manager.find_cached_prefix(again) == hits
    manager.free(held)
    hits, wanted = manager.plan_restore(again)
    restored = manager.restore(again, hits, wanted)
    assert len(restored) == 1 and manager.find_cached_prefix(again) == hits + restored
    manager.check_invariants(holders=[])


def test_lora_requests_and_requests_holding_blocks_are_not_planned():
    manager, _ = tiered(8)
    request = make_request(0, list(range(9)))
    request.lora_id = 1
    assert manager.plan_restore(request) == ([], [])
    plain = prefilled(manager, 1, list(range(9)))
    assert manager.plan_restore(plain) == ([], [])


def test_a_hash_the_tier_holds_stays_held_in_the_kv_events():
    manager, tier = tiered(3)
    log = manager.publish_events(True)
    assert log is not None
    log.take()
    a = prefilled(manager, 0, list(range(9)))  # 2 full blocks + 1 token: all 3 blocks
    manager.free(a)
    tier.disk[a.block_hashes[1]] = b"x" * 16  # as if spilled already
    b = prefilled(manager, 1, [200 + i for i in range(9)])  # evicts both of a's cached blocks
    events = log.take()
    assert events is not None
    assert a.block_hashes[0] in events.removed and a.block_hashes[1] not in events.removed
    manager.free(b)
    manager.reset_prefix_cache()  # the pool forgets; the disk still holds its block
    snapshot = log.take()
    assert snapshot is not None and snapshot.reset and snapshot.stored == [a.block_hashes[1]]


def test_the_tier_needs_prefix_caching_and_an_empty_cache():
    with pytest.raises(ValueError, match="needs prefix caching"):
        BlockManager(4, 4, enable_prefix_caching=False).attach_tier(FakeTier())
    manager = BlockManager(4, 4, enable_prefix_caching=True)
    prefilled(manager, 0, list(range(5)))
    with pytest.raises(ValueError, match="before any block is cached"):
        manager.attach_tier(FakeTier())
