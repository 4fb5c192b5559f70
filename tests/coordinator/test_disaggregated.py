"""Disaggregated prefill and decode in the coordinator, frame by frame: a new request goes to a kv_producer with the
kv_consumer named, the producer's hand-off (its abort delta, ErrorCode.KV_HANDOFF) continues it on that consumer from
the tokens delivered (not counted as a retry), and a missing role leaves the work to the others; a draining worker with
a KV port gets a target per request (DrainMoves / MoveTargets) and its hand-off continues there, never within its own
EP group or another group with a draining rank; a group with a draining rank gets no new request on any rank; a
group mate's death leaves a draining rank's requests to it, and every mate's when the dead rank itself drained."""

from __future__ import annotations

from core_harness import Harness, client_deltas, delta, dispatches, worker_hello

CONSUMER_ADDRESS = "tcp://127.0.0.1:6001"


def cluster(*roles: str) -> Harness:
    """One worker per role, at ranks 0, 1, ...: p (kv_producer), c (kv_consumer), b (kv_both)."""
    h = Harness()
    for rank, role in enumerate(roles):
        address = CONSUMER_ADDRESS if role == "kv_consumer" else None
        wid = {"kv_producer": "p", "kv_consumer": "c", "kv_both": "b"}[role] + str(rank)
        h.send(wid.encode(), worker_hello(wid, rank, kv_role=role, kv_address=address))
    return h


def test_a_request_prefills_on_the_producer_and_continues_on_its_consumer():
    h = cluster("kv_producer", "kv_consumer")
    out = h.submit(b"cl", "r", [1, 2, 3, 4])
    (first,) = dispatches(out)[b"p0"]
    assert (first.kv_consumer_address, first.kv_consumer_key) == (CONSUMER_ADDRESS, "")
    assert [d.token_ids for d in client_deltas(h.step("p0", delta("r", 9)), b"cl")] == [[9]]
    out = h.step("p0", delta("r", finish="abort", code="kv_handoff", error="KV transfer: stored 1 of 1 blocks"))
    (moved,) = dispatches(out)[b"c1"]
    assert moved.resumed_token_ids == [9] and moved.kv_consumer_address is None
    assert not client_deltas(out, b"cl")  # the client sees no end: its stream goes on
    out = h.step("c1", delta("r", 5, 6, finish="length"))
    assert [d.token_ids for d in client_deltas(out, b"cl")] == [[5, 6]]
    assert h.core.books.counters.requests_redispatched == 0


def test_a_pinned_request_leaves_its_producer_and_a_kv_both_worker_takes_new_work_too():
    h = cluster("kv_producer", "kv_consumer", "kv_both")
    h.submit(b"cl", "r", [1, 2, 3], pin_rank=0)
    out = h.step("p0", delta("r", 9, finish="abort", code="kv_handoff"))
    assert list(dispatches(out)) == [b"c1"]  # the pin was the prefill's
    out = h.submit(b"cl", "s", [4, 5, 6], pin_rank=2)
    (plain,) = dispatches(out)[b"b2"]
    assert plain.kv_consumer_address is None


def test_without_a_consumer_the_producer_runs_the_whole_request_and_without_producers_the_consumer_does():
    h = cluster("kv_producer", "kv_consumer")
    h.core.books.workers.by_id["c1"].healthy = False  # declared dead
    h.core.admission.routes_changed()
    (alone,) = dispatches(h.submit(b"cl", "r", [1, 2]))[b"p0"]
    assert alone.kv_consumer_address is None

    h = cluster("kv_consumer")
    assert list(dispatches(h.submit(b"cl", "r", [1, 2]))) == [b"c0"]


def test_a_consumer_that_dies_after_the_hand_off_moves_its_request_to_the_producer():
    h = cluster("kv_producer", "kv_consumer")
    h.submit(b"cl", "r", [1, 2, 3])
    h.step("p0", delta("r", 9, finish="abort", code="kv_handoff"))
    h.step("c1", delta("r", 4))
    out = h.advance(0.6)
    out += h.step("p0")  # the producer stays alive; the consumer is silent past --worker-timeout
    out += h.advance(0.6)
    (moved,) = dispatches(out)[b"p0"]
    assert moved.resumed_token_ids == [9, 4] and moved.kv_consumer_address is None


def test_a_draining_worker_with_a_kv_port_moves_its_requests_to_another_and_they_continue_there():
    from infer.protocol.messages import DrainMoves, MoveTargets

    h = Harness()
    for rank, wid in enumerate(("b0", "b1", "b2")):
        address = None if wid == "b2" else f"tcp://127.0.0.1:600{rank}"  # b2: no KV port
        h.send(wid.encode(), worker_hello(wid, rank, kv_role="kv_both", kv_address=address))
    h.core.admission.routes_changed()
    h.submit(b"cl", "r", [1, 2, 3], pin_rank=0)
    h.step("b0", delta("r", 9))
    out = h.send(b"b0", DrainMoves(request_ids=["r", "gone"]))
    (answer,) = [m for who, m in out if who == b"b0" and isinstance(m, MoveTargets)]
    assert [(m.request_id, m.kv_address) for m in answer.moves] == [("r", "tcp://127.0.0.1:6001")]
    assert h.core.books.workers.by_id["b0"].draining  # nothing new goes to it
    out = h.step("b0", delta("r", 4, finish="abort", code="kv_handoff", error="KV transfer: stored 1 of 1 blocks"))
    (moved,) = dispatches(out)[b"b1"]
    assert moved.resumed_token_ids == [9, 4]
    assert h.core.books.counters.requests_redispatched == 0
    for rid in ("s", "t", "u"):
        assert list(dispatches(h.submit(b"cl", rid, [5, 6]))) in ([b"b1"], [b"b2"])


