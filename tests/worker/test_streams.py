"""worker/service/streams.py, the worker's direct streams without I/O: who may subscribe (token, and with keys the owner's
key), what a subscriber is sent (the very deltas its copy lacks, each with where it starts), and the timers (early
Subscribes, ended streams nobody fetched, heartbeats)."""

from __future__ import annotations

import pytest

from infer.protocol.codes import ErrorCode
from infer.protocol.messages import Delta, Error, Heartbeat, StreamBatch, Subscribe, TokenIds
from infer.worker.service.streams import MAX_EARLY_SUBSCRIPTIONS, DirectStream, StreamTable

TOKEN = "a" * 32
OTHER_TOKEN = "b" * 32
OWNER = "o" * 40
STRANGER = "s" * 40
ALICE, MALLORY = b"alice", b"mallory"


def _table() -> StreamTable:
    return StreamTable(linger=60.0, wait=5.0, heartbeat_interval=1.0)


def _delta(tokens: list[int], text: str, **fields) -> Delta:
    return Delta(request_id="r", token_ids=TokenIds(tokens), text=text, **fields)


def _batches(table: StreamTable, peer: bytes) -> list[tuple[Delta, int, int]]:
    """The (delta, token start, text start) sent to `peer` now."""
    out = []
    for to, msg in table.take():
        if to == peer and isinstance(msg, StreamBatch):
            out.extend(zip(msg.deltas, msg.token_starts, msg.text_starts))
    return out


def _errors(table: StreamTable, peer: bytes) -> list[Error]:
    return [msg for to, msg in table.take() if to == peer and isinstance(msg, Error)]


def _run(table: StreamTable, owner: str = "", num_resumed: int = 0, text_base: int = 0) -> None:
    """A stream of three deltas: 'He' (first: prompt ids, seed), 'll', 'o' (two tokens)."""
    table.open("r", DirectStream(owner, TOKEN, num_resumed, text_base), now=0.0)
    n, t = num_resumed, 0
    for tokens, text, fields in [
        ([7], "He", {"prompt_token_ids": TokenIds([1, 2]), "seed": 42}),
        ([8], "ll", {}),
        ([9, 10], "o", {}),
    ]:
        table.push(_delta(tokens, text, **fields), n, t, now=0.1)
        n, t = n + len(tokens), t + len(text)


def _subscribe(table, peer=ALICE, user="", token=TOKEN, num_tokens=0, text_len=0, now=0.2):
    table.subscribe(
        peer, user, Subscribe(request_id="r", stream_token=token, num_tokens=num_tokens, text_len=text_len), now
    )


def test_a_late_subscriber_gets_the_very_deltas_it_lacks_first_fields_included():
    table = _table()
    _run(table)
    assert table.take() == []  # no reader yet: nothing goes out
    _subscribe(table)
    sent = _batches(table, ALICE)
    assert [(d.text, n, t) for d, n, t in sent] == [("He", 0, 0), ("ll", 1, 2), ("o", 2, 4)]
    assert sent[0][0].prompt_token_ids == [1, 2] and sent[0][0].seed == 42


def test_a_subscriber_from_a_boundary_gets_the_rest_and_then_every_live_delta():
    table = _table()
    _run(table)
    _subscribe(table, num_tokens=2, text_len=4)
    assert [(d.text, n, t) for d, n, t in _batches(table, ALICE)] == [("o", 2, 4)]
    table.push(_delta([11], "!"), 4, 5, now=0.3)
    assert [(d.text, n, t) for d, n, t in _batches(table, ALICE)] == [("!", 4, 5)]


def test_a_copy_that_stops_inside_a_delta_is_refused_as_unavailable_naming_its_token():
    table = _table()
    _run(table)
    _subscribe(table, num_tokens=3, text_len=4)  # inside the last delta (two tokens)
    [error] = _errors(table, ALICE)
    assert error.code == ErrorCode.UNAVAILABLE and error.request_id == "r" and error.stream_token == TOKEN


def test_resumed_streams_count_from_the_clients_copy():
    """A re-dispatch resumed from 5 tokens whose text is 12 characters: the starts include them."""
    table = _table()
    _run(table, num_resumed=5, text_base=12)
    _subscribe(table, num_tokens=5, text_len=12)
    assert [(n, t) for _, n, t in _batches(table, ALICE)] == [(5, 12), (6, 14), (7, 16)]
    _subscribe(table, peer=b"again", num_tokens=9, text_len=17)  # all of it: attached, nothing to send
    assert _batches(table, b"again") == []


def test_a_subscribe_before_its_dispatch_waits_and_is_served_when_it_opens():
    table = _table()
    _subscribe(table, now=0.0)
    assert table.take() == []
    _run(table)
    assert [d.text for d, _, _ in _batches(table, ALICE)] == ["He", "ll", "o"]


