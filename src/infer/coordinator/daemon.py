"""infer-coordinator: one ROUTER socket for clients and workers; the logic lives in core.py.

The loop: wait on the socket (and on a signal wakeup fd) until the next timer deadline, drain what
arrived (bounded per cycle), run the timers, send what the core queued. A send that finds its peer
unroutable (ROUTER_MANDATORY: the connection is gone) is reported back to the core, which treats the
peer as dead. SIGTERM / SIGINT run STOP (after a drain of at most --drain-timeout, when given): pending
requests fail, workers are told to stop, exit 0.

With CurveZMQ keys (--curve-secret-key with --authorized-keys DIR or per-role key directories) a KeyGate lets
in the authorized keys; each frame reaches the core with its connection's key (the ZAP User-Id), and the core
checks the key's role (infer.coordinator.access). The key folders are re-read every heartbeat interval, so a
removed key's open connections are cut off at the next tick. A routing identity is never handed over to a
second connection then (ROUTER_HANDOVER off): a peer reconnecting while the coordinator still holds its old
connection is heard once that one closes.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import math
import signal
import socket
import sys
import time
import uuid

import zmq

from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.core import Coordinator
from infer.coordinator.election import Election
from infer.protocol.keys import AuthorizedKeys, CurveKeys, refuse_open_bind
from infer.protocol.logs import add_logging_args, setup_logging
from infer.protocol.logsafe import safe
from infer.protocol.messages import encode
from infer.protocol.options import add_options, given
from infer.protocol.ports import check_listening_fd
from infer.protocol.roles import Role
from infer.protocol.tracing import open_sink
from infer.protocol.transport import KeyGate, make_socket

log = logging.getLogger("infer.coordinator")

MAX_MESSAGES_PER_CYCLE = 1024
PEER_SNDHWM = 1000  # messages queued to one peer (see CoordinatorDaemon.__init__)
PEER_RCVHWM = 100  # messages queued from one peer; more wait in TCP (the loop reads ~1000 per cycle)
EXIT_LINGER_MS = 2000
PEER_LINK_HWM = 64


class CoordinatorDaemon:
    """Owns the socket and the loop; `run()` returns the process exit code."""

    def __init__(self, config: CoordinatorConfig) -> None:
        """ValueError for a bad key file, or a non-loopback host without keys or trusted_network;
        zmq.ZMQError when the address cannot be bound."""
        curve, authorized = load_security(config)
        peers = config.peer_addresses
        # several coordinators share one key pair: each lets the others' connections (that key) in
        peer_key = curve.public_key if curve is not None and len(peers) > 1 else None
        self.spans = open_sink("infer-coordinator", config.otlp_traces_endpoint)  # ValueError without the SDK
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, curve=curve)
        self.gate: KeyGate | None = None
        self.authorized = authorized
        if authorized is not None:  # before bind: no handshake may find the gate missing
            allows = authorized.allows if peer_key is None else lambda key: key == peer_key or authorized.allows(key)
            self.gate = KeyGate(self.ctx, allows, logger=log, peers="worker or client", watch=self.sock)
            log.info(
                "CurveZMQ on: coordinator public key %s; %d authorized key(s): %s",
                "?" if curve is None else curve.public_key.decode(),
                len(authorized.keys),
                authorized.describe(),
            )
            _warn_missing_roles(authorized)
        # Per peer: a peer that reads nothing fills its queue to SNDHWM, then a send to it raises zmq.Again
        # (ROUTER_MANDATORY): the core aborts its requests ("client_too_slow"). One that floods us waits in
        # TCP once RCVHWM frames of it are queued here. Memory is bounded per peer either way (in frames:
        # what the coordinator sends is bounded in size, except what a peer's own requests carry).
        self.sock.setsockopt(zmq.SNDHWM, PEER_SNDHWM)
        self.sock.setsockopt(zmq.RCVHWM, PEER_RCVHWM)
        # Without keys a peer that reconnects takes its routing id back at once. With keys a routing id stays
        # with the connection that has it: another connection presenting it (another key that learnt it) is
        # ignored by ZeroMQ and never receives that peer's frames (peers pick random, secret ids).
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0 if authorized is not None else 1)
        if config.listen_fd is not None:  # a socket the parent bound and keeps (ZeroMQ takes this copy of it)
            check_listening_fd(config.listen_fd, config.port)
            self.sock.setsockopt(zmq.USE_FD, config.listen_fd)
            self.sock.bind(config.endpoint)
        elif config.port == 0:
            port = self.sock.bind_to_random_port(f"tcp://{config.host}")
            config = dataclasses.replace(config, port=port)
        else:
            self.sock.bind(config.endpoint)
        self.config = config
        now = time.monotonic()
        self.election = None if len(peers) == 1 else Election(config.index, len(peers), now, lease=config.lease)
        self._keys, self._peer_key = authorized, peer_key
        self.core = self._new_core(now)
        self._leading = False
        # one DEALER to each other coordinator, for the election's frames (theirs reach our ROUTER); a peer that is
        # down gets nothing queued (IMMEDIATE), and a slow one at most PEER_LINK_HWM frames
        self.peer_links: dict[int, zmq.Socket] = {}
        for index, address in enumerate(peers):
            if index == config.index:
                continue
            link = make_socket(
                self.ctx,
                zmq.DEALER,
                identity=f"coordinator-{config.index}-{uuid.uuid4().hex[:8]}".encode(),
                curve=None if curve is None else dataclasses.replace(curve, server_key=curve.public_key),
            )
            link.setsockopt(zmq.IMMEDIATE, 1)
            link.setsockopt(zmq.SNDHWM, PEER_LINK_HWM)
            link.connect(address)
            self.peer_links[index] = link
        self._next_key_check = time.monotonic() + config.heartbeat_interval
        self._wake_r, self._wake_w = socket.socketpair()

    def run(self) -> int:
        self._install_signal_handlers()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)  # a plain fd: poll() reports it by number
        log.info(
            "coordinator %r listening on %s (policy %s, heartbeat %.2f s, worker timeout %.1f s, "
            "client timeout %.1f s, max retries %d)",
            self.config.coordinator_id,
            self.config.endpoint,
            self.config.policy,
            self.config.heartbeat_interval,
            self.config.worker_timeout,
            self.config.client_timeout,
            self.config.max_retries,
        )
        if self.election is not None:
            log.info(
                "coordinator %d of %d (%s); it serves while it leads, under a %.2f s lease a majority grants",
                self.election.index,
                self.election.count,
                ", ".join(self.config.peer_addresses),
                self.config.lease,
            )
        core = self.core
        while True:
            now = time.monotonic()
            timeout_ms = max(0, math.ceil((self._next_deadline() - now) * 1000))
            events = dict(poller.poll(timeout_ms))
            if self._wake_r.fileno() in events:
                self._on_signal()
            if self.sock in events:
                self._drain()
            now = time.monotonic()
            self._check_keys(now)
            if self.election is not None:
                self._elect(now)
                core = self.core
            core.tick(now)
            self._flush(now)
            if core.done(now):
                break
        self._close()
        log.info("coordinator stopped")
        return 0

    def _next_deadline(self) -> float:
        due = self.core.next_deadline()
        if self.election is not None:
            due = min(due, self.election.next_deadline())
        return due if self.authorized is None else min(due, self._next_key_check)

    def _new_core(self, now: float) -> Coordinator:
        return Coordinator(
            self.config,
            now,
            keys=self._keys,
            wall_offset=time.time() - time.monotonic(),
            election=self.election,
            peer_key=self._peer_key,
        )

    def _elect(self, now: float) -> None:
        """The election's timers and frames; a change of leadership: a fresh core (from the last leader's Replica
        when it starts leading; after telling its workers and clients where to go when it stops)."""
        election = self.election
        assert election is not None
        election.tick(now)
        leading = election.leading(now)
        if leading != self._leading:
            self._leading = leading
            if leading:
                log.info("coordinator %d leads the cluster (term %d)", election.index, election.term)
            else:
                log.warning(
                    "coordinator %d no longer leads (term %d%s): its workers and clients go to the leader",
                    election.index,
                    election.term,
                    f", coordinator {election.leader} does" if election.leader is not None else "",
                )
                self.core.step_down(now)
                self._flush(now)
            self.core = self._new_core(now)
        if leading:
            election.set_replica(self.core.replica())
        for index, msg in election.take_outgoing():
            try:
                self.peer_links[index].send(encode(msg), zmq.NOBLOCK)
            except zmq.Again:  # down, or not reading: the election copes with lost frames
                pass

    def _check_keys(self, now: float) -> None:
        """Every heartbeat interval, read the authorized keys again if their files changed (the core cuts off
        peers whose key was revoked at its next tick)."""
        if self.authorized is not None and now >= self._next_key_check:
            self._next_key_check = now + self.config.heartbeat_interval
            self.authorized.refresh()

    def _drain(self) -> None:
        if self.authorized is not None:
            return self._drain_authenticated()
        sock = self.sock
        now = time.monotonic()
        for _ in range(MAX_MESSAGES_PER_CYCLE):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames[0], frames[1:], now, None)

    def _drain_authenticated(self) -> None:
        """As _drain, with each frame's authenticated key: the User-Id the KeyGate gave its connection."""
        sock = self.sock
        now = time.monotonic()
        for _ in range(MAX_MESSAGES_PER_CYCLE):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames[0].bytes, [f.bytes for f in frames[1:]], now, _user_id(frames[-1]))

    def _handle(self, identity: bytes, payload: list[bytes], now: float, key: bytes | None) -> None:
        """The core's `handle` (which never raises); should a bug make it, the frame is lost and the loop goes on:
        no peer's input ends the coordinator (it exits only on STOP or a signal)."""
        try:
            self.core.handle(identity, payload, now, key=key)
        except Exception:  # noqa: BLE001
            self.core.peer_warnings.exception("a frame from %s raised out of the core; dropped", safe(identity))

    def _flush(self, now: float) -> None:
        send, core = self.sock.send, self.core
        more, last = zmq.SNDMORE | zmq.NOBLOCK, zmq.NOBLOCK
        outgoing = core.take_outgoing()
        while outgoing:
            for identity, msg in outgoing:
                try:
                    frame = encode(msg)
                except Exception:  # a value that cannot be packed: lose this message, never the loop
                    log.exception("cannot encode %r for %s", msg.TYPE, safe(identity))
                    continue
                try:
                    send(identity, more)  # unroutable or queue full: raises here (ROUTER_MANDATORY), nothing sent
                    send(frame, last)
                except zmq.Again:  # its queue is at the high-water mark: it does not read
                    core.peer_too_slow(identity, now)
                except zmq.ZMQError as e:
                    if e.errno != errno.EHOSTUNREACH:
                        log.warning("send of %r to %s failed: %s", msg.TYPE, safe(identity), e)
                    core.peer_gone(identity, now)
            outgoing = core.take_outgoing()  # peer_gone may have queued more (re-dispatches, aborts)
        if self.spans is not None:
            self.spans.export(core.take_spans(now))

    def _install_signal_handlers(self) -> None:
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries the signal into the loop

    def _on_signal(self) -> None:
        try:
            data = self._wake_r.recv(64)
        except BlockingIOError:
            return
        self.core.on_signal(f"signal {', '.join(sorted({_signal_name(b) for b in data}))}", time.monotonic())

    def _close(self) -> None:
        self.sock.setsockopt(zmq.LINGER, EXIT_LINGER_MS)  # let the last acks and errors leave
        self.sock.close()
        for link in self.peer_links.values():
            link.close(linger=0)
        if self.gate is not None:
            self.gate.close()
        self.ctx.term()
        signal.set_wakeup_fd(-1)
        self._wake_r.close()
        self._wake_w.close()
        if self.spans is not None:
            self.spans.close()


