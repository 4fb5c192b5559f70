"""infer-worker as a real process against a stand-in coordinator: a real zmq ROUTER on loopback speaking the
real protocol. Greedy streams are compared token for token (and text) with an in-process Engine."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from infer.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Control,
    ControlAck,
    Delta,
    Dispatch,
    DrainMoves,
    Error,
    Heartbeat,
    Hello,
    Load,
    Message,
    Refused,
    RequestSpec,
    StepBatch,
    TokenIds,
    Welcome,
    decode,
    encode,
)
from infer.protocol.sampling import SamplingParams
from infer.protocol.transport import frames_for, make_socket

WAIT = 20.0  # upper bound of any single wait; the happy paths take a fraction of it
STARTUP = 120.0  # a worker's first Hello: torch's import and the model's load, on a 2-core machine under a full suite
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000"]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
PROMPTS = [
    "The lighthouse keeper climbed the stairs",
    "Bread needs flour, water and salt",
    [5, 17, 300, 2048, 9, 77, 1000],
]


class Coordinator:
    """Stand-in coordinator: a ROUTER bound to a free loopback port, speaking the real codec."""

    def __init__(self, port: int | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER)
        self.sock.bind(f"tcp://127.0.0.1:{port or '*'}")
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(self.address.rsplit(":", 1)[1])
        self.peer: bytes | None = None
        self.loads: list[Load] = []
        self.drains: list[DrainMoves] = []

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(0)
            self.ctx.term()

    def recv(self, timeout: float = WAIT) -> Message:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"nothing from the worker within {timeout} s")
        identity, frame = self.sock.recv_multipart()
        self.peer = identity
        return decode(frame)

    def expect(self, kind: type[Message], timeout: float = WAIT) -> Message:
        """The next message of `kind`, skipping heartbeats and step batches (whose loads are kept); a Hello
        (re-registration after this silent stand-in's quiet spells) is welcomed as a coordinator would."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, StepBatch):
                self.loads.append(msg.load)
            elif isinstance(msg, DrainMoves):  # a drain starting (no KV port here: it names no request to move)
                self.drains.append(msg)
            elif isinstance(msg, Hello):
                self.send(Welcome(coordinator_id="test-coordinator", state="running"))
            elif not isinstance(msg, Heartbeat):
                pytest.fail(f"expected {kind.TYPE}, got {msg}")

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(frames_for(msg, self.peer))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart([self.peer, *frames])

    def welcome(self) -> Hello:
        hello = self.expect(Hello, STARTUP)
        self.send(Welcome(coordinator_id="test-coordinator", state="running"))
        return hello

    def deltas_until_finished(self, request_ids: list[str], timeout: float = WAIT) -> dict[str, list[Delta]]:
        """Every delta of `request_ids` until each has finished (as often as the id is listed), in order."""
        deltas: dict[str, list[Delta]] = {rid: [] for rid in request_ids}
        deadline = time.monotonic() + timeout

        def finished(rid: str) -> bool:
            return sum(d.finished for d in deltas[rid]) >= request_ids.count(rid)

        while not all(map(finished, request_ids)):
            batch = self.expect(StepBatch, max(0.0, deadline - time.monotonic()))
            self.loads.append(batch.load)
            for delta in batch.deltas:
                deltas.setdefault(delta.request_id, []).append(delta)
        return deltas

    def run(self, dispatches: list[Dispatch]) -> dict[str, list[Delta]]:
        for d in dispatches:
            self.send(d)
        return self.deltas_until_finished([d.request_id for d in dispatches])


def dispatch(request_id: str, prompt: str | list[int], resumed: list[int] = (), **sampling) -> Dispatch:
    text = prompt if isinstance(prompt, str) else None
    ids = TokenIds(prompt) if not isinstance(prompt, str) else None
    return Dispatch(
        request_id=request_id,
        spec=RequestSpec(sampling=SamplingParams(**sampling), prompt=text, prompt_token_ids=ids),
        resumed_token_ids=TokenIds(resumed),
    )


class WorkerProcess:
    def __init__(self, coordinator: str, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - the process writes to it until kill()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "infer.worker.service.daemon",
                "--coordinator",
                coordinator,
                "--worker-id",
                "w-test",
                *args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout: float = WAIT) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


@pytest.fixture
def spawn(tmp_path):
    """spawn(coordinator_address, *args) -> a running WorkerProcess, killed at teardown."""
    started: list[WorkerProcess] = []

    def start(address: str, *args: str) -> WorkerProcess:
        worker = WorkerProcess(address, list(args), tmp_path / f"worker{len(started)}.log")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def coordinator():
    coord = Coordinator()
    yield coord
    coord.close()


def joined(deltas: list[Delta]) -> tuple[list[int], str]:
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


# ---- one real-model worker shared by the serving tests ---------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    """The in-process oracle: the same engine options as the worker."""
    from infer.worker.engine.config import EngineConfig
    from infer.worker.engine.engine import Engine

    return Engine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000))


