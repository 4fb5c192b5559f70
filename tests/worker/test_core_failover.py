"""A worker with several coordinators (docs/architecture.md, "Several coordinators"): the core's choice of address
frame by frame (tests/worker_harness.py: a Redirect moves it to the leader, or the next address; a Welcome below the
term it followed is not followed; silence, an unanswered Hello or a broken connection move it on; its Hello carries
its running requests), the address list's validation, and the shell's socket work against stand-in coordinators on
loopback (the same DEALER leaves one for the other)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from infer.protocol.messages import Control, Hello, Message, Redirect, StepBatch, Welcome, decode, encode
from infer.protocol.transport import make_socket
from infer.worker.engine.config import EngineConfig
from infer.worker.service.benchmark_engine import BenchmarkEngine
from infer.worker.service.core import ATTEMPT_S, SWITCH_BACKOFF_S
from infer.worker.service.daemon import Worker
from infer.worker.service.options import WorkerOptions
from tests.worker_harness import WorkerHarness, dispatch, of_type

A, B, C = "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002", "tcp://127.0.0.1:7003"
THREE = f"{A},{B},{C}"


def welcome(h: WorkerHarness, term: int, instance: str = "c1") -> list[Message]:
    return h.send(Welcome(coordinator_id="c", state="running", instance=instance, dp_rank=0, group_id="dp0", term=term))


@pytest.fixture
def h() -> WorkerHarness:
    harness = WorkerHarness(coordinator=THREE)
    assert of_type(harness.out(), Hello)
    welcome(harness, term=1)
    return harness


def test_the_address_list_is_read_in_order_and_one_address_stays_as_it_was():
    assert WorkerOptions(coordinator=THREE, worker_id="w").coordinators == (A, B, C)
    assert WorkerOptions(coordinator=f" {A} , {B} ", worker_id="w").coordinators == (A, B)
    assert WorkerOptions(coordinator=A, worker_id="w").coordinators == (A,)
    assert WorkerOptions(coordinator="ipc:///tmp/c", worker_id="w").coordinators == ("ipc:///tmp/c",)


@pytest.mark.parametrize(
    "value, message",
    [
        (f"{A},,{C}", "entry 2 of .* is empty"),
        (f"{A},", "entry 2 of .* is empty"),
        (f"{A},127.0.0.1:7002", "entry 2, '127.0.0.1:7002', is not tcp://HOST:PORT"),
        (f"{A},{A}", "names an address twice"),
        (",".join(f"tcp://h:{p}" for p in range(1, 17)), "at most 15 coordinators"),
        ("127.0.0.1:7001", "--coordinator must be tcp://HOST:PORT"),
    ],
)
def test_a_bad_address_list_is_refused_naming_the_entry(value, message):
    with pytest.raises(ValueError, match=message):
        WorkerOptions(coordinator=value, worker_id="w")


def test_a_redirect_registers_at_the_leader_it_names_after_a_short_backoff(h):
    h.send(dispatch("r1", max_tokens=50))
    h.step()
    h.step()
    assert h.send(Redirect(reason="not the leader", leader=C)) == []
    assert h.core.take_reconnect() is None
    assert not of_type(h.advance(SWITCH_BACKOFF_S / 2), Hello)
    hello = of_type(h.advance(SWITCH_BACKOFF_S), Hello)
    assert h.core.take_reconnect() == C and h.core.coordinator == C
    # the running request goes with it, as after a coordinator restart
    assert len(hello) == 1 and hello[0].running == ["r1"]
    assert hello[0].snapshots[0].request_id == "r1" and len(hello[0].snapshots[0].token_ids) >= 1
    assert h.engine.has_unfinished()  # it kept running meanwhile
    # the Redirects answering the frames sent before the move make no second move
    h.send(Redirect(reason="not the leader", leader=C))
    welcome(h, term=2, instance="c3")
    assert not of_type(h.advance(SWITCH_BACKOFF_S * 2), Hello) and h.core.take_reconnect() is None
    assert h.core.term == 2


def test_a_redirect_without_a_leader_moves_to_the_next_address_and_on_around_the_list(h):
    h.send(Redirect(reason="no leader yet"))
    assert of_type(h.advance(SWITCH_BACKOFF_S), Hello) and h.core.take_reconnect() == B
    h.send(Redirect(reason="no leader yet"))
    assert of_type(h.advance(SWITCH_BACKOFF_S), Hello) and h.core.take_reconnect() == C
    h.send(Redirect(reason="no leader yet"))
    assert of_type(h.advance(SWITCH_BACKOFF_S), Hello) and h.core.take_reconnect() == A


def test_a_welcome_below_the_term_followed_is_not_followed(h):
    h.send(Redirect(reason="deposed", leader=B))
    h.advance(SWITCH_BACKOFF_S)
    assert h.core.take_reconnect() == B
    welcome(h, term=0, instance="old")  # a deposed leader that has not noticed yet
    assert h.core.term == 1
    hello = of_type(h.advance(SWITCH_BACKOFF_S), Hello)
    assert hello and h.core.take_reconnect() == C
    welcome(h, term=3, instance="new")
    assert h.core.term == 3
    assert not of_type(h.advance(SWITCH_BACKOFF_S), Hello) and h.core.take_reconnect() is None


def test_silence_moves_to_the_next_address_not_the_same_one(h):
    h.advance(5.0)
    assert h.core.take_reconnect() is None
    hello = of_type(h.advance(5.0), Hello)  # coordinator_timeout: 10 s
    assert hello and h.core.take_reconnect() == B


def test_a_hello_left_unanswered_moves_on_after_the_attempt_time():
    h = WorkerHarness(coordinator=THREE)
    assert of_type(h.out(), Hello) and h.core.coordinator == A
    assert not of_type(h.advance(ATTEMPT_S * 0.9), Hello)
    assert of_type(h.advance(ATTEMPT_S * 0.2), Hello) and h.core.take_reconnect() == B
    assert h.core.poll_timeout(h.now) <= ATTEMPT_S


def test_a_broken_connection_to_the_coordinator_in_use_moves_on_at_once(h):
    h.core.on_connection_lost(B, h.now, connected=True)  # not the one in use
    h.core.on_connection_lost(A, h.now, connected=False)  # a retry while welcomed there: nothing new
    assert not of_type(h.advance(SWITCH_BACKOFF_S), Hello)
    h.core.on_connection_lost(A, h.now, connected=True)
    assert h.core.poll_timeout(h.now) <= SWITCH_BACKOFF_S
    assert of_type(h.advance(SWITCH_BACKOFF_S), Hello) and h.core.take_reconnect() == B


def test_one_address_keeps_the_old_behaviour():
    h = WorkerHarness()
    h.out()
    h.welcome()
    h.core.on_connection_lost("tcp://127.0.0.1:5555", h.now, connected=True)
    assert not of_type(h.advance(ATTEMPT_S), Hello)
    hello = of_type(h.advance(10.0), Hello)  # silence: Hello again, at the same address
    assert hello and h.core.take_reconnect() is None and h.core.coordinator == "tcp://127.0.0.1:5555"


# ---- the shell: one DEALER, moved between stand-in coordinators ------------------------------------------------


class StandIn:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def expect(self, kind: type[Message], timeout: float = 10.0) -> tuple[bytes, Message]:
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            peer, frame = self.sock.recv_multipart()
            msg = decode(frame)
            if isinstance(msg, kind):
                return peer, msg
        raise AssertionError(f"no {kind.__name__} at {self.address} within {timeout} s")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_the_daemon_follows_a_redirect_and_leaves_a_killed_leader_at_once():
    a, b, c = StandIn(), StandIn(), StandIn()
    options = WorkerOptions(
        coordinator=f"{a.address},{b.address},{c.address}",
        worker_id="w",
        coordinator_timeout=30.0,  # far beyond the test: only the socket monitor can tell it in time
        stream_port=-1,
    )
    engine = BenchmarkEngine(EngineConfig(max_num_seqs=4, max_model_len=4096), step_time=0.01)
    worker = Worker(engine, options, zmq.Context())
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        peer, _ = a.expect(Hello)
        a.sock.send_multipart([peer, encode(Redirect(reason="a follower", leader=b.address))])
        peer, _ = b.expect(Hello)
        b.sock.send_multipart([peer, encode(Welcome(coordinator_id="b", state="running", instance="b", term=1))])
        b.sock.send_multipart([peer, encode(dispatch("r1", max_tokens=2000))])
        b.expect(StepBatch)
        started = time.monotonic()
        b.close()  # the leader is gone (as after kill -9): its connection breaks
        peer, hello = c.expect(Hello, timeout=20.0)
        assert time.monotonic() - started < 15.0  # the socket monitor, not the 30 s coordinator timeout
        assert hello.running == ["r1"] and hello.snapshots[0].token_ids
        c.sock.send_multipart([peer, encode(Welcome(coordinator_id="c", state="running", instance="c", term=2))])
        c.sock.send_multipart([peer, encode(Control(command="stop"))])
        thread.join(timeout=10)
        assert not thread.is_alive() and worker.core.term == 2
    finally:
        if thread.is_alive():
            worker.request_drain()
            thread.join(timeout=40)
        for stand_in in (a, c):
            stand_in.close()
