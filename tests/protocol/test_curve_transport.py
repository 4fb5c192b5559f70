"""CurveZMQ through the socket helper, on real loopback sockets: a CURVE server socket behind a KeyGate
receives frames only from peers whose key the gate allows; an unknown key, a peer without CURVE and a peer
holding another server key are refused before any frame arrives and logged (rate-limited); a server socket
with no gate refuses everyone."""

from __future__ import annotations

import logging

import pytest
import zmq

from infer.protocol.keys import CurveKeys
from infer.protocol.transport import KeyGate, make_socket

LOG = logging.getLogger("test.keygate")


def _pair() -> CurveKeys:
    return CurveKeys(*zmq.curve_keypair())


@pytest.fixture
def server():
    """(ctx, a CURVE ROUTER on loopback behind a gate, its endpoint, the gate, its keys, the allowed set)"""
    ctx = zmq.Context()
    keys, allowed = _pair(), set()
    sock = make_socket(ctx, zmq.ROUTER, curve=keys)
    gate = KeyGate(ctx, allowed.__contains__, logger=LOG, peers="client", watch=sock)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    yield ctx, sock, endpoint, gate, keys, allowed
    sock.close()
    gate.close()
    ctx.term()


def _send_from(ctx: zmq.Context, endpoint: str, curve: CurveKeys | None, text: bytes) -> zmq.Socket:
    peer = make_socket(ctx, zmq.DEALER, curve=curve)
    peer.connect(endpoint)
    peer.send(text)
    return peer


def _received(sock: zmq.Socket, timeout_ms: int) -> list[bytes]:
    got = []
    while sock.poll(timeout_ms):
        got.append(sock.recv_multipart()[-1])
        timeout_ms = 50
    return got


def test_only_allowed_keys_get_frames_through(server, caplog):
    ctx, sock, endpoint, gate, keys, allowed = server
    friend, stranger = _pair(), _pair()
    allowed.add(friend.public_key)
    caplog.set_level(logging.WARNING, logger=LOG.name)
    peers = [
        _send_from(ctx, endpoint, friend.towards(keys.public_key), b"friend"),
        _send_from(ctx, endpoint, stranger.towards(keys.public_key), b"stranger"),
        _send_from(ctx, endpoint, None, b"plaintext"),
        _send_from(ctx, endpoint, friend.towards(stranger.public_key), b"wrong server key"),
    ]
    assert _received(sock, 1500) == [b"friend"]
    refused = f"refused a client from 127.0.0.1 with unknown public key {stranger.public_key.decode()}"
    assert refused in caplog.text
    assert "it does not speak CURVE" in caplog.text
    assert "another server public key" in caplog.text
    assert gate.refused >= 3
    for peer in peers:
        peer.close()


def test_a_flood_of_refusals_is_logged_a_few_times_then_counted(caplog):
    ctx = zmq.Context()
    keys = _pair()
    sock = make_socket(ctx, zmq.ROUTER, curve=keys)
    gate = KeyGate(ctx, lambda key: False, logger=LOG, peers="client", burst=3, period=60)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    caplog.set_level(logging.WARNING, logger=LOG.name)
    peers = [_send_from(ctx, endpoint, _pair().towards(keys.public_key), b"x") for _ in range(20)]
    assert _received(sock, 1500) == []
    for peer in peers:
        peer.close()
    sock.close()
    gate.close()  # the count of what was held back is logged when the gate stops
    ctx.term()
    refusals = [r for r in caplog.records if "unknown public key" in r.getMessage()]
    assert gate.refused >= 20 and len(refusals) == 3
    assert f"({gate.refused - 3} more refused connection(s) were not logged)" in caplog.text


def test_a_curve_server_without_a_gate_refuses_everyone():
    ctx = zmq.Context()
    keys, client = _pair(), _pair()
    sock = make_socket(ctx, zmq.ROUTER, curve=keys)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    peer = _send_from(ctx, endpoint, client.towards(keys.public_key), b"hello")
    assert _received(sock, 800) == []
    peer.close()
    sock.close()
    ctx.term()


def test_a_second_gate_on_one_context_is_refused(server):
    ctx = server[0]
    with pytest.raises(zmq.ZMQError):
        KeyGate(ctx, lambda key: True, logger=LOG)


def test_a_gate_ends_with_its_context():
    ctx = zmq.Context()
    gate = KeyGate(ctx, lambda key: True, logger=LOG)
    ctx.term()  # returns only once the gate thread closed its sockets
    gate._thread.join(5)
    assert not gate._thread.is_alive()
