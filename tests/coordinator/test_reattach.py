"""A restarted coordinator taking back what was in flight, driven frame by frame (see core_harness.py).

Workers register with RequestSnapshots of what they run; clients re-attach with the tokens they hold. The
coordinator hands each stream back from the worker's copy (sending only what the client lacks), waits
restart_grace for a worker that has not registered yet, resumes from the client's tokens when no copy
fits, and aborts copies no client claims.
"""

from __future__ import annotations

import msgspec
from core_harness import Harness, delta, worker_hello

from infer.protocol.messages import (
    Abort,
    DeltaBatch,
    Dispatch,
    Error,
    Heartbeat,
    RequestSnapshot,
    RequestSpec,
    Submit,
    TokenIds,
)
from infer.protocol.sampling import SamplingParams

CLIENT = b"client-1"
PROMPT = [1, 2, 3]


def _snapshot(rid: str, tokens: list[int], ends: list[int]) -> RequestSnapshot:
    """A worker's copy whose deltas ended at `ends`; token t has text "<t>"."""
    text_ends = [sum(len(f"<{t}>") for t in tokens[:e]) for e in ends]
    return RequestSnapshot(
        request_id=rid,
        prompt_token_ids=TokenIds(PROMPT),
        token_ids=TokenIds(tokens),
        text="".join(f"<{t}>" for t in tokens),
        delta_ends=ends,
        text_ends=text_ends,
    )


def _reattach(h: Harness, rid: str, held: list[int], **extra):
    return h.send(
        CLIENT,
        Submit(
            request_id=rid,
            spec=RequestSpec(
                prompt_token_ids=TokenIds(PROMPT), sampling=SamplingParams(temperature=0.0, max_tokens=10)
            ),
            reattach=True,
            delivered_token_ids=TokenIds(held),
            **extra,
        ),
    )


def _client_deltas(out):
    return [d for identity, m in out if identity == CLIENT and isinstance(m, DeltaBatch) for d in m.deltas]


def _to(out, identity, kind):
    return [m for i, m in out if i == identity and isinstance(m, kind)]


def test_a_client_takes_back_its_request_from_the_worker_that_runs_it():
    h = Harness(restart_grace=2.0)
    h.send(b"w0", worker_hello("w0", 0, running=["r"], snapshots=[_snapshot("r", [7, 8, 9, 10], [1, 2, 4])]))
    assert h.core.orphans.get("r") is not None
    h.step("w0", delta("r", 11))  # it goes on meanwhile: kept for the client
    out = _reattach(h, "r", [7, 8])  # the client got two deltas before the crash
    (catch_up,) = _client_deltas(out)
    assert list(catch_up.token_ids) == [9, 10, 11] and catch_up.text == "<9><10><11>"
    assert not _to(out, b"w0", Dispatch) and not _to(out, b"w0", Abort)  # no recompute
    (rest,) = _client_deltas(h.step("w0", delta("r", 12, finish="length")))
    assert list(rest.token_ids) == [12] and rest.finish_reason == "length"
    stats = h.core.stats(h.now)
    assert stats.requests_reattached == 1 and stats.requests_redispatched == 0 and stats.num_in_flight == 0


def test_a_handed_back_stream_carries_the_weight_version_of_the_workers_latest_delta():
    h = Harness(restart_grace=2.0)
    h.send(b"w0", worker_hello("w0", 0, running=["r"], snapshots=[_snapshot("r", [7, 8], [1, 2])]))
    h.step("w0", msgspec.structs.replace(delta("r", 9), weight_version=2))
    (catch_up,) = _client_deltas(_reattach(h, "r", [7]))
    assert list(catch_up.token_ids) == [8, 9] and catch_up.weight_version == 2 and not catch_up.finished
    h.send(b"w1", worker_hello("w1", 1, running=["s"], snapshots=[_snapshot("s", [7], [1])]))
    h.step("w1", msgspec.structs.replace(delta("s", 8, finish="stop"), weight_version=4, num_cached_tokens=16))
    (final,) = _client_deltas(_reattach(h, "s", [7]))  # it ended while nobody listened
    assert final.finish_reason == "stop" and final.weight_version == 4 and final.num_cached_tokens == 16


