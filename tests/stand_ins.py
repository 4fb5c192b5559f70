"""A stand-in peer for client tests: a ROUTER on loopback speaking the real codec, answering the last peer it
heard, so that frames arrive exactly when a test says (tests/client/test_lost_notices.py, test_stream_links.py)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from infer.protocol.messages import Hello, Message, Welcome, decode, encode

WAIT = 10.0  # seconds a stand-in waits for a frame


class StandIn:
    """A ROUTER on loopback speaking the codec; it answers the last peer it heard."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.peer = b""

    async def recv(self, kind: type[Message]) -> Message:
        """The next frame of type `kind` (others are skipped), at most WAIT seconds away."""
        while True:
            self.peer, frame = await asyncio.wait_for(self.sock.recv_multipart(), WAIT)
            msg = decode(frame)
            if isinstance(msg, kind):
                return msg

    async def send(self, msg: Message) -> None:
        await self.sock.send_multipart([self.peer, encode(msg)])

    async def welcome(self) -> None:
        """Answer a client's Hello as a running coordinator would."""
        await self.recv(Hello)
        await self.send(Welcome(coordinator_id="stand-in", state="running", instance="i1"))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
