"""The KV sockets of a worker with a KV role (the I/O of worker/kv_transfer.py; its decisions are WorkerCore's).

- A kv_consumer binds a ROUTER (`kv_port`, 0: one the OS chooses) and says where in its Hello (`kv_address`). With
  keys it is a CURVE server under the worker's own key pair, and lets in only that public key: the producers of a
  cluster made with `infer-keygen --cluster` share the workers' one key pair (a producer under another key fails the
  handshake, its transfer times out and its requests are recomputed on the consumer: never served unauthenticated
  KV).
- A kv_producer opens one DEALER per consumer address (lazily; with keys a CURVE client towards the consumer's key,
  which the coordinator vouched for in the Dispatch). Blocks go only after the consumer's KvWant (it is alive), so a
  dead consumer has only an offer queued towards it; at most _SNDHWM frames queue per consumer.
"""

from __future__ import annotations

import logging
import time

import zmq

from infer.protocol.keys import CurveKeys
from infer.protocol.logsafe import RateLimitedLog
from infer.protocol.transport import KeyGate, frames_for, make_socket
from infer.worker.core import WorkerCore

log = logging.getLogger("infer.kv_transfer")

_SNDHWM = 16  # frames (each up to 32 MiB) queued towards one consumer


class KvLinks:
    """A worker's KV sockets: the consumer's ROUTER or the producer's DEALERs (see the module docstring)."""

    def __init__(self, core: WorkerCore, curve: CurveKeys | None, host: str, poller: zmq.Poller) -> None:
        self.core, self.curve, self.poller = core, curve, poller
        self.ctx = zmq.Context()
        self._gate: KeyGate | None = None
        self.server: zmq.Socket | None = None
        self.links: dict[tuple[str, str], zmq.Socket] = {}
        self._warn = RateLimitedLog(log)
        if core.kv_receiver is not None:
            self._bind(host, core.options.kv_transfer_config.kv_port)

    def _bind(self, host: str, port: int) -> None:
        curve = None
        if self.curve is not None:
            own = self.curve.public_key
            curve = CurveKeys(self.curve.public_key, self.curve.secret_key)
            self._gate = KeyGate(self.ctx, lambda key: key == own, logger=log, peers="KV producer")
        sock = self.server = make_socket(self.ctx, zmq.ROUTER, curve=curve)
        sock.bind(f"tcp://*:{port}" if port else "tcp://*:0")
        bound = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.core.kv_address = f"tcp://{host}:{bound}"
        self.poller.register(sock, zmq.POLLIN)
        log.info("KV socket (kv_consumer) at %s", self.core.kv_address)

    def sockets(self) -> list[zmq.Socket]:
        return ([self.server] if self.server is not None else []) + list(self.links.values())

    def receive(self, events: dict) -> None:
        """Every frame waiting on a socket the poll reported."""
        if self.server is not None and self.server in events:
            while True:
                try:
                    frames = self.server.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) >= 2:
                    self.core.on_kv_frame(frames[0], frames[1:], time.monotonic())
        for sock in list(self.links.values()):
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.core.on_kv_answer(frames, time.monotonic())

    def flush(self) -> None:
        """What the core queued: a consumer's answers, a producer's frames."""
        if self.server is not None:
            for peer, msg in self.core.take_kv_replies():
                try:
                    self.server.send_multipart(frames_for(msg, peer), zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError):  # the producer is gone: its transfer times out there
                    self._warn.warning("a KV answer could not be sent to its producer (gone)")
        for address, key, msg in self.core.take_kv_outgoing():
            try:
                self._link(address, key).send_multipart(frames_for(msg), zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError) as e:  # not connected (yet) or full: the transfer times out
                self._warn.warning("a KV frame to %s was not sent (%s); its transfer will time out", address, e)

    def _link(self, address: str, key: str) -> zmq.Socket:
        sock = self.links.get((address, key))
        if sock is None:
            curve = None if self.curve is None or not key else self.curve.towards(key.encode())
            sock = self.links[(address, key)] = make_socket(self.ctx, zmq.DEALER, curve=curve)
            sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            sock.connect(address)
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def close(self) -> None:
        for sock in self.sockets():
            sock.close(0)
        if self._gate is not None:
            self._gate.close()
        self.ctx.term()
