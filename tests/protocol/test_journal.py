"""StreamJournal (protocol/journal.py): the one record of what a stream's deltas carried, kept by the worker, the
coordinator's orphans and the client: record, snapshot at every delta boundary, catch-up from a copy."""

from __future__ import annotations

import pytest

from infer.protocol.journal import StreamJournal
from infer.protocol.messages import RequestSnapshot, TokenIds, decode, encode

PROMPT = TokenIds([1, 2])
# A stream after two resumed tokens: a token whose character is not complete yet (no text), one that completes
# it, an empty delta, two tokens at once, one more.
RESUMED = [40, 41]
DELTAS = [([5], ""), ([6], "é"), ([], ""), ([7, 8], "cd"), ([9], "e")]


def _journal(deltas=DELTAS, resumed=RESUMED) -> StreamJournal:
    journal = StreamJournal(resumed)
    for tokens, text in deltas:
        journal.record(tokens, text)
    return journal


def test_record_keeps_tokens_text_and_one_boundary_per_delta_that_carried_something():
    journal = _journal()
    assert journal.token_ids == [40, 41, 5, 6, 7, 8, 9] and journal.resumed == 2
    assert journal.text == "écde" and journal.text_len == 4
    assert journal.delta_ends == [3, 4, 6, 7]  # the empty delta left none
    assert journal.text_ends == [0, 1, 3, 4]


@pytest.mark.parametrize("count", range(len(DELTAS) + 1))
def test_a_snapshot_at_every_delta_boundary_travels_and_comes_back_the_same(count):
    journal = _journal(DELTAS[:count])
    snapshot = journal.snapshot("r", PROMPT, seed=9)
    wire = decode(encode(snapshot))
    assert isinstance(wire, RequestSnapshot) and wire == snapshot and wire.seed == 9 and wire.resumed == 2
    copy = StreamJournal.from_snapshot(wire)
    assert (copy.token_ids, copy.resumed, copy.text, copy.text_len, copy.delta_ends, copy.text_ends) == (
        journal.token_ids,
        journal.resumed,
        journal.text,
        journal.text_len,
        journal.delta_ends,
        journal.text_ends,
    )
    copy.record([9], "z")  # a copy goes on as the original would
    journal.record([9], "z")
    assert (copy.token_ids, copy.text, copy.delta_ends) == (journal.token_ids, journal.text, journal.delta_ends)


@pytest.mark.parametrize("count", range(len(DELTAS) + 1))
def test_catch_up_from_a_client_copy_that_stops_at_a_boundary(count):
    """The client got the first `count` deltas (its own journal of them); the worker's copy has them all."""
    client, worker = _journal(DELTAS[:count]), _journal()
    tokens, text = worker.catch_up(client.token_ids)
    assert list(tokens) == [t for ts, _ in DELTAS[count:] for t in ts]
    assert client.token_ids + tokens == worker.token_ids and client.text + text == worker.text


def test_catch_up_from_a_boundary_that_ends_several_deltas_starts_at_the_first():
    """A delta of text alone ends where the one before it ended: a copy of that many tokens is sent the text
    from the first of them on. (Workers send text alone only in a last delta, so a stream that can still be
    caught up never has one.)"""
    journal = _journal([([5], "a"), ([], "b"), ([6], "c")])
    assert journal.delta_ends == [3, 3, 4] and journal.text_ends == [1, 2, 3]
    assert journal.catch_up([40, 41, 5]) == ([6], "bc")


def test_catch_up_refuses_a_copy_inside_a_delta_or_not_its_own():
    journal = _journal()
    assert journal.catch_up([40, 41, 5, 6, 7]) is None  # inside the last delta
    assert journal.catch_up([40]) is None  # inside the resumed tokens
    assert journal.catch_up([40, 41, 5, 9]) is None  # a boundary, but other tokens
    assert journal.catch_up([40, 41]) == ([5, 6, 7, 8, 9], "écde")  # only the resumed tokens
    assert journal.catch_up(journal.token_ids) == ([], "")


def test_a_worker_snapshot_read_back_catches_up_as_before():
    """The case RequestSnapshot.catch_up was tested with (it now lives here)."""
    snap = RequestSnapshot(
        request_id="a",
        prompt_token_ids=TokenIds([1]),
        token_ids=TokenIds([5, 6, 7, 8]),
        resumed=1,
        text="xyz",
        delta_ends=[2, 4],
        text_ends=[1, 3],
    )
    journal = StreamJournal.from_snapshot(snap)
    assert journal.catch_up([5]) == ([6, 7, 8], "xyz")  # the client holds only the resumed token
    assert journal.catch_up([5, 6]) == ([7, 8], "yz")
    assert journal.catch_up([5, 6, 7, 8]) == ([], "")
    assert journal.catch_up([5, 6, 7]) is None and journal.catch_up([]) is None


@pytest.mark.parametrize("count", range(len(DELTAS) + 1))
def test_a_journal_of_lengths_only_keeps_the_tokens_and_text_length_of_a_full_one_and_no_text(count):
    """The coordinator's relay: what a re-dispatch resumes from (the tokens and how long their text is), with
    no text and no delta boundaries kept."""
    full, lengths = _journal(DELTAS[:count]), StreamJournal.lengths_only(RESUMED)
    for tokens, text in DELTAS[:count]:
        lengths.record(tokens, text)
    assert lengths.token_ids == full.token_ids and lengths.text_len == full.text_len
    assert not lengths.keeps_text and full.keeps_text
    assert lengths.resumed == 0 and lengths.delta_ends == [] and lengths.text_ends == []


def test_a_journal_of_lengths_only_starts_from_a_copy_and_its_text_length():
    """A client re-attached with 2 tokens whose text is 3 characters: the deltas after them add theirs."""
    journal = StreamJournal.lengths_only([7, 8], 3)
    journal.record([9], "éz")
    journal.record([], "")
    journal.record([10, 11], "")
    assert journal.token_ids == [7, 8, 9, 10, 11] and journal.text_len == 5
    assert StreamJournal.lengths_only().token_ids == [] and StreamJournal.lengths_only().text_len == 0


def test_an_unknown_text_length_stays_unknown_while_the_tokens_grow():
    """A client re-attached without saying how much text it holds: the resumed stream's text length is unknown
    (the worker then takes the tokens' whole text as delivered), however many deltas follow."""
    journal = StreamJournal.lengths_only([7, 8], None)
    journal.record([9], "abc")
    assert journal.token_ids == [7, 8, 9] and journal.text_len is None


def test_a_journal_of_lengths_only_refuses_text_snapshot_and_catch_up():
    journal = StreamJournal.lengths_only([7, 8], 3)
    journal.record([9], "x")
    with pytest.raises(ValueError, match="keeps the length of its text only.*no text"):
        _ = journal.text
    with pytest.raises(ValueError, match="keeps the length of its text only.*no snapshot"):
        journal.snapshot("r", PROMPT)
    for held in ([7, 8], [7, 8, 9], [1]):  # not even a copy that could never fit is answered
        with pytest.raises(ValueError, match="keeps the length of its text only.*no catch-up"):
            journal.catch_up(held)
