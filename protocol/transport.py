"""The one socket helper: every ZeroMQ socket of the project is made and used through here."""

from __future__ import annotations

import zmq

from infer.protocol.messages import MAX_FRAME_BYTES, Message, encode


def make_socket(ctx: zmq.Context, kind: int, *, identity: bytes | None = None,
                max_frame_bytes: int = MAX_FRAME_BYTES) -> zmq.Socket:
    """A socket with the project's options: no linger on close, the frame size limit enforced by ZeroMQ
    itself (an oversized frame drops the connection before it is read), TCP keepalive, and ROUTER
    sockets that report unroutable peers instead of dropping silently (zmq.ROUTER_MANDATORY)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def frames_for(msg: Message, identity: bytes | None = None) -> list[bytes]:
    """The multipart frames that carry `msg` ([identity, frame] on a ROUTER, [frame] on a DEALER)."""
    return [encode(msg)] if identity is None else [identity, encode(msg)]