def load_security(config: CoordinatorConfig) -> tuple[CurveKeys | None, AuthorizedKeys | None]:
    """The coordinator's CURVE keys and the keys it lets in, or (None, None) without keys. ValueError for a
    bad key file, or for a non-loopback host without keys unless the network is declared trusted."""
    if config.curve_secret_key is None:
        if not config.trusted_network:
            refuse_open_bind(
                config.host,
                what="the coordinator",
                remedy="pass --curve-secret-key FILE and --authorized-keys DIR (infer-keygen makes them)",
            )
        return None, None
    authorized = AuthorizedKeys.from_options(
        config.authorized_keys, workers=config.worker_keys, clients=config.client_keys, admins=config.admin_keys
    )
    return CurveKeys.server(config.curve_secret_key), authorized


def _warn_missing_roles(authorized: AuthorizedKeys) -> None:
    """A role no key holds yet: say what that means (the folders are re-read, so keys may come later)."""
    held = {role for roles in map(authorized.roles_of, authorized.keys) for role in roles}
    if Role.WORKER not in held:
        log.warning("no worker keys yet: no worker can register until one is added")
    if Role.ADMIN not in held:
        log.info(
            "no admin keys: pause, suspend, resume and stop are refused to every peer (signals still stop "
            "the coordinator)"
        )


