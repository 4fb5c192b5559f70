"""The one socket helper: every ZeroMQ socket of the project is made and used through here.

With CurveKeys a socket speaks CurveZMQ (encrypted, and authenticated both ways): a server socket accepts
a peer only when the KeyGate of its context lets the peer's public key in, so a stranger's frames never
reach a handler; a client socket accepts only the server whose public key it was given.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from infer.protocol.keys import CurveKeys
from infer.protocol.logsafe import Throttle, safe
from infer.protocol.messages import MAX_COORDINATORS, MAX_FRAME_BYTES, Message, encode

ZAP_DOMAIN = "infer"  # the coordinator's socket; EP wake sockets use their own
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (one handler per context)
_gate_ids = itertools.count()


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    identity: bytes | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    curve: CurveKeys | None = None,
    zap_domain: str = ZAP_DOMAIN,
) -> zmq.Socket:
    """A socket with the project's options: no linger on close, the frame size limit enforced by ZeroMQ
    itself (an oversized frame drops the connection before it is read), TCP keepalive, and ROUTER
    sockets that report unroutable peers instead of dropping silently (zmq.ROUTER_MANDATORY).

    `curve`: CurveZMQ with these keys. A server (curve.server_key None) asks its context's ZAP handler (a
    KeyGate, started before the socket binds) about every peer under `zap_domain`, and refuses every peer
    when no handler is there (ZAP_ENFORCE_DOMAIN); a client checks the server's key."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve is not None:
        _set_curve(sock, curve, zap_domain)
    return sock


def _set_curve(sock: zmq.Socket, curve: CurveKeys, zap_domain: str) -> None:
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    if curve.server_key is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)
        return
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode())
    try:
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse (libzmq's default lets all in)
    except (AttributeError, zmq.ZMQError):  # libzmq < 4.3: KeyGate is always started before bind
        pass


_HANDSHAKE_FAILURES = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "it does not speak CURVE (no keys configured there)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "it holds another server public key than this one's, or a bad key",
}


HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def handshake_failure(event: Mapping[str, Any], curve: bool, flags: tuple[str, str]) -> str | None:
    """What a failed handshake, as a connecting socket's monitor reports it (HANDSHAKE_EVENTS), says about
    this peer's keys; None for any other event. `curve`: this peer has keys; `flags`: how its key options are
    spelled (its secret key file, the coordinator's public key file), for the hint."""
    kind, value = event["event"], event["value"]
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the coordinator refused this peer's CURVE key (status {value}): its public key is not among "
            f"the coordinator's authorized keys in the folder of its role (workers/, clients/, admins/), or "
            f"was revoked; its log names the refused key"
        )
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if curve:
            return "the coordinator does not speak CURVE (it runs without keys): leave out this peer's keys"
        return (
            f"the coordinator requires CURVE keys: pass {flags[0]} and {flags[1]} (this peer's secret key "
            f"file and the coordinator's public key file)"
        )
    if kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        if curve:
            return (
                f"the coordinator closed the CURVE handshake: {flags[1]} is not the coordinator's public "
                f"key, or this peer's key is unusable"
            )
        return (
            f"the coordinator closed the connection in the handshake: it probably requires CURVE keys: pass "
            f"{flags[0]} and {flags[1]} (or this is not a coordinator's address)"
        )
    return None