def test_a_subscribe_for_a_stream_that_never_comes_is_answered_unavailable_after_the_wait():
    table = _table()
    _subscribe(table, now=0.0)
    table.tick(4.9)
    assert _errors(table, ALICE) == []
    table.tick(5.1)
    [error] = _errors(table, ALICE)
    assert error.code == ErrorCode.UNAVAILABLE and error.stream_token == TOKEN


@pytest.mark.parametrize(
    "owner, user, token",
    [("", "", OTHER_TOKEN), (OWNER, OWNER, OTHER_TOKEN), (OWNER, STRANGER, TOKEN), (OWNER, "", TOKEN)],
    ids=["wrong token", "owner's key, wrong token", "right token, another key", "right token, no key"],
)
def test_a_subscriber_without_the_token_and_the_owners_key_gets_nothing_and_is_refused(owner, user, token):
    table = _table()
    _run(table, owner=owner)
    _subscribe(table, peer=MALLORY, user=user, token=token)
    assert _batches(table, MALLORY) == []
    table.tick(5.3)  # (it waited: a Dispatch with a new token may have been on its way)
    [error] = _errors(table, MALLORY)
    assert error.code == ErrorCode.INVALID_REQUEST and "no such stream" in error.message
    assert table.refused == 1
    table.push(_delta([12], "?"), 4, 5, now=5.4)  # the stream goes on: still nothing for that peer
    assert _batches(table, MALLORY) == []
    _subscribe(table, user=owner, now=5.5)  # its owner is served
    assert [d.text for d, _, _ in _batches(table, ALICE)] == ["He", "ll", "o", "?"]


def test_a_parked_subscribe_is_served_when_a_new_dispatch_brings_its_token():
    """A re-dispatch to the same worker: the client's Subscribe with the new token may come before it."""
    table = _table()
    table.open("r", DirectStream("", OTHER_TOKEN), now=0.0)  # the old placement, not aborted yet
    _subscribe(table, now=0.1)
    assert table.take() == []
    table.remove("r")
    _run(table)
    assert [d.text for d, _, _ in _batches(table, ALICE)] == ["He", "ll", "o"]


def test_early_subscribes_are_bounded():
    table = _table()
    for i in range(MAX_EARLY_SUBSCRIPTIONS):
        table.subscribe(ALICE, "", Subscribe(request_id=f"r{i}", stream_token=TOKEN), 0.0)
    _subscribe(table, peer=MALLORY)
    [error] = _errors(table, MALLORY)
    assert error.code == ErrorCode.OVERLOADED


def test_an_ended_stream_waits_for_its_reader_until_the_linger_then_is_gone():
    table = _table()
    _run(table)
    table.push(Delta.final("r", "length"), 4, 5, now=1.0)
    _subscribe(table, num_tokens=4, text_len=5, now=2.0)
    [(final, n, t)] = _batches(table, ALICE)
    assert final.finished and (n, t) == (4, 5)
    assert "r" not in table  # fetched: forgotten
    _run(table)
    table.push(Delta.final("r", "length"), 4, 5, now=1.0)
    table.tick(60.9)
    assert "r" in table
    table.tick(61.1)
    assert "r" not in table


def test_a_final_delta_to_a_reader_ends_the_stream_and_a_failed_send_detaches_its_reader():
    table = _table()
    _run(table)
    _subscribe(table, num_tokens=4, text_len=5)
    table.take()
    table.drop_peer(ALICE)
    table.push(_delta([11], "!"), 4, 5, now=0.3)
    assert _batches(table, ALICE) == []  # detached: the client subscribes again from its copy
    _subscribe(table, num_tokens=4, text_len=5)
    table.push(Delta.final("r", "stop"), 5, 6, now=0.4)
    assert [(d.text, d.finished) for d, _, _ in _batches(table, ALICE)] == [("!", False), ("", True)]
    assert "r" not in table


def test_readers_of_running_streams_get_a_heartbeat_each_interval():
    table = _table()
    _run(table)
    _subscribe(table)
    table.take()
    table.tick(1.0)
    assert [type(m) for p, m in table.take() if p == ALICE] == [Heartbeat]
    table.tick(1.5)
    assert table.take() == []
    table.tick(2.0)
    assert [type(m) for p, m in table.take() if p == ALICE] == [Heartbeat]


def test_a_subscriber_that_waits_for_its_dispatch_hears_the_beats_then_its_stream():
    """A Subscribe that came before its Dispatch (the worker busy in a long step): its peer gets the heartbeats, so
    that its client does not take the step for a lost worker, and the stream once the Dispatch opens it."""
    table = _table()
    _subscribe(table, now=0.0)
    table.beat(1.0)  # the shell's heartbeat thread, during the step
    assert [type(m) for p, m in table.take() if p == ALICE] == [Heartbeat]
    _run(table)  # the Dispatch, read after the step
    assert [d.text for d, _, _ in _batches(table, ALICE)] == ["He", "ll", "o"]
