"""A worker's direct streams (docs/architecture.md, "Direct streams"): the deltas of a request whose Dispatch named
a stream owner go from this worker's stream socket straight to the client that subscribes with the stream's token
(and, with keys, the owner's key), not through the coordinator. No I/O: the worker's core feeds it and the shell
sends what `take` returns.

Each stream keeps the deltas it sent with the place each starts (output tokens, characters of text), so a Subscribe
that comes late (or again, after a reconnection) is sent the very deltas its client lacks, from the delta boundary
where its copy stops: the first one with what only a first delta carries (a text prompt's token ids, the seed),
each with its logprobs. The client takes only exact continuations.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field

from infer.protocol.codes import ErrorCode
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.messages import Delta, Error, Heartbeat, Message, StreamBatch, Subscribe

log = logging.getLogger("infer.worker")

MAX_EARLY_SUBSCRIPTIONS = 4096  # Subscribes waiting for their Dispatch (bounded: a peer may send junk ids)


@dataclass(frozen=True)
class Sent:
    """One delta of a direct stream and where it starts in the client's copy."""

    delta: Delta
    token_start: int  # output tokens before it (resumed ones included)
    text_start: int  # characters of text before it (the resumed tokens' included)

    @property
    def ends(self) -> tuple[int, int]:
        return self.token_start + len(self.delta.token_ids), self.text_start + len(self.delta.text)


@dataclass(eq=False)
class DirectStream:
    """One direct stream: who may read it, where its copy starts (the resumed tokens and their text, which the
    client holds already), the deltas sent so far, its reader, and when it ended."""

    owner: str  # the owner's z85 public key; "" without keys
    token: str
    num_resumed: int = 0
    text_base: int = 0
    sent: list[Sent] = field(default_factory=list)
    subscriber: bytes | None = None
    ended_at: float | None = None

    @property
    def head(self) -> tuple[int, int]:
        """Where the next delta starts."""
        return self.sent[-1].ends if self.sent else (self.num_resumed, self.text_base)

    def since(self, num_tokens: int, text_len: int) -> list[Sent] | None:
        """The deltas a copy of `num_tokens` tokens and `text_len` characters lacks; None when that copy does not
        stop at a delta boundary of this stream."""
        for i, sent in enumerate(self.sent):  # (an empty delta, say a final one, starts where the last one ended)
            if (sent.token_start, sent.text_start) == (num_tokens, text_len):
                return self.sent[i:]
        return [] if (num_tokens, text_len) == self.head else None


