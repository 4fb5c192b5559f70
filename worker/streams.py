"""A worker's direct streams (docs/architecture.md, "Direct streams"): the deltas of a request whose Dispatch named
a stream owner go from this worker's stream socket straight to the client that subscribes with the stream's token
(and, with keys, the owner's key), not through the coordinator. No I/O: the worker's core feeds it and the shell
sends what `take` returns.

Each stream shares its request's StreamJournal (worker/core.py `_Sent`), so a Subscribe that comes late (or
again, after a reconnection) gets what the client lacks from the delta boundary where its copy stops; every
delta sent says where it starts (tokens, characters), and the client takes only exact continuations.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

import msgspec

from infer.protocol.codes import ErrorCode
from infer.protocol.journal import StreamJournal
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.messages import Delta, Error, Heartbeat, Message, StreamBatch, Subscribe, TokenIds

log = logging.getLogger("infer.worker")

MAX_EARLY_SUBSCRIPTIONS = 4096  # Subscribes waiting for their Dispatch (bounded: a peer may send junk ids)


@dataclass(eq=False)
class DirectStream:
    """One direct stream: who may read it, its journal (shared with the request), the characters of text the
    resumed tokens carried (the client's, before this journal's text), its reader, and its end once it ended."""

    owner: str  # the owner's z85 public key; "" without keys
    token: str
    journal: StreamJournal
    text_base: int
    subscriber: bytes | None = None
    final: Delta | None = None
    ended_at: float | None = None
    pushed_final: bool = False


class StreamTable:
    """The direct streams of this worker by request id, the Subscribes waiting for their Dispatch, and what goes
    out on the stream socket (one StreamBatch per client per step, answers, heartbeats)."""

    def __init__(self, linger: float, wait: float, heartbeat_interval: float) -> None:
        self.linger, self.wait, self.heartbeat_interval = linger, wait, heartbeat_interval
        self.streams: dict[str, DirectStream] = {}
        self._early: dict[str, tuple[bytes, str, Subscribe, float]] = {}
        self._batches: dict[bytes, tuple[list[Delta], list[int], list[int]]] = {}
        self._replies: list[tuple[bytes, Message]] = []
        self._last_beat = 0.0
        self.refused = 0  # Subscribes refused (a wrong token or key)
        self._warn = RateLimitedLog(log)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.streams

    def open(self, request_id: str, stream: DirectStream, now: float) -> None:
        """A Dispatch of a direct stream; a Subscribe that came first is served now."""
        self.streams[request_id] = stream
        early = self._early.pop(request_id, None)
        if early is not None:
            self.subscribe(early[0], early[1], early[2], now)

    def remove(self, request_id: str) -> None:
        """The coordinator aborted it, or the worker gave it back: nothing more goes out for it."""
        self.streams.pop(request_id, None)

    def subscribe(self, peer: bytes, user_id: str, msg: Subscribe, now: float) -> None:
        """A client asks for a stream from where its copy stops: served when its token (and key) match."""
        stream = self.streams.get(msg.request_id)
        if stream is None:
            if len(self._early) < MAX_EARLY_SUBSCRIPTIONS:
                self._early[msg.request_id] = (peer, user_id, msg, now)
            else:
                self._reply(peer, msg.request_id, "too many subscriptions wait for their requests", "overloaded")
            return
        if not hmac.compare_digest(stream.token, msg.stream_token) or stream.owner not in ("", user_id):
            self.refused += 1
            self._warn.warning("refused a subscription to request %s: wrong token or key", safe(msg.request_id))
            self._reply(peer, msg.request_id, "no such stream for this peer", ErrorCode.INVALID_REQUEST)
            return
        catch_up = self._since(stream, msg.num_tokens, msg.text_len)
        if catch_up is None:
            self._reply(
                peer, msg.request_id, "the copy does not stop at a delta boundary of this stream", "unavailable"
            )
            return
        stream.subscriber = peer
        tokens, text = catch_up
        final = stream.final
        if final is not None:
            delta = msgspec.structs.replace(final, token_ids=tokens, text=text, logprobs=None)
        elif tokens or text:
            delta = Delta(request_id=msg.request_id, token_ids=tokens, text=text)
        else:
            return
        self._queue(peer, delta, msg.num_tokens, msg.text_len)
        if final is not None:
            del self.streams[msg.request_id]

    def _since(self, stream: DirectStream, num_tokens: int, text_len: int) -> tuple[TokenIds, str] | None:
        """What a copy of `num_tokens` tokens and `text_len` characters lacks, when it stops at a boundary."""
        journal = stream.journal
        text_start = text_len - stream.text_base
        if num_tokens == journal.resumed and text_start == 0:
            start = 0
        else:
            start = next(
                (t for n, t in zip(journal.delta_ends, journal.text_ends) if n == num_tokens and t == text_start), -1
            )
            if start < 0:
                return None
        end = journal.delta_ends[-1] if journal.delta_ends else journal.resumed
        return TokenIds(journal.token_ids[num_tokens:end]), journal.text[start:]

    def push(self, delta: Delta, token_start: int, text_start: int, now: float) -> None:
        """A delta of a direct stream (recorded in its journal already): to its reader, if it has one; a final one
        ends the stream (kept `linger` seconds for a reader that has not come)."""
        stream = self.streams.get(delta.request_id)
        if stream is None:
            return
        if stream.subscriber is not None:
            self._queue(stream.subscriber, delta, token_start, stream.text_base + text_start)
        if delta.finished:
            stream.final, stream.ended_at = delta, now
            if stream.subscriber is not None:
                del self.streams[delta.request_id]

    def drop_peer(self, peer: bytes) -> None:
        """A send to `peer` failed: its subscriptions lapse (it subscribes again, or asks the coordinator)."""
        for stream in self.streams.values():
            if stream.subscriber == peer:
                stream.subscriber = None

    def tick(self, now: float) -> None:
        """Ended streams nobody fetched past `linger`, and Subscribes whose Dispatch never came, expire; every
        heartbeat interval, each reader of a running stream gets a Heartbeat (its silence watchdog)."""
        for rid in [r for r, s in self.streams.items() if s.ended_at is not None and now - s.ended_at > self.linger]:
            del self.streams[rid]
        for rid in [r for r, e in self._early.items() if now - e[3] > self.wait]:
            peer = self._early.pop(rid)[0]
            self._reply(peer, rid, "this worker does not run that request", "unavailable")
        if now - self._last_beat >= self.heartbeat_interval:
            self._last_beat = now
            for peer in {s.subscriber for s in self.streams.values() if s.subscriber is not None}:
                self._replies.append((peer, Heartbeat(sent_at=now)))

    def reply_error(self, peer: bytes, text: str) -> None:
        self._replies.append((peer, Error(message=text)))

    def take(self) -> list[tuple[bytes, Message]]:
        out: list[tuple[bytes, Message]] = [
            (peer, StreamBatch(deltas=d, token_starts=t, text_starts=c)) for peer, (d, t, c) in self._batches.items()
        ]
        out.extend(self._replies)
        self._batches, self._replies = {}, []
        return out

    def _queue(self, peer: bytes, delta: Delta, token_start: int, text_start: int) -> None:
        batch = self._batches.get(peer)
        if batch is None:
            batch = self._batches[peer] = ([], [], [])
        batch[0].append(delta)
        batch[1].append(token_start)
        batch[2].append(text_start)

    def _reply(self, peer: bytes, request_id: str, text: str, code: str) -> None:
        self._replies.append((peer, Error(message=f"request {request_id!r}: {text}", request_id=request_id, code=code)))