def test_a_request_that_finished_while_nobody_listened_is_handed_over_finished():
    h = Harness()
    h.send(b"w0", worker_hello("w0", 0, running=["r"], snapshots=[_snapshot("r", [7], [1])]))
    h.step("w0", delta("r", 8, finish="length"))
    (final,) = _client_deltas(_reattach(h, "r", [7]))
    assert list(final.token_ids) == [8] and final.finish_reason == "length"
    assert h.core.requests.get("r") is None


def test_a_client_first_waits_for_its_worker_to_register():
    h = Harness(restart_grace=2.0)
    h.worker("w1", 1)
    assert not _client_deltas(_reattach(h, "r", [7])) and h.core.requests.get("r").worker_id is None
    out = h.send(b"w0", worker_hello("w0", 0, running=["r"], snapshots=[_snapshot("r", [7, 8], [1, 2])]))
    assert [list(d.token_ids) for d in _client_deltas(out)] == [[8]]
    assert h.core.requests.get("r").worker_id == "w0" and not _to(out, b"w1", Dispatch)


def test_without_a_worker_copy_the_request_resumes_from_the_clients_tokens():
    h = Harness(restart_grace=0.5)
    h.worker("w0", 0)
    assert not _reattach(h, "r", [7, 8])
    out = h.advance(0.6)  # grace over: nobody runs it
    (dispatch,) = _to(out, b"w0", Dispatch)
    assert list(dispatch.resumed_token_ids) == [7, 8] and dispatch.spec.sampling.max_tokens == 10


def test_a_copy_that_does_not_fit_the_clients_is_aborted_and_the_request_resumed():
    h = Harness(restart_grace=0.0)
    h.send(b"w0", worker_hello("w0", 0, running=["r"], snapshots=[_snapshot("r", [7, 8, 9], [3])]))
    out = _reattach(h, "r", [7])  # the client's copy stops inside the worker's only delta
    assert _to(out, b"w0", Abort)[0].request_ids == ["r"]
    (dispatch,) = _to(out, b"w0", Dispatch)
    assert list(dispatch.resumed_token_ids) == [7]


def test_a_resume_from_the_clients_copy_keeps_its_seed_and_the_length_of_its_text():
    h = Harness(restart_grace=0.0)
    h.worker("w0", 0)
    out = h.send(
        CLIENT,
        Submit(
            request_id="r",
            spec=RequestSpec(
                prompt_token_ids=TokenIds(PROMPT), sampling=SamplingParams(temperature=1.0, max_tokens=10, seed=42)
            ),
            reattach=True,
            delivered_token_ids=TokenIds([7, 8]),
            delivered_text_len=3,
        ),
    )
    (dispatch,) = _to(out, b"w0", Dispatch)
    assert list(dispatch.resumed_token_ids) == [7, 8] and dispatch.resumed_text_len == 3
    assert dispatch.spec.sampling.seed == 42


def test_a_taken_back_copy_keeps_the_seed_it_runs_with_and_reports_it_first():
    """The client had no delta (so no seed) before the restart: the worker's copy tells the seed."""
    h = Harness(restart_grace=2.0)
    snapshot = msgspec.structs.replace(_snapshot("r", [7, 8], [1, 2]), seed=99)
    h.send(b"w0", worker_hello("w0", 0, running=["r"], snapshots=[snapshot]))
    out = h.send(
        CLIENT,
        Submit(
            request_id="r",
            spec=RequestSpec(
                prompt_token_ids=TokenIds(PROMPT), sampling=SamplingParams(temperature=1.0, max_tokens=10)
            ),
            reattach=True,
        ),
    )
    (catch_up,) = _client_deltas(out)
    assert catch_up.seed == 99 and list(catch_up.token_ids) == [7, 8] and catch_up.text == "<7><8>"
    h.core.peer_gone(b"w0", h.now)
    (dispatch,) = _to(h.worker("w1", 1), b"w1", Dispatch)
    assert dispatch.spec.sampling.seed == 99 and dispatch.resumed_text_len == len("<7><8>")