def _user_id(frame: zmq.Frame) -> bytes | None:
    """The ZAP User-Id of the connection `frame` came on (the KeyGate sets the peer's public key)."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # no such property: the connection was not authenticated
        return None
    return user.encode() if isinstance(user, str) else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


_SECURITY = ("curve_secret_key", "authorized_keys", "worker_keys", "client_keys", "admin_keys", "trusted_network")


def build_parser() -> argparse.ArgumentParser:
    """The flags of every CoordinatorConfig field (coordinator/config.py declares them), and logging's."""
    p = argparse.ArgumentParser(prog="infer-coordinator", description="The infer cluster's coordinator.")
    add_options(p, CoordinatorConfig, exclude=_SECURITY)
    add_options(
        p.add_argument_group("security (CurveZMQ: encrypted, and only known keys get in)"),
        CoordinatorConfig,
        names=_SECURITY,
    )
    add_logging_args(p)
    return p


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    return CoordinatorConfig(**given(CoordinatorConfig, args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"infer-coordinator: {e}", file=sys.stderr)
        return 2
    try:
        daemon = CoordinatorDaemon(config)
    except ValueError as e:  # a bad key file, an unprotected non-loopback bind, traces without the SDK
        print(f"infer-coordinator: {e}", file=sys.stderr)
        return 2
    except zmq.ZMQError as e:
        print(f"infer-coordinator: cannot bind {config.endpoint}: {e}", file=sys.stderr)
        return 1
    return daemon.run()


if __name__ == "__main__":
    sys.exit(main())