# ---- a drain in EP groups: an EP group's ranks step together, so a group with a draining rank goes away with it --


def ep_groups(*groups: str) -> Harness:
    """One kv_both worker with a KV port per letter of `groups`, at ranks 0, 1, ...: the workers of one letter form an
    EP group of that name, a letter given once is a plain (dense) worker. Each is named by its letter and rank."""
    h = Harness()
    for rank, letter in enumerate(groups):
        group = f"ep-{letter}" if groups.count(letter) > 1 else None
        hello = worker_hello(
            f"{letter}{rank}", rank, group=group, kv_role="kv_both", kv_address=f"tcp://127.0.0.1:{6000 + rank}"
        )
        h.send(f"{letter}{rank}".encode(), hello)
    return h


def move_targets(h: Harness, wid: str, *rids: str) -> list[tuple[str, str]]:
    """Worker `wid` drains and asks where `rids` go: the (request id, KV address) pairs of its MoveTargets."""
    from infer.protocol.messages import DrainMoves, MoveTargets

    out = h.send(wid.encode(), DrainMoves(request_ids=list(rids)))
    (answer,) = [m for who, m in out if who == wid.encode() and isinstance(m, MoveTargets)]
    return [(m.request_id, m.kv_address) for m in answer.moves]


def test_a_draining_ep_rank_moves_its_requests_out_of_its_group_and_of_every_group_with_a_draining_rank():
    """e0 drains: e1 (its group's other rank, idle, the lower rank) is no target, nor f2 while f3 drains; the dense
    d4 is. With only its own group's ranks left the request gets no target (it stays, as in any drain)."""
    h = ep_groups("e", "e", "f", "f", "d")
    for rid in ("r", "s"):
        h.submit(b"cl", rid, [1, 2, 3], pin_rank=0)
    assert move_targets(h, "f3") == []  # f3 drains with nothing running: f's group is going away too
    assert move_targets(h, "e0", "r", "s") == [("r", "tcp://127.0.0.1:6004"), ("s", "tcp://127.0.0.1:6004")]

    alone = ep_groups("e", "e")
    alone.submit(b"cl", "r", [1, 2, 3], pin_rank=0)
    assert move_targets(alone, "e0", "r") == []


def test_a_dead_ep_rank_leaves_a_draining_mates_requests_to_it_until_that_mate_dies_too():
    """e1 drains (its request moving to d2) when e0's connection goes: e0's request moves at once, e1 gets no Abort and
    hands its own over with its KV (not a retry). Had e1 died as well, its death would have moved it."""
    h = ep_groups("e", "e", "d")
    h.submit(b"cl", "a", [1, 2, 3], pin_rank=0)
    h.submit(b"cl", "b", [4, 5, 6], pin_rank=1)
    h.step("e1", delta("b", 9))
    assert move_targets(h, "e1", "b") == [("b", "tcp://127.0.0.1:6002")]
    h.core.peer_gone(b"e0", h.now)
    out = h.out()
    assert not [m for who, m in out if who == b"e1"]  # no Abort: b is e1's to hand over
    assert [d.request_id for d in dispatches(out)[b"d2"]] == ["a"]
    assert h.core.books.requests.get("b").worker_id == "e1"
    out = h.step("e1", delta("b", 4, finish="abort", code="kv_handoff", error="KV transfer: stored 1 of 1 blocks"))
    (moved,) = dispatches(out)[b"d2"]
    assert moved.request_id == "b" and moved.resumed_token_ids == [9, 4]
    assert h.core.books.counters.requests_redispatched == 1  # a's failover; b's hand-off is no retry

    h = ep_groups("e", "e", "d")
    h.submit(b"cl", "b", [4, 5, 6], pin_rank=1)
    move_targets(h, "e1", "b")
    h.core.peer_gone(b"e0", h.now)
    assert not dispatches(h.out())
    h.core.peer_gone(b"e1", h.now)  # the draining rank itself died: its request moves, as any dead worker's
    (moved,) = dispatches(h.out())[b"d2"]
    assert moved.request_id == "b" and h.core.books.counters.requests_redispatched == 1


def test_one_draining_rank_takes_its_whole_group_out_of_routing():
    """e0 drains with nothing running (its empty DrainMoves says so): e1, not yet heard to drain, gets no new request
    either (the group drains as a whole: worker/service/core.py `group_drains`); every new request goes to d2."""
    h = ep_groups("e", "e", "d")
    assert move_targets(h, "e0") == []
    assert not h.core.books.workers.by_id["e1"].draining
    for rid in ("r", "s", "t", "u"):
        assert list(dispatches(h.submit(b"cl", rid, [1, 2, 3]))) == [b"d2"]


def test_a_drained_rank_leaving_leaves_every_mates_requests_to_it():
    """e0 drained and left before the coordinator heard e1 drain (e1 heard it in the group's rounds and asks its
    moves itself): e1's request stays e1's, no Abort, no retry; it then moves with its KV."""
    h = ep_groups("e", "e", "d")
    h.submit(b"cl", "b", [4, 5, 6], pin_rank=1)
    h.step("e1", delta("b", 9))
    assert move_targets(h, "e0") == []
    h.core.peer_gone(b"e0", h.now)
    assert not [m for who, m in h.out() if who == b"e1"]
    assert h.core.books.requests.get("b").worker_id == "e1"
    assert move_targets(h, "e1", "b") == [("b", "tcp://127.0.0.1:6002")]
    out = h.step("e1", delta("b", 4, finish="abort", code="kv_handoff", error="KV transfer: stored 1 of 1 blocks"))
    (moved,) = dispatches(out)[b"d2"]
    assert moved.resumed_token_ids == [9, 4] and h.core.books.counters.requests_redispatched == 0