class StreamTable:
    """The direct streams of this worker by request id, the Subscribes waiting for their Dispatch, and what goes
    out on the stream socket (one StreamBatch per client per step, answers, heartbeats)."""

    def __init__(self, linger: float, wait: float, heartbeat_interval: float) -> None:
        self.linger, self.wait, self.heartbeat_interval = linger, wait, heartbeat_interval
        self.streams: dict[str, DirectStream] = {}
        # Subscribes waiting for a stream they may read, by (request id, peer): (peer's key, the Subscribe, since)
        self._early: dict[str, dict[bytes, tuple[str, Subscribe, float]]] = {}
        self._num_early = 0
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
        waiting = self._early.get(request_id, {})
        for peer, (user_id, msg, _) in list(waiting.items()):
            if self._may_read(stream, user_id, msg):
                self._unpark(request_id, peer)
                self.subscribe(peer, user_id, msg, now)

    def remove(self, request_id: str) -> None:
        """The coordinator aborted it, or the worker gave it back: nothing more goes out for it."""
        self.streams.pop(request_id, None)

    def subscribe(self, peer: bytes, user_id: str, msg: Subscribe, now: float) -> None:
        """A client asks for a stream from where its copy stops: served when its token (and key) match. One that
        does not match (yet: its Dispatch, with a new token, may be on its way) waits up to `wait` seconds."""
        stream = self.streams.get(msg.request_id)
        if stream is None or not self._may_read(stream, user_id, msg):
            waiting = self._early.get(msg.request_id)
            if waiting is not None and peer in waiting:
                waiting[peer] = (user_id, msg, now)
            elif self._num_early < MAX_EARLY_SUBSCRIPTIONS:
                self._early.setdefault(msg.request_id, {})[peer] = (user_id, msg, now)
                self._num_early += 1
            else:
                self._reply(peer, msg, "too many subscriptions wait for requests", ErrorCode.OVERLOADED)
            return
        missing = stream.since(msg.num_tokens, msg.text_len)
        if missing is None:
            self._reply(peer, msg, "the copy does not stop at a delta boundary here", ErrorCode.UNAVAILABLE)
            return
        stream.subscriber = peer
        for sent in missing:
            self._queue(peer, sent)
        if stream.ended_at is not None:
            del self.streams[msg.request_id]

    @staticmethod
    def _may_read(stream: DirectStream, user_id: str, msg: Subscribe) -> bool:
        """The token matches (in constant time) and, with keys, the frame's key is the owner's."""
        token_ok = hmac.compare_digest(stream.token.encode(), msg.stream_token.encode())
        return token_ok and (stream.owner == "" or hmac.compare_digest(stream.owner.encode(), user_id.encode()))

    def push(self, delta: Delta, token_start: int, text_start: int, now: float) -> None:
        """A delta of a direct stream starting at output token `token_start` and character `text_start` of the
        text after the resumed tokens: to its reader, if it has one; a final one ends the stream (kept `linger`
        seconds for a reader that has not come)."""
        stream = self.streams.get(delta.request_id)
        if stream is None:
            return
        sent = Sent(delta, token_start, stream.text_base + text_start)
        stream.sent.append(sent)
        if stream.subscriber is not None:
            self._queue(stream.subscriber, sent)
        if delta.finished:
            stream.ended_at = now
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
        expired = [(r, p) for r, waiting in self._early.items() for p, e in waiting.items() if now - e[2] > self.wait]
        for rid, peer in expired:
            msg = self._unpark(rid, peer)
            if rid in self.streams:  # a wrong token or key
                self.refused += 1
                self._warn.warning("refused a subscription to request %s: wrong token or key", safe(rid))
                self._reply(peer, msg, "no such stream for this peer", ErrorCode.INVALID_REQUEST)
            else:
                self._reply(peer, msg, "this worker does not run that request", ErrorCode.UNAVAILABLE)
        self.beat(now)

    def beat(self, now: float) -> None:
        """Every heartbeat interval, each reader of a running stream and each peer whose Subscribe waits for its
        Dispatch gets a Heartbeat (its silence watchdog); also from the shell's heartbeat thread during a long
        engine step, so that no reader takes the step for a lost worker. (A Dispatch that comes during a step is
        read after it: its reader, parked meanwhile, hears the worker is there.)"""
        if now - self._last_beat >= self.heartbeat_interval:
            self._last_beat = now
            peers = {s.subscriber for s in self.streams.values() if s.subscriber is not None}
            peers.update(peer for waiting in self._early.values() for peer in waiting)
            for peer in peers:
                self._replies.append((peer, Heartbeat(sent_at=now)))

    def _unpark(self, request_id: str, peer: bytes) -> Subscribe:
        waiting = self._early[request_id]
        msg = waiting.pop(peer)[1]
        self._num_early -= 1
        if not waiting:
            del self._early[request_id]
        return msg

    def reply_error(self, peer: bytes, text: str) -> None:
        """A frame that is no message this socket handles: an Error naming no stream."""
        self._replies.append((peer, Error(message=text, code=ErrorCode.INVALID_REQUEST)))

    def take(self) -> list[tuple[bytes, Message]]:
        """What to send on the stream socket now, by peer routing id."""
        out: list[tuple[bytes, Message]] = [
            (peer, StreamBatch(deltas=d, token_starts=t, text_starts=c)) for peer, (d, t, c) in self._batches.items()
        ]
        out.extend(self._replies)
        self._batches, self._replies = {}, []
        return out

    def _queue(self, peer: bytes, sent: Sent) -> None:
        batch = self._batches.get(peer)
        if batch is None:
            batch = self._batches[peer] = ([], [], [])
        batch[0].append(sent.delta)
        batch[1].append(sent.token_start)
        batch[2].append(sent.text_start)

    def _reply(self, peer: bytes, msg: Subscribe, text: str, code: ErrorCode) -> None:
        """A Subscribe not served: the Error names its request and token (the client's own), so the client knows
        which of its subscriptions it answers."""
        rid = msg.request_id
        error = Error(message=f"request {rid!r}: {text}", request_id=rid, code=code, stream_token=msg.stream_token)
        self._replies.append((peer, error))
