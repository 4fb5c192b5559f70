"""Ports nobody else can take: the one helper for choosing a port (launchers, tests, benchmarks). Torch-free.

"Pick a free port, close it, pass the number on" races: between the close and the bind of whoever gets the number,
another process (another test, another run on the same machine) can take the port. So, in order of preference:

- The OS chooses and the chooser holds: a socket bound to port 0 and kept open, handed over as the socket itself
  or its fd (`listening_socket`; infer-serve passes its coordinator's with `--listen-fd` and its HTTP front's the
  same way), or a server that binds port 0 itself and says which port it got: ZeroMQ's `bind_to_random_port`
  (`infer-coordinator --port 0`, whose log's "listening on" line names it) and torch's
  `TCPStore(host, 0, is_master=True)` then `.port` (`tcp_store` in tests/ports.py).
- Where a number must be known before the process that binds it exists (a coordinator started with --port and
  restarted on it, torchrun's --master-port, the --dist-init of ranks started apart), `reserved_port`: a port
  below the kernel's ephemeral range, which no bind to port 0 and no outgoing connection on this machine is ever
  given, locked for this process (a lock file held until it exits) so that no other user of this helper picks it.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import IO

LOOPBACK = "127.0.0.1"
LOWEST_RESERVED = 10000  # reserved ports are drawn from [LOWEST_RESERVED, the ephemeral range's start)
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_held: list[IO[bytes]] = []  # the lock files of this process's reserved ports, open until it exits


def listening_socket(
    host: str = LOOPBACK, port: int = 0, *, backlog: int = 128, inheritable: bool = False
) -> socket.socket:
    """A TCP socket listening on host:port, port 0 (the default) a port the OS chose (`bound_port`); the caller
    keeps it open for as long as the port must stay its own, and passes the socket (or its fd, when `inheritable`)
    to whoever serves on it. OSError naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT from a last run
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(inheritable)
    return sock


def bound_port(sock: socket.socket) -> int:
    """The port `sock` is bound to."""
    return int(sock.getsockname()[1])


def reserved_port(host: str = LOOPBACK, tries: int = 256) -> int:
    """A port for a process that must be told its number before it starts (module doc): outside the ephemeral
    range, bindable now, and locked for this process until it exits. OSError when none is found in `tries`."""
    lock_dir = Path(tempfile.gettempdir()) / "infer-ports"
    lock_dir.mkdir(exist_ok=True)
    candidates = range(LOWEST_RESERVED, _ephemeral_start())
    for port in random.sample(candidates, min(tries, len(candidates))):
        lock = _try_lock(lock_dir / f"{port}.lock")
        if lock is None:
            continue  # another process (of this machine's runs) holds it
        if _bindable(host, port):
            _held.append(lock)
            return port
        lock.close()
    raise OSError(f"no port in {candidates.start}..{candidates.stop - 1} could be reserved on {host}")


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _try_lock(path: Path) -> IO[bytes] | None:
    """`path` opened and exclusively locked (flock: released when this process exits), or None if it is held."""
    lock = open(path, "ab")  # noqa: SIM115 - held open on purpose: the lock lives as long as the file is open
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    os.set_inheritable(lock.fileno(), False)
    return lock


def _bindable(host: str, port: int) -> bool:
    """Nothing listens on host:port now (a program that binds that number explicitly, such as a default 5555)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def check_listening_fd(fd: int, port: int) -> None:
    """ValueError, in words, unless `fd` is a listening TCP socket bound to `port` (what `--listen-fd` hands a
    coordinator: ZeroMQ aborts the process on a descriptor that is not open, and serves nothing on one that is
    not a listening socket)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError as e:
        raise ValueError(f"--listen-fd {fd} is not an open socket: {e.strerror or e}") from None
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            raise ValueError(f"--listen-fd {fd} is not a TCP socket")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ValueError(f"--listen-fd {fd} is a TCP socket that is not listening")
        if bound_port(sock) != port:
            raise ValueError(f"--listen-fd {fd} is bound to port {bound_port(sock)}, not --port {port}")
