"""The coordinator's side of direct streams (docs/architecture.md, "Direct streams"), driven by hand: a Dispatch to
a worker with a stream socket, for a client that reads streams, carries the owner and a fresh token and the client
hears a Placement; a dead worker's direct streams are detached (Placement with no address) and resume from the copy
the client sends; a client that sends none has its request fail after the client timeout; after a restart a worker's
direct stream is handed back to its owner only."""

from __future__ import annotations

import msgspec
from core_harness import Harness, client_deltas, worker_hello

from infer.protocol.messages import (
    Abort,
    Delta,
    Dispatch,
    Hello,
    Placement,
    RequestSnapshot,
    RequestSpec,
    Submit,
    TokenIds,
    encode,
)
from infer.protocol.sampling import SamplingParams

ALICE, MALLORY = b"alice", b"mallory"
STREAMS = {"stream_address": "tcp://127.0.0.1:7001"}


def _streaming_cluster(h: Harness, *workers: str) -> None:
    for rank, wid in enumerate(workers):
        h.send(wid.encode(), worker_hello(wid, rank, stream_address=f"tcp://127.0.0.1:{7001 + rank}"))
    for client in (ALICE, MALLORY):
        h.send(client, Hello(role="client", peer_id=client.decode(), streams=True))


def _of(out, identity: bytes, kind: type) -> list:
    return [m for i, m in out if i == identity and isinstance(m, kind)]


def test_a_direct_dispatch_carries_owner_and_token_and_the_client_hears_where():
    h = Harness()
    _streaming_cluster(h, "w0")
    out = h.submit(ALICE, "r1")
    [dispatch] = _of(out, b"w0", Dispatch)
    [placement] = _of(out, ALICE, Placement)
    assert dispatch.stream_owner == "" and len(dispatch.stream_token) == 32
    assert placement.stream_token == dispatch.stream_token and placement.stream_address == "tcp://127.0.0.1:7001"
    out = h.submit(ALICE, "r2")
    assert _of(out, b"w0", Dispatch)[0].stream_token != dispatch.stream_token  # one token per placement
    # its deltas do not pass through the coordinator; its stripped end closes the books
    out = h.step("w0", Delta.final("r1", "length", num_prompt_tokens=3))
    assert _of(out, ALICE, Delta) == [] and h.core.requests.get("r1") is None


def test_relayed_without_streams_or_with_relay_streams():
    h = Harness(relay_streams=True)
    _streaming_cluster(h, "w0")
    out = h.submit(ALICE, "r1")
    assert _of(out, b"w0", Dispatch)[0].stream_token is None and _of(out, ALICE, Placement) == []
    h = Harness()
    h.send(b"w0", worker_hello("w0", 0))  # no stream socket
    h.send(ALICE, Hello(role="client", peer_id="alice", streams=True))
    out = h.submit(ALICE, "r1")
    assert _of(out, b"w0", Dispatch)[0].stream_token is None


def test_a_dead_workers_direct_stream_resumes_from_the_clients_copy():
    h = Harness()
    _streaming_cluster(h, "w0", "w1")
    out = h.submit(ALICE, "r1", max_tokens=10)
    dead = "w0" if _of(out, b"w0", Dispatch) else "w1"
    alive = "w1" if dead == "w0" else "w0"
    h.core.peer_gone(dead.encode(), h.now)
    out = h.out()
    assert _of(out, ALICE, Placement) == [Placement(request_id="r1")]  # detached: send your copy
    assert _of(out, alive.encode(), Dispatch) == []  # nothing is re-dispatched without it
    copy = Submit(
        request_id="r1",
        spec=RequestSpec(prompt_token_ids=TokenIds([1, 2, 3]), sampling=SamplingParams(temperature=0.0, max_tokens=10)),
        reattach=True,
        delivered_token_ids=TokenIds([5, 6]),
        delivered_text_len=6,
    )
    out = h.send(ALICE, copy)
    [dispatch] = _of(out, alive.encode(), Dispatch)
    assert dispatch.resumed_token_ids == [5, 6] and dispatch.resumed_text_len == 6
    [placement] = _of(out, ALICE, Placement)
    assert placement.stream_token == dispatch.stream_token and placement.stream_address is not None
    assert h.core.counters.requests_redispatched == 1