def run_in_process(engine, request_id: str, prompt, params: SamplingParams, resumed=()) -> tuple[list, list, str]:
    """(prompt ids, the deltas' token ids per step, the deltas' texts per step) of one request, run alone."""
    request = engine.add_request(request_id, prompt, params, resumed)
    steps, texts = [], []
    while engine.has_unfinished():
        for out in engine.step():
            steps.append(out.token_ids)
            texts.append(out.text)
    return request.prompt_token_ids, steps, texts


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """(coordinator, Hello, worker) with a registered real-model worker."""
    coord = Coordinator()
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    worker = WorkerProcess(
        coord.address,
        [*ENGINE_ARGS, "--model", str(model_dir), "--dp-rank", "2", "--heartbeat-interval", "0.5", "--threads", "1"],
        log_path,
    )
    try:
        hello = coord.welcome()
        yield coord, hello, worker
    finally:
        worker.kill()
        coord.close()


def test_registration_hello_and_ready_line(served, engine, model_dir):
    coord, hello, worker = served
    assert (hello.role, hello.peer_id, hello.model_id) == ("worker", "w-test", str(model_dir))
    assert (hello.dp_rank, hello.group_id, hello.running) == (2, "dp2", [])
    assert (hello.num_kv_blocks, hello.block_size) == (engine.num_kv_blocks, 16)
    assert (hello.max_num_seqs, hello.max_model_len) == (256, 256)
    beat = coord.expect(Heartbeat, timeout=3)  # idle: heartbeats every 0.5 s, with the load
    assert beat.load == Load(
        num_waiting=0,
        num_running=0,
        num_free_blocks=hello.num_kv_blocks,
        num_total_blocks=hello.num_kv_blocks,
        num_queued_tokens=0,
    )
    ready = [line for line in worker.log.splitlines() if "worker ready" in line]
    assert len(ready) == 1 and "rank 2" in ready[0] and "group dp2" in ready[0] and coord.address in ready[0]


