"""What the coordinator queued to send since the daemon last took it. No I/O.

Jobs are given `send` (and the relay `to_client`), never the queue: each client's deltas are gathered into one
DeltaBatch per cycle, everything else leaves in the order it was queued."""

from __future__ import annotations

from collections.abc import Callable

from infer.protocol.messages import Delta, DeltaBatch, Message
from infer.protocol.tracing import HopSpan

Send = Callable[[bytes, Message], None]  # queue a message to a peer (by ROUTER identity)


class Outbox:
    """The messages queued to peers, and the deltas queued to clients."""

    def __init__(self) -> None:
        self._out: list[tuple[bytes, Message]] = []
        self._client_deltas: dict[bytes, list[Delta]] = {}
        self._spans: list[HopSpan] = []

    def end_span(self, span: HopSpan) -> None:
        """A traced request's hop ended (protocol/tracing.py); `take_spans` stamps its end."""
        self._spans.append(span)

    def take_spans(self, now: float) -> list[HopSpan]:
        """The hops ended since the last call, ended at `now` (the cycle that ended them)."""
        spans, self._spans = self._spans, []
        for span in spans:
            span.end = now
        return spans

    def send(self, identity: bytes, msg: Message) -> None:
        self._out.append((identity, msg))

    def to_client(self, client: bytes, delta: Delta) -> None:
        deltas = self._client_deltas.get(client)
        if deltas is None:
            self._client_deltas[client] = [delta]
        else:
            deltas.append(delta)

    def take(self) -> list[tuple[bytes, Message]]:
        """Everything queued since the last call: each client's deltas as one DeltaBatch, then the rest in the
        order it was queued."""
        out: list[tuple[bytes, Message]] = [
            (identity, DeltaBatch(deltas=deltas)) for identity, deltas in self._client_deltas.items()
        ]
        out.extend(self._out)
        self._client_deltas = {}
        self._out = []
        return out

    def drop(self, identity: bytes) -> None:
        """Nothing queued for `identity` leaves (it was cut off)."""
        self._client_deltas.pop(identity, None)
        self._out = [(i, m) for i, m in self._out if i != identity]

    def drop_all(self) -> None:
        """Nothing queued leaves (this coordinator stopped leading: coordinator/election.py)."""
        self._client_deltas = {}
        self._out = []