def test_a_detached_stream_whose_client_sends_no_copy_fails_after_the_client_timeout():
    h = Harness(client_timeout=1.0)
    _streaming_cluster(h, "w0")
    h.submit(ALICE, "r1")
    h.core.peer_gone(b"w0", h.now)
    h.out()
    out = []
    for _ in range(8):
        h.send(ALICE, Hello(role="client", peer_id="alice", streams=True))  # alive, but sends no copy
        out += h.advance(0.15)
    [final] = client_deltas(out, ALICE)
    assert final.finish_reason == "error" and final.error_code == "unavailable" and "--client-timeout" in final.error
    assert h.core.requests.get("r1") is None


def test_a_running_direct_streams_copy_moves_it_from_that_copy_and_aborts_it_there():
    """Its worker did not serve the client's subscription (the client says so by sending its copy)."""
    h = Harness()
    _streaming_cluster(h, "w0")
    h.submit(ALICE, "r1")
    copy = Submit(
        request_id="r1",
        spec=RequestSpec(prompt_token_ids=TokenIds([1, 2, 3]), sampling=SamplingParams(temperature=0.0, max_tokens=10)),
        reattach=True,
        delivered_token_ids=TokenIds([4]),
        delivered_text_len=3,
    )
    out = h.send(ALICE, copy)
    assert _of(out, b"w0", Abort) == [Abort(request_ids=["r1"])]
    [dispatch] = _of(out, b"w0", Dispatch)
    assert dispatch.resumed_token_ids == [4]
    assert h.core.counters.requests_redispatched == 0  # no worker failed


def _snapshot(owner: str, token: str) -> RequestSnapshot:
    return RequestSnapshot(
        request_id="r1",
        prompt_token_ids=TokenIds([1, 2, 3]),
        token_ids=TokenIds([7, 8]),
        text="<7><8>",
        delta_ends=[1, 2],
        text_ends=[3, 6],
        stream_owner=owner,
        stream_token=token,
    )


def _restarted_with(owner_key: str, client_key: bytes) -> tuple[Harness, list]:
    """A new coordinator (keys off: the frame key is given by hand) that a worker registers with, running `r1` for
    the owner `owner_key`; the client with `client_key` re-attaches it holding one token."""
    h = Harness()
    token = "c" * 32
    hello = worker_hello("w0", 0, running=["r1"], stream_address="tcp://127.0.0.1:7001")
    hello = msgspec.structs.replace(hello, snapshots=[_snapshot(owner_key, token)])
    h.core.handle(b"w0", [encode(hello)], h.now)
    h.out()
    h.core.handle(ALICE, [encode(Hello(role="client", peer_id="a", streams=True))], h.now, key=client_key)
    h.out()
    copy = Submit(
        request_id="r1",
        spec=RequestSpec(prompt_token_ids=TokenIds([1, 2, 3]), sampling=SamplingParams(temperature=0.0, max_tokens=10)),
        reattach=True,
        delivered_token_ids=TokenIds([7]),
        delivered_text_len=3,
    )
    h.core.handle(ALICE, [encode(copy)], h.now, key=client_key)
    return h, h.out()


def test_after_a_restart_a_direct_stream_is_handed_back_to_its_owner_only_under_its_token():
    owner = "o" * 40
    h, out = _restarted_with(owner, owner.encode())
    [placement] = _of(out, ALICE, Placement)
    assert placement.stream_token == "c" * 32 and placement.stream_address == "tcp://127.0.0.1:7001"
    assert _of(out, ALICE, Delta) == [] and _of(out, b"w0", Abort) == []  # nothing relayed, nothing aborted
    assert h.core.counters.requests_reattached == 1


def test_after_a_restart_another_key_gets_no_placement_of_the_stream():
    """It runs the request anew from its own copy, under a new token; the owner's stream there is aborted."""
    _, out = _restarted_with("o" * 40, b"m" * 40)
    assert all(p.stream_token != "c" * 32 for p in _of(out, ALICE, Placement))
    assert _of(out, b"w0", Abort) == [Abort(request_ids=["r1"])]
