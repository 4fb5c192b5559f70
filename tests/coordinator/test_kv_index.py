"""Routing by what the workers hold, sans I/O: the index (coordinator/kv_index.py) against the KvEvents it is fed,
the kv-aware policy's choices, session pinning (coordinator/sessions.py), and the coordinator's core wired to them
(tests/core_harness.py: frames in, frames out)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from core_harness import Harness, delta, dispatches, worker_hello

from infer.coordinator.kv_index import RESYNC_INTERVAL_S, KvAware, KvIndex
from infer.coordinator.sessions import Sessions
from infer.protocol.messages import (
    Error,
    KvEvents,
    KvResync,
    Load,
    RequestSpec,
    StepBatch,
    Submit,
    TokenIds,
    Welcome,
    encode,
)
from infer.protocol.prefix_hash import adapter_salt, prompt_block_hashes
from infer.protocol.sampling import SamplingParams

BS = 16
PROMPT = list(range(1, 101))  # 100 tokens: 6 full blocks usable ((100 - 1) // 16)
HASHES = prompt_block_hashes(PROMPT, BS, None, 6)


@dataclass(eq=False)
class Rank:
    dp_rank: int
    score: float = 0.0
    num_in_flight: int = 0
    block_size: int = BS
    capacity_tokens: int = 1000

    @property
    def worker_id(self) -> str:
        return f"w{self.dp_rank}"

    @property
    def group_id(self) -> str:
        return f"dp{self.dp_rank}"


def feed(index: KvIndex, rank: Rank, hashes, *, epoch=1, seq=0, reset=True, removed=(), now=0.0, max_hashes=100):
    events = KvEvents(epoch=epoch, seq=seq, reset=reset, stored=list(hashes), removed=list(removed))
    return index.apply(rank.worker_id, rank, rank.dp_rank, events, max_hashes, now)


# ---- the index -------------------------------------------------------------------------------------


def test_a_rank_holds_the_leading_run_of_a_prompt_blocks():
    index, a, b = KvIndex(), Rank(0), Rank(1)
    assert feed(index, a, HASHES[:4]) is None
    assert feed(index, b, HASHES[:2] + HASHES[3:]) is None  # block 2 missing: only 2 usable
    assert index.cached_blocks(HASHES, [a, b]) == [4, 2]
    assert feed(index, a, [], seq=1, reset=False, removed=[HASHES[1]]) is None
    assert index.cached_blocks(HASHES, [a, b]) == [1, 2]


def test_a_gap_drops_the_worker_and_asks_for_a_snapshot_once_per_interval():
    index, a = KvIndex(), Rank(0)
    feed(index, a, HASHES)
    problem = feed(index, a, [], seq=2, reset=False)  # seq 1 never arrived
    assert problem is not None and "gap" in problem and "expected epoch 1 seq 1" in problem
    assert index.holds("w0") == 0 and index.cached_blocks(HASHES, [a]) == [0]
    assert feed(index, a, HASHES, seq=3, reset=False, now=0.5) is None  # ignored (stale), not asked again yet
    assert index.holds("w0") == 0
    assert feed(index, a, HASHES, seq=4, reset=False, now=RESYNC_INTERVAL_S + 0.1) == "no snapshot yet"
    assert feed(index, a, HASHES[:3], epoch=2) is None  # the snapshot
    assert index.cached_blocks(HASHES, [a]) == [3] and index.num_resyncs == 2


def test_a_worker_claiming_more_than_its_pool_is_dropped():
    index, a = KvIndex(), Rank(0)
    problem = feed(index, a, range(50), max_hashes=10)
    assert problem is not None and "more than its 10" in problem and index.holds("w0") == 0


def test_entries_of_an_earlier_record_of_the_worker_count_for_nothing():
    index, old = KvIndex(), Rank(0)
    feed(index, old, HASHES)
    new = Rank(0)  # the worker registered again: a new record (a restarted process has an empty cache)
    assert index.cached_blocks(HASHES, [new]) == [0]
    assert feed(index, new, HASHES, seq=1, reset=False) == "no snapshot yet"
    assert index.holds("w0") == 0


def test_memory_is_bounded_least_recently_stored_first():
    index, a, b = KvIndex(max_entries=8), Rank(0), Rank(1)
    feed(index, a, range(6))
    feed(index, b, range(100, 106))
    assert index.num_entries == 8 and index.holds("w0") == 2 and index.holds("w1") == 6
    assert len(index) == 8


def test_forgetting_a_rank_drops_its_entries():
    index, a, b = KvIndex(), Rank(0), Rank(1)
    feed(index, a, HASHES)
    feed(index, b, HASHES)
    index.drop_rank(0)
    assert index.cached_blocks(HASHES, [a, b]) == [0, 6] and index.num_entries == 6


# ---- the policy --------------------------------------------------------------------------------------


def test_the_rank_holding_the_prefix_wins_at_equal_load():
    policy, a, b = KvAware(), Rank(0), Rank(1)
    feed(policy.index, b, HASHES)
    assert policy.choose(PROMPT, [a, b]) is b


def test_a_queue_longer_than_the_saved_prefill_sends_it_elsewhere():
    policy, a, b = KvAware(overlap_weight=1.0), Rank(0), Rank(1)
    feed(policy.index, b, HASHES)  # saves 96 tokens of prefill
    b.score = 0.05  # 50 tokens queued: worth it
    assert policy.choose(PROMPT, [a, b]) is b
    b.score = 0.15  # 150 tokens queued: not worth 96
    assert policy.choose(PROMPT, [a, b]) is a
    policy.overlap_weight = 2.0  # a saved token counts twice
    assert policy.choose(PROMPT, [a, b]) is b


def test_a_full_pool_is_left_out_while_another_can_take_it():
    policy, a, b = KvAware(overlap_weight=1000.0), Rank(0, score=0.9), Rank(1, score=1.0)
    feed(policy.index, b, HASHES)
    assert policy.choose(PROMPT, [a, b]) is a


def test_text_prompts_and_no_overlap_fall_back_to_least_loaded():
    policy, a, b = KvAware(), Rank(0, score=0.3), Rank(1, score=0.1)
    feed(policy.index, a, HASHES)
    assert policy.choose("a text prompt: the coordinator has no tokenizer", [a, b]) is b
    assert policy.choose(list(range(500, 600)), [a, b]) is b


def test_an_adapter_request_matches_only_its_adapter_blocks():
    policy, a, b = KvAware(), Rank(0), Rank(1)
    feed(policy.index, a, HASHES)
    feed(policy.index, b, prompt_block_hashes(PROMPT, BS, adapter_salt("sql"), 6))
    assert policy.choose_for(PROMPT, [a, b], None) is a
    assert policy.choose_for(PROMPT, [a, b], "sql") is b


def test_ranks_of_another_block_size_are_matched_by_their_own_hashes():
    policy, a, b = KvAware(), Rank(0), Rank(1, block_size=32)
    feed(policy.index, b, prompt_block_hashes(PROMPT, 32, None, 3))
    assert policy.choose(PROMPT, [a, b]) is b


# ---- sessions ----------------------------------------------------------------------------------------


def test_a_session_returns_to_its_rank_until_it_is_overloaded_or_gone():
    sessions, a, b = Sessions(overload_margin=0.25), Rank(0), Rank(1)
    assert sessions.home("m", "s", [a, b]) is None
    sessions.remember("m", "s", 1)
    assert sessions.home("m", "s", [a, b]) is b
    assert sessions.home("other-model", "s", [a, b]) is None
    b.score = 0.3
    assert sessions.home("m", "s", [a, b]) is None  # 0.3 above the least loaded: yields
    b.score = 0.2
    assert sessions.home("m", "s", [a, b]) is b
    assert sessions.home("m", "s", [a]) is None  # its rank cannot take it (dead, draining, full)
    sessions.forget_rank("m", 1)
    assert sessions.home("m", "s", [a, b]) is None


def test_the_session_table_is_bounded_least_recently_routed_first():
    sessions = Sessions(max_sessions=2)
    for name in ("s1", "s2", "s1", "s3"):
        sessions.remember("m", name, 0)
    assert len(sessions) == 2 and sessions.home("m", "s2", [Rank(0)]) is None
    assert sessions.home("m", "s1", [Rank(0)]) is not None


# ---- the coordinator's core --------------------------------------------------------------------------


def load(running: int = 0) -> Load:
    return Load(num_waiting=0, num_running=running, num_free_blocks=100, num_total_blocks=100, num_queued_tokens=0)


def events_frame(events: KvEvents, running: int = 0) -> StepBatch:
    return StepBatch(deltas=[], load=load(running), kv_events=events)


def kv_cluster() -> Harness:
    harness = Harness(policy="kv-aware")
    for wid in ("a", "b"):
        out = harness.worker(wid, None)
        welcome = [m for _, m in out if isinstance(m, Welcome)]
        assert welcome and welcome[0].kv_events
    return harness


def submit(harness: Harness, rid: str, prompt=PROMPT, session: str | None = None, client=b"c1"):
    msg = Submit(
        request_id=rid,
        spec=RequestSpec(prompt_token_ids=TokenIds(prompt), sampling=SamplingParams(temperature=0.0, max_tokens=4)),
        session_id=session,
    )
    return harness.send(client, msg)


def test_workers_are_asked_for_events_only_under_kv_aware():
    harness = Harness()
    welcome = [m for _, m in harness.worker("a", None) if isinstance(m, Welcome)]
    assert welcome and not welcome[0].kv_events


def test_a_prompt_goes_to_the_worker_reporting_its_blocks():
    harness = kv_cluster()
    harness.send(b"b", events_frame(KvEvents(epoch=1, seq=0, reset=True, stored=HASHES)))
    assert list(dispatches(submit(harness, "r1"))) == [b"b"]


def test_a_gap_is_answered_with_kv_resync_and_routing_goes_on():
    harness = kv_cluster()
    harness.send(b"b", events_frame(KvEvents(epoch=1, seq=0, reset=True, stored=HASHES)))
    out = harness.send(b"b", events_frame(KvEvents(epoch=1, seq=5, stored=[1])))
    assert [(i, type(m)) for i, m in out] == [(b"b", KvResync)]
    assert list(dispatches(submit(harness, "r1"))) == [b"a"]  # b's entries are gone: least loaded, rank 0


def test_malformed_events_are_refused_and_the_coordinator_keeps_serving():
    harness = kv_cluster()
    frame = encode(events_frame(KvEvents(epoch=1, seq=0, reset=True)))
    bad = frame.replace(b"\xa5reset\xc3", b"\xa5reset\xa3yes")  # reset: "yes"
    assert bad != frame
    out = harness.raw(b"b", [bad])
    assert [m for i, m in out if i == b"b" and isinstance(m, Error)]
    out = harness.raw(b"b", [b"\x81\xa4type\xa9not-a-map" + b"\x00" * 64])
    assert [m for i, m in out if i == b"b" and isinstance(m, Error)]
    assert dispatches(submit(harness, "r1"))


def test_a_dead_or_draining_worker_entries_go():
    harness = kv_cluster()
    harness.send(b"b", events_frame(KvEvents(epoch=1, seq=0, reset=True, stored=HASHES)))
    policy = harness.core.admission.policy("tiny-model")
    assert isinstance(policy, KvAware) and policy.index.holds("b") == len(HASHES)
    for _ in range(12):  # b goes silent past the worker timeout; a keeps beating
        harness.send(b"a", events_frame(KvEvents(epoch=1, seq=0, reset=True)))
        harness.advance(0.1)
    assert policy.index.holds("b") == 0
    harness.worker("c", None)
    harness.send(b"c", events_frame(KvEvents(epoch=1, seq=0, reset=True, stored=HASHES)))
    out = submit(harness, "r1")
    assert list(dispatches(out)) == [b"c"]
    harness.step("c", delta("r1", finish="error", code="draining"))
    assert policy.index.holds("c") == 0


def test_a_session_follows_its_rank_even_for_text_prompts():
    harness = kv_cluster()
    first = dispatches(
        harness.send(b"c1", Submit(request_id="t1", spec=RequestSpec(prompt="hello " * 20), session_id="conv"))
    )
    (home,) = first
    harness.step(home.decode(), delta("t1", 5, finish="length"))
    for i in range(3):
        rid = f"t{i + 2}"
        out = harness.send(
            b"c1", Submit(request_id=rid, spec=RequestSpec(prompt="hello " * (30 + i)), session_id="conv")
        )
        assert list(dispatches(out)) == [home]
        harness.step(home.decode(), delta(rid, 5, finish="length"))


def test_a_session_pin_yields_to_an_overloaded_rank():
    harness = kv_cluster()
    (home,) = dispatches(submit(harness, "r1", session="conv"))
    other = b"a" if home == b"b" else b"b"
    busy = Load(num_waiting=0, num_running=1, num_free_blocks=10, num_total_blocks=100, num_queued_tokens=600)
    harness.send(home, StepBatch(deltas=[], load=busy))
    assert list(dispatches(submit(harness, "r2", session="conv"))) == [other]


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin", "prefix-affinity"])
def test_sessions_pin_under_every_policy(policy):
    harness = Harness(policy=policy)
    harness.send(b"a", worker_hello("a", None))
    harness.send(b"b", worker_hello("b", None))
    homes = set()
    for i in range(4):
        (home,) = dispatches(submit(harness, f"r{i}", prompt=[i + 1] * 40, session="conv"))
        homes.add(home)
        harness.step(home.decode(), delta(f"r{i}", 5, finish="length"))
    assert len(homes) == 1