def test_greedy_streams_match_the_in_process_engine(served, engine):
    coord, _, _ = served
    got = coord.run([dispatch(f"g{i}", p, **GREEDY) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        prompt_ids, steps, texts = run_in_process(engine, f"ref-g{i}", prompt, SamplingParams(**GREEDY))
        deltas = got[f"g{i}"]
        assert joined(deltas) == ([t for s in steps for t in s], "".join(texts))
        echo = prompt_ids if isinstance(prompt, str) else None  # the first delta echoes a text prompt's ids
        assert deltas[0].prompt_token_ids == echo
        assert all(d.prompt_token_ids is None for d in deltas[1:])
        assert deltas[-1].finish_reason in ("stop", "length") and deltas[-1].num_prompt_tokens == len(prompt_ids)


def test_resumed_dispatch_continues_the_greedy_stream(served, engine):
    coord, _, _ = served
    params = {"temperature": 0.0, "max_tokens": 14, "ignore_eos": True}
    prompt_ids, steps, texts = run_in_process(engine, "ref-full", PROMPTS[0], SamplingParams(**params))
    full = [t for s in steps for t in s]
    k = 6  # a dead worker delivered the first k tokens (and their text)
    deltas = coord.run(
        [dispatch("resumed", prompt_ids, resumed=full[:k], temperature=0.0, max_tokens=14, ignore_eos=True)]
    )["resumed"]  # the resumed tokens count toward max_tokens
    tokens, text = joined(deltas)
    assert tokens == full[k:]
    assert "".join(texts[:k]) + text == "".join(texts)
    assert deltas[0].prompt_token_ids is None  # token ids were sent: no echo
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_prompt_tokens == len(prompt_ids)


def test_abort_frees_the_kv_blocks_at_once(served):
    """The coordinator forgets a request before it aborts it: the worker frees the blocks at once, reports the
    load, and sends no final delta (so the id may come back at once, say re-dispatched after a restart)."""
    coord, hello, _ = served
    coord.send(dispatch("long", PROMPTS[1], temperature=0.0, max_tokens=200, ignore_eos=True))
    first = coord.expect(StepBatch)
    assert first.load.num_free_blocks < first.load.num_total_blocks == hello.num_kv_blocks
    coord.send(Abort(request_ids=["long", "never-dispatched"]))
    deltas = []
    while True:
        batch = coord.expect(StepBatch, timeout=5)
        deltas += batch.deltas
        if batch.load.num_free_blocks == hello.num_kv_blocks and batch.load.num_running == 0:
            break
    # freed long before its 200 tokens (and in well under the 5 s a StepBatch may take), with no final delta
    assert not any(d.finished for d in deltas) and sum(len(d.token_ids) for d in deltas) < 200
    coord.send(dispatch("long", PROMPTS[1], **GREEDY))  # the same id again, at once
    again = coord.deltas_until_finished(["long"], timeout=WAIT)["long"]
    assert again[-1].finish_reason == "length" and sum(len(d.token_ids) for d in again) == GREEDY["max_tokens"]


def test_bad_dispatches_fail_alone(served, engine):
    coord, _, _ = served
    good = dispatch("ok", PROMPTS[2], **GREEDY)
    bad = [
        dispatch("oov", [1, 2, 10**6], **GREEDY),
        dispatch("too-long", [7] * 300, **GREEDY),
        dispatch("ok", PROMPTS[0], **GREEDY),
    ]  # a duplicate of a running id
    got = coord.run([good, *bad])
    assert "outside the vocabulary" in got["oov"][-1].error
    assert "context length is 256" in got["too-long"][-1].error
    errors = [d for d in got["ok"] if d.finish_reason == "error"]
    assert len(errors) == 1 and "already running" in errors[0].error
    for rid in ("oov", "too-long"):
        assert len(got[rid]) == 1 and got[rid][0].finish_reason == "error" and got[rid][0].token_ids == []
    _, steps, _ = run_in_process(engine, "ref-ok", PROMPTS[2], SamplingParams(**GREEDY))
    normal = [d for d in got["ok"] if d.finish_reason != "error"]
    assert joined(normal)[0] == [t for s in steps for t in s] and normal[-1].finished


def test_garbage_frames_get_errors_and_serving_goes_on(served):
    coord, _, worker = served
    bad_sampling = msgpack.packb(
        {
            "type": "dispatch",
            "v": PROTOCOL_VERSION,
            "body": {"request_id": "bad-sampling", "spec": {"sampling": {"temperature": -1}, "prompt": "hi"}},
        }
    )
    cases = [
        (b"\xc1garbage", "not valid msgpack"),
        (msgpack.packb([1, 2]), "exactly 'type', 'v' and 'body'"),
        (msgpack.packb({"type": "nope", "v": PROTOCOL_VERSION, "body": {}}), "unknown message type 'nope'"),
        (msgpack.packb({"type": "abort", "v": 99, "body": {}}), "schema version 99"),
        (encode(Delta(request_id="x", token_ids=TokenIds(), text="")), "does not handle 'delta'"),
        # issue 43: nesting 1,000 deep made decode raise RecursionError, which ended the worker
        (b"\x83\xa4type\xa8dispatch\xa1v\x04\xa4body" + b"\x91" * 1000 + b"\x80", "nesting deeper than 32 levels"),
    ]
    for frame, _ in cases:
        coord.send_raw(frame)
    coord.send_raw(b"two", b"frames")
    for _, expected in cases:
        assert expected in coord.expect(Error, timeout=5).message
    assert "one frame per message" in coord.expect(Error, timeout=5).message
    coord.send_raw(bad_sampling)
    rejected = coord.deltas_until_finished(["bad-sampling"], timeout=5)["bad-sampling"]
    assert rejected[-1].finish_reason == "error" and "temperature must be >= 0" in rejected[-1].error
    got = coord.run([dispatch("after-garbage", PROMPTS[0], **GREEDY)])
    assert got["after-garbage"][-1].finish_reason in ("stop", "length")
    assert worker.proc.poll() is None


# ---- lifecycle: separate processes ----------------------------------------------------------------


def test_sigterm_drains_running_requests_then_exits_0(coordinator, spawn, model_dir):
    worker = spawn(coordinator.address, *ENGINE_ARGS, "--model", str(model_dir), "--threads", "1")
    coordinator.welcome()
    long = {"temperature": 0.0, "max_tokens": 120, "ignore_eos": True}
    coordinator.send(dispatch("d1", PROMPTS[0], **long))
    coordinator.send(dispatch("d2", PROMPTS[1], **long))
    # Both run before the signal: on a loaded machine the worker can step d1 before it has read d2's Dispatch,
    # which the drain would then refuse as a late one
    first: list[Delta] = []
    while {"d1", "d2"} - {d.request_id for d in first}:
        first += coordinator.expect(StepBatch).deltas
    worker.proc.send_signal(signal.SIGTERM)
    coordinator.send(dispatch("late", PROMPTS[2], **GREEDY))
    got = coordinator.deltas_until_finished(["d1", "d2", "late"])
    assert got["late"][-1].finish_reason == "error" and got["late"][-1].error_code == "draining"
    for rid in ("d1", "d2"):
        deltas = [d for d in first if d.request_id == rid] + got[rid]
        assert deltas[-1].finish_reason == "length" and len(joined(deltas)[0]) == 120, (deltas[-1], worker.log)
    assert worker.wait() == 0
    assert "draining" in worker.log
    assert coordinator.drains == [DrainMoves(request_ids=[])]  # the coordinator heard it drain at once


def test_benchmark_mode_tokens_and_stop(coordinator, spawn):
    worker = spawn(coordinator.address, "--benchmark-mode", "--max-num-seqs", "2")
    hello = coordinator.welcome()
    assert hello.model_id == "SmolLM2-135M-Instruct" and hello.max_num_seqs == 2
    got = coordinator.run(
        [
            dispatch("b1", [9] * 5, max_tokens=7),
            dispatch("b2", "héllo", max_tokens=3),
            dispatch("b3", [9] * 5, resumed=[5, 6], max_tokens=5),
        ]
    )
    assert joined(got["b1"]) == ([5, 6, 7, 8, 9, 10, 11], "")
    assert joined(got["b2"]) == ([6, 7, 8], "") and got["b2"][0].prompt_token_ids == list("héllo".encode())
    assert joined(got["b3"]) == ([7, 8, 9], "") and got["b3"][0].prompt_token_ids is None
    assert all(got[r][-1].finish_reason == "length" for r in got)
    coordinator.send(Error(message="unknown worker 'w-test'"))  # a coordinator that forgot this worker
    assert coordinator.expect(Hello, timeout=5).peer_id == "w-test"
    coordinator.send(Control(command="stop"))
    assert coordinator.expect(ControlAck) == ControlAck(command="stop", state="stopped")
    assert worker.wait() == 0


def test_a_request_waiting_past_max_queue_time_fails_as_overloaded_and_the_running_one_goes_on(coordinator, spawn):
    worker = spawn(
        coordinator.address,
        "--benchmark-mode",
        "--max-num-seqs",
        "1",
        "--benchmark-step-time",
        "0.02",
        "--max-queue-time",
        "0.5",
    )
    coordinator.welcome()
    started = time.monotonic()
    got = coordinator.run([dispatch("runs", [1, 2], max_tokens=100), dispatch("waits", [1, 2], max_tokens=2)])
    shed = got["waits"][-1]
    assert (shed.finish_reason, shed.error_code, shed.token_ids) == ("error", "overloaded", [])
    elapsed = time.monotonic() - started
    assert "--max-queue-time 0.5 s" in shed.error and shed.queue_time_s >= 0.5
    assert joined(got["runs"])[0] == [(2 + i) % 1000 for i in range(100)]  # the running one is untouched
    # 100 steps of 0.02 s (longer on a loaded machine, and so is the run): its turn came only after them, it was
    # shed long before (a ratio of the run's own time, not a clock bound)
    assert elapsed >= 2.0 and shed.queue_time_s < 0.75 * elapsed
    coordinator.send(Control(command="stop"))
    assert worker.wait() == 0


def test_heartbeats_go_on_during_a_long_engine_step_and_say_its_age(coordinator, spawn):
    worker = spawn(
        coordinator.address,
        "--benchmark-mode",
        "--benchmark-step-time",
        "1.5",
        "--heartbeat-interval",
        "0.2",
        "--coordinator-timeout",
        "15",
    )  # this stand-in never beats
    coordinator.welcome()
    coordinator.send(dispatch("slow", [1, 2, 3], max_tokens=2))
    ages, deltas, deadline = [], [], time.monotonic() + WAIT
    while not any(d.finished for d in deltas):
        msg = coordinator.recv(max(0.0, deadline - time.monotonic()))
        if isinstance(msg, Heartbeat) and msg.step_age_s is not None:
            assert msg.load is not None  # an unknown coordinator must still tell a worker's heartbeat
            ages.append(msg.step_age_s)
        elif isinstance(msg, StepBatch):
            deltas += msg.deltas
        else:
            assert not isinstance(msg, Hello), "registered again"
    assert [t for d in deltas for t in d.token_ids] == [3, 4]
    assert len(ages) >= 4 and max(ages) >= 1.0 and all(0 < a < 2.0 for a in ages)  # ~every 0.2 s in each step
    coordinator.send(Control(command="stop"))
    assert coordinator.expect(ControlAck).state == "stopped"
    assert worker.wait() == 0


def test_refused_exits_3_with_the_reason(coordinator, spawn):
    worker = spawn(coordinator.address, "--benchmark-mode")
    coordinator.expect(Hello)
    coordinator.send(Refused(reason="model mismatch: cluster serves other-model"))
    assert worker.wait() == 3
    assert "model mismatch: cluster serves other-model" in worker.log


def test_no_coordinator_exits_1_after_connect_timeout(spawn):
    probe = Coordinator()  # a free port with nobody listening once closed
    address = probe.address
    probe.close()
    worker = spawn(address, "--benchmark-mode", "--connect-timeout", "0.5")
    assert worker.wait() == 1
    assert "no Welcome" in worker.log


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-size", "0"], "block_size must be a positive integer"),
        (["--dtype", "int3"], "invalid choice"),
        (["--heartbeat-interval", "5", "--coordinator-timeout", "2"], "must exceed heartbeat_interval"),
        (["--max-queue-time", "-1"], "max_queue_time must be in [0, 86400] s (0: no bound), got -1.0"),
        (["--ep-size", "0"], "--ep-size must be >= 1"),
        (["--ep-rank", "1"], "--ep-rank and --dist-init need --ep-size > 1"),
        (["--ep-size", "2", "--ep-rank", "2", "--dist-init", "tcp://127.0.0.1:9"], "--ep-rank must be in [0, 2)"),
        (["--ep-size", "2", "--ep-rank", "0", "--dist-init", "127.0.0.1:9"], "--dist-init must be tcp://HOST:PORT"),
        (["--ep-size", "2", "--ep-rank", "0"], "needs --dist-init"),
        (
            ["--ep-size", "2", "--ep-rank", "0", "--dist-init", "tcp://127.0.0.1:9", "--benchmark-mode"],
            "--benchmark-mode has no model, so no EP group",
        ),
    ],
)
def test_bad_options_exit_2_with_the_message(spawn, args, message):
    worker = spawn("tcp://127.0.0.1:9", *args)
    assert worker.wait() == 2
    assert message in worker.log


def test_coordinator_restart_gets_a_new_hello_with_running_ids(coordinator, spawn):
    worker = spawn(coordinator.address, "--benchmark-mode", "--heartbeat-interval", "0.2", "--coordinator-timeout", "1")
    coordinator.welcome()
    coordinator.send(Control(command="pause"))
    assert coordinator.expect(ControlAck).state == "paused"
    coordinator.send(dispatch("kept", [1, 2, 3], max_tokens=5))
    port = coordinator.port
    coordinator.close()
    restarted = Coordinator(port)  # silent: the worker must notice and register again
    try:
        hello = restarted.expect(Hello, timeout=10)
        assert hello.running == ["kept"]
        restarted.send(Welcome(coordinator_id="restarted", state="running"))
        restarted.send(Control(command="unpause"))
        assert restarted.expect(ControlAck).state == "running"
        got = restarted.deltas_until_finished(["kept"])
        assert joined(got["kept"]) == ([3, 4, 5, 6, 7], "")
        assert "re-registered" in worker.log
    finally:
        restarted.close()