class KeyGate:
    """The ZAP handler of one zmq.Context: a CURVE server socket of that context lets a peer in only if
    `allows(public key as z85 text)` says so (any other mechanism is refused). The connection's ZAP User-Id is
    that key: every frame received on it carries it (`frame.get("User-Id")`), which is how the coordinator
    knows the role of each frame's sender. A thread answers libzmq's
    ZAP requests (one per handshake); each refusal is logged as a WARNING naming the key and the peer's IP
    address, at most `burst` per `period` seconds (the rest are counted, and the count is logged).

    Start it before the server socket binds. `watch`: a server socket whose failed handshakes that never
    reach ZAP (a peer without CURVE, a peer holding another server key) are logged the same way; libzmq does
    not say who those peers are. The thread ends on close() or when the context is terminated.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        allows: Callable[[bytes], bool],
        *,
        logger: logging.Logger,
        peers: str = "peer",
        watch: zmq.Socket | None = None,
        burst: int = 5,
        period: float = 10.0,
    ) -> None:
        self.allows, self.log, self.peers = allows, logger, peers
        self.refused = 0  # refusals so far (the gate thread counts, anyone may read)
        # refused keys, and handshakes failed before ZAP (those retry every 100 ms): neither hides the other
        self._throttles = {"key": Throttle(burst, period), "handshake": Throttle(burst, period)}
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)  # EADDRINUSE: this context has a gate already
        self._ctx = ctx
        self._stop_endpoint = f"inproc://infer-keygate-{next(_gate_ids)}"
        self._stop = ctx.socket(zmq.PAIR)
        self._stop.bind(self._stop_endpoint)
        self._monitor = None
        if watch is not None:
            self._monitor = watch.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                addr=f"inproc://infer-keygate-monitor-{next(_gate_ids)}",
            )
        self._thread = threading.Thread(target=self._run, name="infer-keygate", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (its sockets close with it). Idempotent."""
        if self._thread.is_alive():
            try:
                tell = self._ctx.socket(zmq.PAIR)
                tell.setsockopt(zmq.LINGER, 1000)
                tell.connect(self._stop_endpoint)
                tell.send(b"", zmq.NOBLOCK)
                tell.close()
            except zmq.ZMQError:  # the context is terminating: the thread ends on its own
                pass
            self._thread.join(timeout)

    # ---- the gate thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._zap, self._stop, self._monitor):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._stop in events:
                    return
                if self._zap in events:
                    self._zap.send_multipart(self._answer(self._zap.recv_multipart()))
                if self._monitor is not None and self._monitor in events:
                    self._on_event(recv_monitor_message(self._monitor))
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in (self._zap, self._stop, self._monitor):
                if sock is not None:
                    sock.close(0)
            n = sum(t.take_suppressed() for t in self._throttles.values())
            if n:
                self.log.warning("(%d more refused connection(s) were not logged)", n)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request: version, request id, status, text, user id, metadata."""
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        ip = safe(address.decode(errors="replace")) or "unknown address"
        if version != b"1.0":
            return [b"1.0", request_id, b"400", b"unsupported ZAP version", b"", b""]
        if mechanism != b"CURVE" or len(frames) != 7 or len(frames[6]) != 32:
            self._refuse(
                "key", f"a {self.peers} from {ip} without a CURVE key ({safe(mechanism.decode(errors='replace'))})"
            )
            return [b"1.0", request_id, b"400", b"CURVE required", b"", b""]
        key = z85.encode(frames[6])
        try:
            allowed = self.allows(key)
        except Exception:  # a broken check refuses; the gate must answer every request or handshakes hang
            self.log.exception("the key check failed; refusing %s", key.decode())
            allowed = False
        if not allowed:
            self._refuse("key", f"a {self.peers} from {ip} with unknown public key {key.decode()}")
            return [b"1.0", request_id, b"400", b"unknown key", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", key, b""]

    def _on_event(self, event: Mapping[str, Any]) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the peer hung up (mismatch seen there)
            why = "the peer closed it: it does not speak CURVE, or holds another server public key"
        else:
            why = _HANDSHAKE_FAILURES.get(event["value"], f"protocol error {event['value']:#x}")
        endpoint = event["endpoint"].decode(errors="replace")
        self._refuse("handshake", f"a {self.peers} on {endpoint} in the handshake, before its key was known: {why}")

    def _refuse(self, kind: str, text: str) -> None:
        self.refused += 1
        throttle = self._throttles[kind]
        if throttle.allow():
            n = throttle.take_suppressed()
            self.log.warning("refused %s%s", text, f" ({n} refusals not logged before this one)" if n else "")


def frames_for(msg: Message, identity: bytes | None = None) -> list[bytes]:
    """The multipart frames that carry `msg` ([identity, frame] on a ROUTER, [frame] on a DEALER)."""
    return [encode(msg)] if identity is None else [identity, encode(msg)]


def split_addresses(text: str, what: str = "coordinator address list", tcp_ports: bool = False) -> tuple[str, ...]:
    """The coordinators of one cluster, comma-separated: each tcp://HOST:PORT or ipc://PATH (`tcp_ports`: tcp://HOST:PORT
    only, as --peers needs), none twice, at most MAX_COORDINATORS; ValueError naming the entry that is not one."""
    addresses = tuple(entry.strip() for entry in text.split(","))
    for i, entry in enumerate(addresses):
        if not entry:
            raise ValueError(f"{what}: entry {i + 1} of {text!r} is empty")
        host, _, port = entry.removeprefix("tcp://").rpartition(":")
        tcp = entry.startswith("tcp://") and bool(host) and port.isdigit() and 0 < int(port) < 65536
        if not (tcp or (not tcp_ports and entry.startswith("ipc://") and len(entry) > len("ipc://"))):
            form = "tcp://HOST:PORT" if tcp_ports else "tcp://HOST:PORT (or ipc://PATH)"
            raise ValueError(f"{what} {text!r}: entry {i + 1}, {entry!r}, is not {form}")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"{what} {text!r} names an address twice")
    if len(addresses) > MAX_COORDINATORS:
        raise ValueError(f"{what} {text!r}: at most {MAX_COORDINATORS} coordinators, got {len(addresses)}")
    return addresses
