"""protocol/ports.py and tests/ports.py: ports the OS chooses and their owners hold. Many TCPStores, coordinators
(infer-coordinator's `--port 0`) and HTTP listening sockets made at once, from many threads, each get a port of
their own and answer on it: nothing picks a number and hopes it is still free when it is bound."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from ports import bound_port, listening_socket, reserved_port, tcp_store

from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.daemon import CoordinatorDaemon
from infer.protocol.ports import LOWEST_RESERVED, _ephemeral_start

EACH = 16


def _coordinator_port(daemon: CoordinatorDaemon) -> int:
    endpoint = daemon.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    assert endpoint == daemon.config.endpoint  # what it logs as "listening on ..."
    return daemon.config.port


def test_many_stores_coordinators_and_fronts_made_at_once_each_hold_a_port_of_their_own():
    import torch.distributed as dist

    with ThreadPoolExecutor(EACH) as pool:
        stores = list(pool.map(lambda _: tcp_store(), range(EACH)))
        fronts = list(pool.map(lambda _: listening_socket(), range(EACH)))
        coordinators = list(pool.map(lambda _: CoordinatorDaemon(CoordinatorConfig(port=0)), range(EACH)))
    try:
        ports = (
            [s.port for s in stores] + [bound_port(f) for f in fronts] + [_coordinator_port(c) for c in coordinators]
        )
        assert len(set(ports)) == len(ports) == 3 * EACH and 0 not in ports
        for i, store in enumerate(stores):  # each store is the one at its port
            client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
            client.set("who", str(i))
            assert store.get("who") == str(i).encode()
        for front in fronts:  # each front's socket takes connections
            with socket.create_connection(("127.0.0.1", bound_port(front)), timeout=10):
                conn, _ = front.accept()
                conn.close()
    finally:
        for front in fronts:
            front.close()
        for daemon in coordinators:
            daemon.sock.close(linger=0)
            daemon.ctx.term()


def test_a_listening_socket_is_handed_over_open_and_inheritable_only_when_asked():
    with listening_socket() as held, listening_socket(inheritable=True) as passed:
        assert bound_port(held) != bound_port(passed)
        assert not held.get_inheritable() and passed.get_inheritable()


RESERVE = """
import sys
from infer.protocol.ports import reserved_port
print(*(reserved_port() for _ in range(int(sys.argv[1]))))
sys.stdin.read()  # hold them until told to go
"""


def test_reserved_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice_across_processes():
    """Four processes reserve 25 ports each at once (holding them) while this one reserves 25: all 125 differ,
    and none is in the range the kernel gives binds to port 0 and outgoing connections."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESERVE, "25"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    try:
        mine = [reserved_port() for _ in range(25)]
        theirs = [int(p) for proc in procs for p in proc.stdout.readline().split()]
    finally:
        for proc in procs:
            proc.communicate("", timeout=30)
    ports = mine + theirs
    assert len(ports) == len(set(ports)) == 125
    assert all(LOWEST_RESERVED <= p < _ephemeral_start() for p in ports)
    with listening_socket("127.0.0.1", mine[0]) as sock:  # reserved: nothing else holds it, its owner binds it
        assert bound_port(sock) == mine[0]


def test_a_listen_fd_that_is_not_a_listening_socket_on_the_port_is_refused_in_words(tmp_path) -> None:
    from infer.protocol.ports import check_listening_fd

    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    with open(tmp_path / "f", "w") as plain, bound:
        with pytest.raises(ValueError, match="is not an open socket"):
            check_listening_fd(plain.fileno(), 1234)
        with pytest.raises(ValueError, match="that is not listening"):
            check_listening_fd(bound.fileno(), bound.getsockname()[1])
        bound.listen()
        with pytest.raises(ValueError, match=f"is bound to port {bound.getsockname()[1]}, not --port 1"):
            check_listening_fd(bound.fileno(), 1)
        check_listening_fd(bound.fileno(), bound.getsockname()[1])
    # a descriptor that is not open: ZeroMQ aborted the daemon on it ("Bad file descriptor (src/epoll.cpp:73)")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "infer.coordinator.daemon",
            "--host",
            "127.0.0.1",
            "--port",
            "5555",
            "--listen-fd",
            "987",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "--listen-fd 987 is not an open socket" in done.stderr, done.stderr