def test_copies_no_client_claims_are_aborted_after_the_client_timeout():
    h = Harness(restart_grace=0.2, client_timeout=1.0)
    h.send(b"w0", worker_hello("w0", 0, running=["r"], snapshots=[_snapshot("r", [7], [1])]))
    out = []
    for _ in range(14):
        h.send(b"w0", Heartbeat(sent_at=0.0))
        out += h.advance(0.1)
    assert ["r"] in [m.request_ids for m in _to(out, b"w0", Abort)] and h.core.orphans.get("r") is None


def test_a_request_already_here_is_not_attached_twice_and_others_ids_are_refused():
    h = Harness()
    h.worker("w0", 0)
    h.submit(CLIENT, "r")
    assert not _reattach(h, "r", [])  # the queued Submit got here first: nothing to do
    (err,) = _to(
        h.send(b"other", Submit(request_id="r", spec=RequestSpec(prompt_token_ids=TokenIds(PROMPT)), reattach=True)),
        b"other",
        Error,
    )
    assert "already in flight" in err.message


def test_a_hello_that_crossed_a_dispatch_does_not_move_it():
    """A partition queues Hellos at the worker; they arrive after the coordinator has dispatched to it again.
    A Hello counts the Dispatches its worker had seen, so a late one loses nothing; a new process does."""
    h = Harness()
    h.send(b"w0", worker_hello("w0", 0, incarnation="p1", dispatches_seen=0))
    h.submit(CLIENT, "r")
    request = h.core.requests.get("r")
    assert request.worker_id == "w0" and request.dispatch_seq == 1
    h.send(b"w0", worker_hello("w0", 0, incarnation="p1", dispatches_seen=0))  # sent before the Dispatch
    assert request.worker_id == "w0" and request.retries == 0
    h.send(b"w0", worker_hello("w0", 0, incarnation="p1", dispatches_seen=1))  # saw it, and lost it
    assert request.retries == 1
    h.send(b"w0", worker_hello("w0", 0, incarnation="p2", dispatches_seen=0))  # a new process
    assert request.retries == 2


def test_the_relay_counts_the_text_it_relays_after_the_clients_copy_and_keeps_an_unknown_length_unknown():
    """A re-attached request resumed from the client's copy, relayed a delta, then its worker dies: the next
    Dispatch resumes from every token relayed, with the text length the client gave plus the relayed text's,
    or, when the client gave none, with the length still unknown (None: the worker counts the whole text as
    delivered). The relay keeps the length only, never the text."""
    for given, expected in ((3, 3 + len("<9>")), (None, None)):
        h = Harness(restart_grace=0.0)
        h.worker("w0", 0)
        extra = {} if given is None else {"delivered_text_len": given}
        (dispatch,) = _to(_reattach(h, "r", [7, 8], **extra), b"w0", Dispatch)
        assert dispatch.resumed_text_len == given
        (relayed,) = _client_deltas(h.step("w0", delta("r", 9)))
        assert relayed.text == "<9>"
        journal = h.core.requests.get("r").journal
        assert journal.token_ids == [7, 8, 9] and journal.text_len == expected and not journal.keeps_text
        h.core.peer_gone(b"w0", h.now)
        (dispatch,) = _to(h.worker("w1", 1), b"w1", Dispatch)
        assert list(dispatch.resumed_token_ids) == [7, 8, 9] and dispatch.resumed_text_len == expected
