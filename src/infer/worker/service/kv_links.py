"""The KV sockets of a worker with --kv-transfer-config (the I/O of worker/kv/transfer.py; its decisions are
WorkerCore's). A producer's hand-offs and a drain's moves send the same way; "consumer" below is whoever receives.

- Every such worker binds a ROUTER (`kv_port`, 0: one the OS chooses) and says where in its Hello (`kv_address`). With
  keys it is a CURVE server under the worker's own key pair, and lets in only that public key: the producers of a
  cluster made with `infer-keygen --cluster` share the workers' one key pair (a producer under another key fails the
  handshake, its transfer times out and its requests are recomputed on the consumer: never served unauthenticated
  KV).
- A sender opens one DEALER per consumer address (lazily; with keys a CURVE client towards the consumer's key,
  which the coordinator vouched for in the Dispatch). Blocks go only after the consumer's KvWant (it is alive), so a
  dead consumer has only an offer queued towards it; at most _SNDHWM frames queue per consumer in zmq, and the frames
  past those wait here, in order (two long prompts' blocks handed off at once fill it): each flush sends what fits
  and drops the frames of transfers that ended meanwhile.
- Shared memory (`kv_shm_dir`, /dev/shm by default): a producer's offer names a probe file of its own there and the
  random token it holds; a consumer that reads that token there (the same host and mounts, a user allowed to read the
  producer's 0600 files) says so, and the producer writes each frame's payloads to a file there instead of sending
  them: the frame carries the path and the checksums, the consumer reads, deletes and checks the file; the producer
  deletes what is left of a transfer's files (its probe too) when the transfer ends. A consumer reads only files named
  as a producer names them, in its own `kv_shm_dir`. Left behind only by a producer killed mid-transfer whose
  consumer never read the frame (at most the frames of the transfers in flight, each at most 32 MiB).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import zmq

from infer.protocol.keys import CurveKeys
from infer.protocol.logsafe import RateLimitedLog
from infer.protocol.messages import Message
from infer.protocol.transport import KeyGate, frames_for, make_socket
from infer.worker.service.core import WorkerCore

log = logging.getLogger("infer.kv_transfer")

_SNDHWM = 16  # frames (each up to 32 MiB) queued towards one consumer


_SHM_NAME = re.compile(r"infer-kv-[0-9a-f]{16}\.[0-9]+(\.probe)?")


class ShmArea:
    """This worker's files in a shared-memory directory (see the module docstring); worker/kv/transfer.py's
    SharedMemory."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.prefix = f"infer-kv-{secrets.token_hex(8)}"
        self._count = 0
        self._files: set[str] = set()

    def new_probe(self) -> tuple[str, str]:
        """A probe file for one transfer's offer and the random token in it (removed with the transfer's files)."""
        self._count += 1
        token = secrets.token_hex(16)
        return self._create(f"{self.prefix}.{self._count}.probe", [token.encode()]), token

    def _create(self, name: str, parts: Sequence[bytes]) -> str:
        path = str(self.dir / name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        self._files.add(path)
        return path

    def _ours_to_read(self, path: str) -> bool:
        """A name a producer gives, in this directory (nothing else is ever opened for a peer)."""
        where = Path(path)
        return where.parent == self.dir and _SHM_NAME.fullmatch(where.name) is not None

    def sees(self, path: str, token: str) -> bool:
        if not self._ours_to_read(path) or not path.endswith(".probe"):
            return False
        try:
            with open(path, "rb") as f:
                held = f.read(64)
        except OSError:
            return False
        return hmac.compare_digest(held, token.encode())

    def write(self, payloads: Sequence[bytes]) -> str:
        self._count += 1
        return self._create(f"{self.prefix}.{self._count}", payloads)

    def read(self, path: str, size: int) -> bytes | None:
        if not self._ours_to_read(path) or path.endswith(".probe"):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != size:
                return None
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(size)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(data) != size:
            return None
        try:  # read once: gone now, even if its producer dies before its transfer ends (best effort: our user's)
            os.unlink(path)
        except OSError:
            pass
        return data

    def remove(self, path: str) -> None:
        self._files.discard(path)
        try:
            os.unlink(path)
        except OSError:
            pass

    def close(self) -> None:
        for path in list(self._files):
            self.remove(path)


class KvLinks:
    """A worker's KV sockets: the consumer's ROUTER or the producer's DEALERs (see the module docstring)."""

    def __init__(self, core: WorkerCore, curve: CurveKeys | None, host: str, poller: zmq.Poller) -> None:
        self.core, self.curve, self.poller = core, curve, poller
        self.ctx = zmq.Context()
        self._gate: KeyGate | None = None
        self.server: zmq.Socket | None = None
        self.links: dict[tuple[str, str], zmq.Socket] = {}
        # a producer's frames that did not fit in their link's queue yet, by (address, key): sent by a later flush
        self._backlog: dict[tuple[str, str], deque[Message]] = {}
        self._warn = RateLimitedLog(log)
        self.shm: ShmArea | None = None
        shm_dir = core.options.kv.kv_shm_dir
        if shm_dir and os.path.isdir(shm_dir):
            self.shm = ShmArea(Path(shm_dir))
            for end in (core.kv_sender, core.kv_receiver):
                if end is not None:
                    end.shm = self.shm
        if core.kv_receiver is not None:
            self._bind(host, core.options.kv.kv_port)

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
        log.info("KV socket (%s) at %s", self.core.options.kv.kv_role, self.core.kv_address)

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
        self.receive_answers([sock for sock in self.links.values() if sock in events])

    def receive_answers(self, links: Sequence[zmq.Socket] | None = None, during_step: bool = False) -> None:
        """Every consumer's answer waiting on `links` (None: every link; `during_step`: from the worker's heartbeat
        thread while the engine steps, see WorkerCore.on_kv_answer)."""
        for sock in list(self.links.values()) if links is None else links:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.core.on_kv_answer(frames, time.monotonic(), during_step)

    def flush(self) -> None:
        """What the core queued: a consumer's answers, a producer's frames."""
        if self.server is not None:
            for peer, msg in self.core.take_kv_replies():
                try:
                    self.server.send_multipart(frames_for(msg, peer), zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError):  # the producer is gone: its transfer times out there
                    self._warn.warning("a KV answer could not be sent to its producer (gone)")
        for address, key, msg in self.core.take_kv_outgoing():
            self._backlog.setdefault((address, key), deque()).append(msg)
        sender = self.core.kv_sender
        for link, queued in list(self._backlog.items()):
            while queued:
                msg = queued[0]
                if sender is not None and getattr(msg, "transfer_id", None) not in sender.transfers:
                    queued.popleft()  # its transfer ended meanwhile (timed out, refused, cancelled)
                    continue
                try:
                    self._link(*link).send_multipart(frames_for(msg), zmq.NOBLOCK)
                except zmq.Again:  # the link's queue is full (SNDHWM frames): the rest waits, in order
                    break
                except zmq.ZMQError as e:  # the transfer times out
                    self._warn.warning("a KV frame to %s was not sent (%s); its transfer will time out", link[0], e)
                queued.popleft()
            if not queued:
                del self._backlog[link]

    @property
    def backlogged(self) -> bool:
        """Frames wait for room in a link's queue (the shell then polls often: `flush` sends them)."""
        return bool(self._backlog)

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
        if self.shm is not None:
            self.shm.close()
