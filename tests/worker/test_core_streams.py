"""WorkerCore with direct streams (BenchmarkEngine, no I/O): a Dispatch with a stream owner and token sends its
deltas to the subscriber only, the coordinator gets its end stripped of tokens and text; a text prompt's first
delta (prompt ids, seed) reaches a late subscriber; a re-registration's snapshot carries the owner and token; junk
on the stream socket is answered with an Error and changes nothing."""

from __future__ import annotations

import msgspec
from worker_harness import WorkerHarness, deltas, dispatch, heartbeats, of_type

from infer.protocol.messages import Error, Heartbeat, Hello, StepBatch, StreamBatch, Subscribe, encode

TOKEN = "k" * 32
PEER = b"client-1"


def _direct_harness() -> WorkerHarness:
    h = WorkerHarness()
    h.core.stream_address = "tcp://127.0.0.1:7001"
    h.welcome()
    return h


def _stream_out(h: WorkerHarness) -> list[tuple[bytes, object]]:
    return list(h.core.take_stream_outgoing())


def _direct(rid: str, **fields):
    return msgspec.structs.replace(dispatch(rid, **fields), stream_owner="", stream_token=TOKEN)


def test_a_direct_streams_deltas_go_to_its_subscriber_and_the_coordinator_gets_only_its_end():
    h = _direct_harness()
    h.send(_direct("r", max_tokens=3))
    h.core.on_stream_frame(PEER, "", [encode(Subscribe(request_id="r", stream_token=TOKEN))], h.now)
    to_coordinator = []
    for _ in range(5):
        to_coordinator += h.step()
    sent = [(p, m) for p, m in _stream_out(h) if isinstance(m, StreamBatch)]
    assert {p for p, _ in sent} == {PEER}
    got = [(d.token_ids, n) for _, m in sent for d, n in zip(m.deltas, m.token_starts)]
    assert [t for ids, _ in got for t in ids] == [3, 4, 5]  # benchmark: token i of a 3-token prompt is 3 + i
    assert [n for _, n in got] == [0, 1, 2, 3][: len(got)]
    [end] = deltas(to_coordinator)
    assert end.finished and end.token_ids == [] and end.text == "" and end.num_output_tokens == 3


def test_a_step_of_direct_deltas_only_still_tells_the_coordinator_its_load():
    """The coordinator routes on each worker's load: an admission is reported by the step that made it (an end
    comes with its delta), the steps in between by the heartbeats (a relayed stream's deltas carried it every
    step)."""
    h = _direct_harness()
    h.send(_direct("r", max_tokens=50))
    [first] = of_type(h.step(), StepBatch)
    assert first.deltas == [] and first.load.num_running == 1
    assert of_type(h.step(), StepBatch) == []  # the same counts
    h.step()
    [beat] = heartbeats(h.advance(h.core.options.heartbeat_interval))
    assert beat.load.num_running == 1 and beat.load.num_queued_tokens < first.load.num_queued_tokens


def test_a_late_subscriber_of_a_text_prompt_gets_its_first_delta_with_the_prompt_ids():
    h = _direct_harness()
    h.send(_direct("r", prompt="hello there", max_tokens=4))
    h.step()
    h.step()  # two deltas before anyone subscribed
    h.core.on_stream_frame(PEER, "", [encode(Subscribe(request_id="r", stream_token=TOKEN))], h.now)
    [(_, batch)] = [(p, m) for p, m in _stream_out(h) if isinstance(m, StreamBatch)]
    assert batch.deltas[0].prompt_token_ids is not None and batch.token_starts[0] == 0
    assert len(batch.deltas) == 2


def test_a_reregistration_snapshot_carries_the_streams_owner_and_token():
    h = _direct_harness()
    h.send(_direct("r", max_tokens=10))
    h.step()
    out = h.send(Heartbeat(sent_at=0.0, instance="coord-2"))  # a new coordinator process: it registers again
    [hello] = of_type(out, Hello)
    [snapshot] = hello.snapshots
    assert (snapshot.stream_owner, snapshot.stream_token) == ("", TOKEN)
    assert hello.stream_address == "tcp://127.0.0.1:7001"


def test_junk_on_the_stream_socket_is_answered_and_changes_nothing():
    h = _direct_harness()
    h.send(_direct("r", max_tokens=3))
    for frames in ([b"\xc1junk"], [b"a", b"b"], [encode(Hello(role="client", peer_id="x"))]):
        h.core.on_stream_frame(PEER, "", frames, h.now)
    errors = [m for p, m in _stream_out(h) if isinstance(m, Error)]
    assert len(errors) == 3 and all(e.request_id is None for e in errors)
    h.core.on_stream_frame(PEER, "", [encode(Subscribe(request_id="r", stream_token=TOKEN))], h.now)
    h.run_until_finished()
    tokens = [t for _, m in _stream_out(h) if isinstance(m, StreamBatch) for d in m.deltas for t in d.token_ids]
    assert tokens == [3, 4, 5]
