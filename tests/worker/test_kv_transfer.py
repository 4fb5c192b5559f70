"""Disaggregated prefill and decode, in pieces: `--kv-transfer-config` and what a KV role refuses (exit 2 naming it),
the transfer's state machine (worker/kv/transfer.py, sans-I/O, against a fake port: offer, want, frames, answers,
refusals, the deadline), and the engine's side (worker/kv/port.py) on two real tiny-Llama engines: the blocks one
prefilled are stored in the other's prefix cache, and the request resumed there gives the same greedy tokens with
its prompt served from them; a consumer with no free block drops them (counted) and recomputes. Then a drain's moves in
the worker core: it asks where its requests go, ships and hands back each named one, ends at its deadline, and goes on
without its EP group when a peer leaves during the drain."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.protocol.messages import KvBlocks, KvOffer, KvStored, KvWant, encode
from infer.protocol.options import to_argv
from infer.worker.engine.config import EngineConfig
from infer.worker.kv.transfer import Exported, KvReceiver, KvSender, KvTransferConfig
from infer.worker.service import cli
from infer.worker.service.options import WorkerOptions

COORDINATOR = ["--coordinator", "tcp://127.0.0.1:9"]
PRODUCER = ["--kv-transfer-config", '{"kv_role": "kv_producer"}']
CONSUMER = ["--kv-transfer-config", '{"kv_role": "kv_consumer"}']


# ---- the flag -------------------------------------------------------------------------------------------------


def test_the_config_survives_argv_and_back_and_defaults_to_kv_both_without_a_port():
    default = WorkerOptions(coordinator="tcp://h:1", worker_id="w")
    assert default.kv.kv_role == "kv_both" and not default.kv_port_open
    options = WorkerOptions(
        coordinator="tcp://h:1",
        worker_id="w",
        kv_transfer_config=KvTransferConfig("kv_consumer", kv_port=5601, kv_transfer_timeout=2.5),
    )
    args = cli.build_parser().parse_args(to_argv(WorkerOptions, options))
    assert cli.worker_options(args, cli.worker_flags(args)) == options


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-transfer-config", "{kv_role"], "kv_transfer_config: not valid JSON"),
        (["--kv-transfer-config", "[1]"], "kv_transfer_config must be a JSON object, got list"),
        (["--kv-transfer-config", "{}"], "kv_transfer_config: 'kv_role' is required"),
        (
            ["--kv-transfer-config", '{"kv_role": "kv_decoder"}'],
            "kv_role must be one of kv_both, kv_producer, kv_consumer, got 'kv_decoder'",
        ),
        (
            ["--kv-transfer-config", '{"kv_role": "kv_both", "kv_connector": "x"}'],
            "unknown key(s) 'kv_connector'; known: kv_role, kv_port, kv_transfer_timeout",
        ),
        (
            ["--kv-transfer-config", '{"kv_role": "kv_producer", "kv_transfer_timeout": 0}'],
            "kv_transfer_timeout must be in (0, 600] s, got 0",
        ),
        (["--kv-transfer-config", '{"kv_role": "kv_consumer", "kv_port": 70000}'], "kv_port must be an integer"),
        (
            ["--kv-transfer-config", '{"kv_role": "kv_consumer", "kv_shm_dir": "shm"}'],
            "kv_shm_dir must be an absolute path or \"\", got 'shm'",
        ),
        ([*PRODUCER, "--tp-size", "2"], "kv_producer is not supported with --tp-size > 1"),
        ([*CONSUMER, "--pp-size", "2"], "kv_consumer is not supported with --pp-size > 1"),
        ([*CONSUMER, "--no-enable-prefix-caching"], "kv_consumer is not supported with prefix caching off"),
        ([*PRODUCER, "--benchmark-mode"], "kv_producer is not supported with --benchmark-mode"),
        (["--kv-transfer-config", '{"kv_role": "kv_both"}', "--tp-size", "2"], "kv_both is not supported with --tp"),
        (
            ["--kv-transfer-config", '{"kv_role": "kv_both"}', "--no-enable-prefix-caching"],
            "kv_both is not supported with prefix caching off",
        ),
    ],
)
def test_bad_configs_and_refused_combinations_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*COORDINATOR, *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


# ---- the transfer (sans-I/O) ----------------------------------------------------------------------------------


class FakePort:
    """A consumer's prefix cache holding `held` leading blocks; stores up to `room` blocks."""

    block_bytes = 8

    def __init__(self, held: int = 0, room: int = 100) -> None:
        self.held, self.room = held, room
        self.stored: list[tuple[int, int]] = []
        self.adapters: list[str | None] = []  # the adapter of each lookup and store

    def export(self, request_id):
        return None

    def first_missing(self, token_ids, lora_name=None) -> int:
        self.adapters.append(lora_name)
        return self.held

    def store(self, token_ids, first_block, payloads, lora_name=None) -> int:
        self.adapters.append(lora_name)
        n = min(len(payloads), self.room)
        self.room -= n
        self.stored.append((first_block, n))
        return n

    def fingerprint(self, weight_version: int) -> bytes:
        return b"fp%d" % weight_version


def run_transfer(sender: KvSender, receiver: KvReceiver, fingerprint: bytes = b"fp0") -> list[str]:
    """Deliver every frame both ways until nothing moves; the message types the consumer saw."""
    seen = []
    while out := sender.take_outgoing():
        for _address, _key, msg in out:
            seen.append(msg.TYPE)
            reply = receiver.on_message(msg, fingerprint)
            if reply is not None:
                sender.on_message(reply)
    return seen


def test_only_the_blocks_the_consumer_lacks_travel_in_bounded_frames(monkeypatch):
    monkeypatch.setattr("infer.worker.kv.transfer.MAX_FRAME_PAYLOAD", 2 * 8)  # two 8-byte blocks a frame
    sender, port = KvSender(timeout_s=5.0), FakePort(held=1)
    blocks = [bytes([i]) * 8 for i in range(5)]
    sender.start("r", "tcp://c:1", "", Exported(list(range(81)), blocks, "qv"), b"fp0", now=0.0)
    assert run_transfer(sender, KvReceiver(port)) == ["kv_offer", "kv_blocks", "kv_blocks"]
    assert port.stored == [(1, 2), (3, 2)]  # block 0 was held: blocks 1..4 in two frames
    assert port.adapters == ["qv"] * 3  # a LoRA request's KV: the lookup and each store are the adapter's
    (done,) = sender.take_done()
    assert done.outcome == "stored 5 of 5 blocks" and not sender.transfers and sender.completed == 1


def test_a_consumer_out_of_blocks_a_foreign_engine_and_a_silent_one_end_the_transfer():
    sender, port = KvSender(timeout_s=5.0), FakePort(room=1)
    sender.start("full", "tcp://c:1", "", Exported([1] * 49, [b"a" * 8] * 3), b"fp0", now=0.0)
    run_transfer(sender, KvReceiver(port))
    (done,) = sender.take_done()
    assert done.outcome == "stored 1 of 3 blocks"

    sender.start("foreign", "tcp://c:1", "", Exported([1] * 17, [b"a" * 8]), b"fp0", now=0.0)
    assert run_transfer(sender, KvReceiver(FakePort()), fingerprint=b"fp7") == ["kv_offer"]
    (done,) = sender.take_done()
    assert done.outcome.startswith("refused by the consumer: another model")

    sender.start("stalled", "tcp://c:1", "", Exported([1] * 17, [b"a" * 8]), b"fp0", now=10.0)
    assert [m.TYPE for _, _, m in sender.take_outgoing()] == ["kv_offer"]
    assert sender.next_deadline() == 15.0
    sender.tick(14.9)
    assert not sender.take_done()
    sender.tick(15.0)
    (done,) = sender.take_done()
    assert done.outcome == "timed out after 5 s (kv_transfer_timeout)" and sender.failed == 2
    sender.on_message(KvWant(transfer_id="stalled"))  # a late answer: ignored
    assert not sender.take_outgoing()


def test_on_one_host_the_blocks_go_through_shared_memory_and_their_files_are_removed(tmp_path):
    from infer.worker.service.kv_links import ShmArea

    producer_area, consumer_area = ShmArea(tmp_path), ShmArea(tmp_path)
    sender, port = KvSender(timeout_s=5.0, shm=producer_area), FakePort()
    receiver = KvReceiver(port, shm=consumer_area)
    blocks = [bytes([i]) * 8 for i in range(3)]
    sender.start("r", "tcp://c:1", "", Exported([1] * 49, blocks), b"fp0", now=0.0)
    (offer,) = [m for _, _, m in sender.take_outgoing()]
    want = receiver.on_message(offer, b"fp0")
    assert want.shm and want.first_block == 0
    sender.on_message(want)
    (frame,) = [m for _, _, m in sender.take_outgoing()]
    assert frame.blocks == [] and frame.shm_path.startswith(str(tmp_path))
    sender.on_message(receiver.on_message(frame, b"fp0"))
    (done,) = sender.take_done()
    assert done.outcome == "stored 3 of 3 blocks" and port.stored == [(0, 3)]
    assert not list(tmp_path.iterdir())  # the frame's file (read: deleted) and the transfer's probe (its end) are gone

    probe = producer_area.new_probe()
    (tmp_path / "other").mkdir()
    elsewhere = ShmArea(tmp_path / "other")
    assert not elsewhere.sees(*probe)  # another directory: TCP
    assert not consumer_area.sees(probe[0], "0" * 32)  # the wrong token
    assert consumer_area.read("/etc/passwd", 10) is None and consumer_area.read(probe[0], 32) is None
    for area in (producer_area, consumer_area, elsewhere):
        area.close()
    assert not [p for p in tmp_path.iterdir() if p.is_file()]  # close removes what is left (the probe)


class AdapterlessPort(FakePort):
    """A consumer that has no LoRA adapter loaded (the engine's ValueError for a name it does not know)."""

    def first_missing(self, token_ids, lora_name=None) -> int:
        if lora_name is not None:
            raise ValueError(f"unknown LoRA adapter {lora_name!r} (loaded: none)")
        return super().first_missing(token_ids)

    def store(self, token_ids, first_block, payloads, lora_name=None) -> int:
        self.first_missing(token_ids, lora_name)
        return super().store(token_ids, first_block, payloads)


def test_a_consumer_without_the_adapter_refuses_its_blocks():
    sender, port = KvSender(timeout_s=5.0), AdapterlessPort()
    sender.start("r", "tcp://c:1", "", Exported([1] * 33, [b"a" * 8] * 2, "qv"), b"fp0", now=0.0)
    assert run_transfer(sender, KvReceiver(port)) == ["kv_offer"]
    (done,) = sender.take_done()
    assert done.outcome == "refused by the consumer: unknown LoRA adapter 'qv' (loaded: none)" and not port.stored
    late = KvBlocks(  # the adapter unloaded between the offer and the blocks
        transfer_id="r", fingerprint=b"fp0", token_ids=[1] * 17, first_block=0, blocks=[], checksums=[], lora_name="qv"
    )
    assert KvReceiver(port).on_message(late, b"fp0").refusal == "unknown LoRA adapter 'qv' (loaded: none)"


def test_a_consumer_refuses_a_block_whose_checksum_differs():
    receiver = KvReceiver(FakePort())
    bad = KvBlocks(transfer_id="r", fingerprint=b"fp0", token_ids=[1] * 17, first_block=0, blocks=[b"x"], checksums=[1])
    reply = receiver.on_message(bad, b"fp0")
    assert isinstance(reply, KvStored) and reply.stored == 0 and reply.refusal == "a block's checksum differs"
    assert receiver.on_message(KvOffer(transfer_id="r", fingerprint=b"fp0", token_ids=[1]), b"fp0") == KvWant(
        transfer_id="r", first_block=0
    )


# ---- the engine's side (real engines) ------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(5 * j) % 300 + 7 for j in range(45)]  # 2 full blocks of 16, and a tail


def make_engine(model_dir, kv_cache_memory: int = 4_000_000, quantization: str = "auto", **options):
    from infer.worker.engine.engine import Engine

    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=kv_cache_memory,
        quantization=quantization,
        **options,
    )
    return Engine(config)


def finish(engine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == request_id:
                tokens.extend(delta.token_ids)
    return tokens


@pytest.mark.parametrize("quantization", ["auto", "int8"])
def test_blocks_prefilled_on_one_engine_serve_the_prompt_on_another(tiny_model_dir, quantization):
    """Dense and quantized weights (int8 at load): the KV is the pool's dtype either way."""
    model = tiny_model_dir("llama")
    reference = make_engine(model, quantization=quantization)
    reference.add_request("ref", PROMPT, GREEDY)
    expected = finish(reference, "ref")

    producer, consumer = make_engine(model, quantization=quantization), make_engine(model, quantization=quantization)
    producer.add_request("r", PROMPT, GREEDY)
    (first,) = [d for d in producer.step() if d.request_id == "r"]
    assert first.token_ids == expected[:1]
    tokens, payloads, adapter = producer.kv_port.export("r")
    assert tokens == PROMPT[:33] and len(payloads) == 2 and adapter is None
    assert producer.kv_port.fingerprint(0) == consumer.kv_port.fingerprint(0)
    assert producer.kv_port.fingerprint(0) != make_engine(model, quantization="int4").kv_port.fingerprint(0)

    port = consumer.kv_port
    assert port.first_missing(tokens) == 0
    assert port.store(tokens, 0, payloads) == 2 and port.first_missing(tokens) == 2
    assert port.store(tokens, 1, payloads[1:]) == 1  # held already: counted as there, nothing written
    assert port.received_blocks == 2 and port.dropped_blocks == 0
    consumer.add_request("r", PROMPT, GREEDY, resumed_token_ids=first.token_ids)
    assert first.token_ids + finish(consumer, "r") == expected
    assert consumer.scheduler.block_manager.num_hit_tokens == 32
    consumer.scheduler.block_manager.check_invariants()


def test_a_lora_request_s_blocks_serve_it_on_an_engine_with_the_adapter(tiny_model_dir, tmp_path):
    """A LoRA request's blocks are its adapter's: the consumer stores them under its own id of the adapter (not the
    producer's), its base model's lookup does not find them, and the request resumed there gives one engine's
    tokens; an engine without the adapter refuses them by name."""
    from lora_cases import ADAPTERS, make_adapter

    model = tiny_model_dir("llama")
    make_adapter(model, tmp_path / "qv", 100, **ADAPTERS["qv"])

    def with_adapters(*names: str):
        engine = make_engine(model, enable_lora=True, max_lora_rank=8)
        for name in names:
            engine.add_lora(name, str(tmp_path / "qv"))
        return engine

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora_name="qv")
    reference = with_adapters("qv")
    reference.add_request("base", PROMPT, GREEDY)
    base = finish(reference, "base")
    reference.add_request("ref", PROMPT, params)
    expected = finish(reference, "ref")
    assert expected != base  # the adapter's K / V differ from the base model's

    producer, consumer = with_adapters("qv"), with_adapters("other", "qv")  # "qv" has another id there
    producer.add_request("r", PROMPT, params)
    (first,) = [d for d in producer.step() if d.request_id == "r"]
    tokens, payloads, adapter = producer.kv_port.export("r")
    assert adapter == "qv" and len(payloads) == 2
    port = consumer.kv_port
    assert port.store(tokens, 0, payloads, "qv") == 2
    assert port.first_missing(tokens) == 0 and port.first_missing(tokens, "qv") == 2
    consumer.add_request("r", PROMPT, params, resumed_token_ids=first.token_ids)
    assert first.token_ids + finish(consumer, "r") == expected
    assert consumer.scheduler.block_manager.num_hit_tokens == 32
    with pytest.raises(ValueError, match="unknown LoRA adapter 'qv'"):
        with_adapters("other").kv_port.first_missing(tokens, "qv")


def test_a_consumer_without_free_blocks_drops_them_and_recomputes(tiny_model_dir):
    model = tiny_model_dir("llama")
    producer = make_engine(model)
    producer.add_request("r", PROMPT, GREEDY)
    producer.step()
    tokens, payloads, _ = producer.kv_port.export("r")
    consumer = make_engine(model, kv_cache_memory=9 * 8192)  # 9 blocks of the tiny Llama's 16 tokens
    blocks = consumer.scheduler.block_manager
    hog = [(3 * j) % 200 + 1 for j in range(blocks.num_blocks * 16 - 20)]  # holds every block but one
    consumer.add_request("hog", hog, SamplingParams(temperature=0.0, max_tokens=3))
    consumer.step()  # the hog's prefill holds its blocks until it finishes
    free = blocks.num_free_blocks
    assert free < 2
    assert consumer.kv_port.store(tokens, 0, payloads) == free
    assert consumer.kv_port.dropped_blocks == 2 - free


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "2", "--kv-roles", "kv_producer"], "--kv-roles names 1 role(s) for 2 worker(s)"),
        (["--workers", "2", "--kv-roles", "kv_producer,decoder"], "--kv-roles: 'decoder' is not one of kv_both"),
    ],
)
def test_infer_serve_refuses_kv_roles_that_do_not_fit(argv, message, capsys):
    from infer.client import serve

    assert serve.main(argv) == 2
    assert message in capsys.readouterr().err


# ---- the worker core (sans-I/O, tests/worker_harness.py) -----------------------------------------------------


def producer_harness(port: FakePort):
    """A kv_producer's core over BenchmarkEngine with `port` as its KV port, welcomed."""
    from worker_harness import WorkerHarness

    from infer.worker.service.core import WorkerCore

    h = WorkerHarness(kv_transfer_config=KvTransferConfig("kv_producer", kv_transfer_timeout=3.0))
    h.engine.kv_port = port
    h.core = WorkerCore(h.engine, h.core.options, h.now, wall_offset=1e9)
    h.core.start(h.now)
    h.out()
    h.welcome()
    return h


class ExportingPort(FakePort):
    def export(self, request_id):
        return Exported([1] * 33, [b"a" * 8, b"b" * 8])


def test_a_producer_streams_the_first_token_then_hands_off_once_the_transfer_ended():
    from worker_harness import deltas, dispatch

    h = producer_harness(ExportingPort())
    h.send(dispatch("r", max_tokens=8, kv_consumer_address="tcp://127.0.0.1:6001", kv_consumer_key=""))
    first = deltas(h.step())
    assert [d.token_ids for d in first] == [[3]] and not first[0].finished  # the first token, relayed
    (offer,) = h.core.take_kv_outgoing()
    assert offer[:2] == ("tcp://127.0.0.1:6001", "") and isinstance(offer[2], KvOffer)
    assert not h.engine.has_unfinished()  # aborted here, its blocks freed
    assert not deltas(h.step())  # the abort waits for the transfer
    receiver = KvReceiver(FakePort(held=1))
    for _address, _key, msg in [offer]:
        h.core.kv_sender.on_message(receiver.on_message(msg, b"fp0"))
    (blocks,) = h.core.take_kv_outgoing()
    h.core.on_kv_answer([encode(receiver.on_message(blocks[2], b"fp0"))], h.now)
    (handoff,) = deltas(h.out())
    assert handoff.finish_reason == "abort" and handoff.error_code == "kv_handoff"
    assert handoff.error == "KV transfer: stored 2 of 2 blocks"


def test_answers_read_during_a_step_hand_off_without_touching_the_engine(monkeypatch):
    """The shell's heartbeat thread reads a producer's KV links while the engine steps: the transfer ends there and
    its request goes back at once, in a frame with the last load the engine reported (the engine, mid-step on the
    other thread, is not asked)."""
    from worker_harness import deltas, dispatch

    from infer.protocol.messages import StepBatch

    h = producer_harness(ExportingPort())
    h.send(dispatch("r", max_tokens=8, kv_consumer_address="tcp://127.0.0.1:6001", kv_consumer_key=""))
    h.step()
    (offer,) = h.core.take_kv_outgoing()
    receiver = KvReceiver(FakePort())
    for name in ("load", "take_kv_events", "take_pending", "step"):
        monkeypatch.setattr(h.engine, name, lambda *a, name=name: pytest.fail(f"engine.{name} called mid-step"))
    h.core.on_kv_answer([encode(receiver.on_message(offer[2], b"fp0"))], h.now, during_step=True)
    (blocks,) = h.core.take_kv_outgoing()
    assert h.core.kv_transfers_during_step(h.now)  # under way: the thread looks again soon
    h.core.on_kv_answer([encode(receiver.on_message(blocks[2], b"fp0"))], h.now, during_step=True)
    (batch,) = h.out()
    assert isinstance(batch, StepBatch) and batch.load == h.core.last_load and batch.kv_events is None
    (handoff,) = deltas([batch])
    assert handoff.error_code == "kv_handoff" and handoff.error == "KV transfer: stored 2 of 2 blocks"
    assert not h.core.kv_transfers_during_step(h.now)


def test_a_stalled_transfer_ends_at_its_deadline_during_a_step(monkeypatch):
    from worker_harness import deltas, dispatch

    h = producer_harness(ExportingPort())
    h.send(dispatch("r", max_tokens=8, kv_consumer_address="tcp://127.0.0.1:6001", kv_consumer_key=""))
    h.step()
    h.core.take_kv_outgoing()
    monkeypatch.setattr(h.engine, "load", lambda: pytest.fail("engine.load called mid-step"))
    assert h.core.kv_transfers_during_step(h.now + 2.9) and not h.out()
    assert not h.core.kv_transfers_during_step(h.now + 3.1)
    (handoff,) = deltas(h.out())
    assert handoff.error_code == "kv_handoff" and "timed out after 3 s" in handoff.error


def test_a_producer_in_a_long_step_hands_off_before_the_step_ends():
    """A real worker shell (its sockets and heartbeat thread) over BenchmarkEngine with 2 s steps, a stand-in
    coordinator and a stand-in consumer on loopback: a request handed off after the first step is given back to the
    coordinator during the second step (its consumer's answers read beside it), not after it, as the other request's
    next token shows: it comes after the hand-off."""
    import threading

    import zmq
    from worker_harness import dispatch

    from infer.protocol.messages import Control, ControlAck, StepBatch, Welcome, decode
    from infer.protocol.transport import frames_for, make_socket
    from infer.worker.service.benchmark_engine import BenchmarkEngine
    from infer.worker.service.daemon import Worker

    ctx = zmq.Context()
    coordinator, consumer = make_socket(ctx, zmq.ROUTER), make_socket(ctx, zmq.ROUTER)
    coordinator.bind("tcp://127.0.0.1:*")
    consumer.bind("tcp://127.0.0.1:*")
    engine = BenchmarkEngine(EngineConfig(max_num_seqs=4, max_model_len=64), step_time=2.0)
    engine.kv_port = ExportingPort()
    options = WorkerOptions(
        coordinator=coordinator.getsockopt(zmq.LAST_ENDPOINT).decode(),
        worker_id="producer",
        heartbeat_interval=0.5,
        coordinator_timeout=30.0,
        drain_timeout=0.0,
        kv_transfer_config=KvTransferConfig("kv_producer", kv_transfer_timeout=60.0, kv_shm_dir=""),
    )
    worker = Worker(engine, options, ctx)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    receiver, poller, seen = KvReceiver(FakePort()), zmq.Poller(), []
    poller.register(coordinator, zmq.POLLIN)
    poller.register(consumer, zmq.POLLIN)
    peer = None
    try:
        while True:
            events = dict(poller.poll(30_000))
            assert events, f"nothing for 30 s; seen {seen}"
            if consumer in events:
                producer, frame = consumer.recv_multipart()
                msg = decode(frame)
                seen.append(msg.TYPE)
                consumer.send_multipart(frames_for(receiver.on_message(msg, b"fp0"), producer))
            if coordinator not in events:
                continue
            peer, frame = coordinator.recv_multipart()
            msg = decode(frame)
            if msg.TYPE == "hello":
                coordinator.send_multipart(frames_for(Welcome(coordinator_id="c", state="running"), peer))
                for rid, target in (("long", None), ("r", consumer.getsockopt(zmq.LAST_ENDPOINT).decode())):
                    extra = {"kv_consumer_address": target, "kv_consumer_key": ""} if target else {}
                    coordinator.send_multipart(frames_for(dispatch(rid, max_tokens=8, **extra), peer))
            elif isinstance(msg, StepBatch):
                seen += [f"{d.request_id}:{d.error_code or len(d.token_ids)}" for d in msg.deltas]
                if any(d.request_id == "long" for d in msg.deltas) and seen.count("long:1") == 2:
                    break
        assert "r:kv_handoff" in seen and seen.index("r:kv_handoff") < len(seen) - 1, seen
        assert seen[seen.index("r:kv_handoff") + 1 :] == ["long:1"], seen  # the second step's token came after it
        assert [t for t in seen if t in ("kv_offer", "kv_blocks")] == ["kv_offer", "kv_blocks"], seen
        coordinator.send_multipart(frames_for(Control(command="stop"), peer))
        while not isinstance(decode(coordinator.recv_multipart()[1]), ControlAck):
            pass
        thread.join(30)
        assert codes == [0]
    finally:  # a failed assertion leaves the worker running: its drain (drain_timeout 0) ends it
        if thread.is_alive():
            worker.request_drain()
            thread.join(30)
        coordinator.close(0)
        consumer.close(0)
        if not thread.is_alive():  # else term would wait for the worker's sockets
            ctx.term()


def test_frames_past_a_full_link_wait_in_order_and_those_of_ended_transfers_are_dropped():
    """The producer's KV link (worker/service/kv_links.py) queues at most SNDHWM frames in zmq; the rest (two long
    prompts' blocks handed off at once) waited nowhere: they were dropped and their transfers timed out (10 s of a
    stream's second token). Now they wait in the link's backlog, in order, for the next flush with room."""
    from types import SimpleNamespace

    import zmq

    from infer.protocol.messages import decode
    from infer.worker.service.kv_links import KvLinks

    class Link:
        def __init__(self) -> None:
            self.full, self.sent = False, []

        def send_multipart(self, frames, flags=0):
            if self.full:
                raise zmq.Again()
            self.sent.append(decode(frames[0]).transfer_id)

    sender = KvSender(timeout_s=10.0)
    core = SimpleNamespace(
        options=SimpleNamespace(kv=KvTransferConfig("kv_producer", kv_shm_dir="")),
        kv_sender=sender,
        kv_receiver=None,
        take_kv_replies=lambda: [],
        take_kv_outgoing=sender.take_outgoing,
    )
    links = KvLinks(core, None, "127.0.0.1", zmq.Poller())
    link = Link()
    links._link = lambda address, key: link
    try:
        exported = Exported([1] * 33, [b"a" * 8, b"b" * 8])
        link.full = True
        for rid in ("t1", "t2", "t3"):
            sender.start(rid, "tcp://127.0.0.1:6001", "", exported, b"fp0", now=0.0)
        links.flush()
        assert link.sent == [] and links.backlogged
        sender.cancel("t2")  # ended meanwhile: its frame is not sent late
        link.full = False
        links.flush()
        assert link.sent == ["t1", "t3"] and not links.backlogged
    finally:
        links.close()


def test_a_stalled_transfer_hands_off_at_its_deadline_and_an_abort_cancels_it():
    from worker_harness import deltas, dispatch

    from infer.protocol.messages import Abort

    h = producer_harness(ExportingPort())
    for rid in ("stalled", "aborted"):
        h.send(dispatch(rid, max_tokens=8, kv_consumer_address="tcp://127.0.0.1:6001", kv_consumer_key=""))
    h.step()
    assert len(h.core.take_kv_outgoing()) == 2
    h.send(Abort(request_ids=["aborted"]))
    assert h.core.poll_timeout(h.now) <= 3.0
    assert not deltas(h.advance(2.9))
    (handoff,) = deltas(h.advance(0.2))
    assert handoff.request_id == "stalled" and handoff.error_code == "kv_handoff"
    assert "timed out after 3 s" in handoff.error
    assert not h.core.kv_sender.transfers


def test_a_request_without_a_full_block_decodes_on_the_producer():
    from worker_harness import dispatch

    h = producer_harness(FakePort())  # exports nothing
    h.send(dispatch("r", max_tokens=3, kv_consumer_address="tcp://127.0.0.1:6001", kv_consumer_key=""))
    out = h.run_until_finished()
    assert [d.token_ids for d in out] == [[3], [4], [5]] and out[-1].finish_reason == "length"
    assert not h.core.take_kv_outgoing()


# ---- a drain that moves requests with their KV (worker core, sans-I/O) ---------------------------------------


def kv_port_harness(port: FakePort, **options):
    """A kv_both worker with a KV port (--kv-transfer-config given) over BenchmarkEngine, welcomed."""
    from worker_harness import WorkerHarness

    from infer.worker.service.core import WorkerCore

    h = WorkerHarness(kv_transfer_config=KvTransferConfig("kv_both", kv_transfer_timeout=3.0), **options)
    h.engine.kv_port = port
    h.core = WorkerCore(h.engine, h.core.options, h.now, wall_offset=1e9)
    h.core.start(h.now)
    h.out()
    h.welcome()
    return h


def drain_started(h, rids=("a", "b")):
    """Dispatch `rids`, step twice (their first tokens), SIGTERM: the DrainMoves the worker asks with."""
    from worker_harness import dispatch

    from infer.protocol.messages import DrainMoves

    for rid in rids:
        h.send(dispatch(rid, max_tokens=50))
    h.step()
    h.step()
    h.core.signals += 1
    (ask,) = [m for m in h.step() if isinstance(m, DrainMoves)]
    return ask


def test_a_drain_asks_where_its_requests_go_and_hands_each_back_once_its_blocks_are_stored():
    from worker_harness import deltas

    from infer.protocol.messages import KvMove, MoveTargets

    h = kv_port_harness(ExportingPort())
    assert sorted(drain_started(h).request_ids) == ["a", "b"]
    assert not h.core.drained(h.now)  # both still run until the answer
    target = KvMove(request_id="a", kv_address="tcp://127.0.0.1:6001", kv_key="")
    h.send(MoveTargets(moves=[target]))  # b has no target: it finishes here, as in any drain
    (offer,) = h.core.take_kv_outgoing()
    assert offer[0] == "tcp://127.0.0.1:6001" and offer[2].transfer_id == "a"
    assert not h.core.drained(h.now)  # the move is under way
    receiver = KvReceiver(FakePort())
    h.core.kv_sender.on_message(receiver.on_message(offer[2], b"fp0"))
    (blocks,) = h.core.take_kv_outgoing()
    h.core.on_kv_answer([encode(receiver.on_message(blocks[2], b"fp0"))], h.now)
    (moved,) = [d for d in deltas(h.out()) if d.request_id == "a"]
    assert moved.finish_reason == "abort" and moved.error_code == "kv_handoff"
    assert moved.error == "KV transfer: stored 2 of 2 blocks"
    rest = h.run_until_finished()
    assert {d.request_id for d in rest} == {"b"} and rest[-1].finish_reason == "length"
    assert h.core.drained(h.now)


def test_a_move_stalled_past_the_drain_timeout_goes_back_at_the_deadline():
    from worker_harness import deltas

    from infer.protocol.messages import KvMove, MoveTargets

    h = kv_port_harness(ExportingPort(), drain_timeout=2.0)
    drain_started(h, rids=("a",))
    h.send(MoveTargets(moves=[KvMove(request_id="a", kv_address="tcp://127.0.0.1:6001", kv_key="")]))
    assert len(h.core.take_kv_outgoing()) == 1  # the offer, never answered (a stopped target)
    h.now += 2.1
    assert h.core.drained(h.now)  # bounded by --drain-timeout (2 s), before kv_transfer_timeout (3 s)
    (moved,) = deltas(h.out())
    assert moved.error_code == "kv_handoff" and "drain timeout" in moved.error


def test_without_an_answer_or_a_kv_port_a_drain_runs_its_requests_here_and_says_it_drains():
    from worker_harness import WorkerHarness, deltas, dispatch

    from infer.protocol.messages import DrainMoves

    h = kv_port_harness(ExportingPort(), drain_timeout=5.0)
    drain_started(h, rids=("a",))
    out = h.run_until_finished()  # the coordinator never answered: it runs to its end here
    assert out[-1].finish_reason == "length" and h.core.drained(h.now)
    plain = WorkerHarness()
    plain.welcome()
    plain.send(dispatch("a", max_tokens=50))
    plain.step()
    plain.core.signals += 1
    # no KV port: nothing moves, but the coordinator hears the drain at once (not at the first Dispatch refused)
    assert [m.request_ids for m in plain.step() if isinstance(m, DrainMoves)] == [[]]
    plain.step()
    assert not plain.core.drained(plain.now)  # its request runs here
    plain.now += 31
    assert plain.core.drained(plain.now)
    (given_back,) = deltas(plain.out())
    assert given_back.finish_reason == "abort" and given_back.error_code is None


def test_an_ep_group_that_leaves_during_the_drain_ends_the_steps_not_the_moves():
    """The whole EP group drains and a peer, drained first, leaves (worker/service/daemon.py `_advance_group`): the
    move under way still ships and hands its request back; the request with no target cannot step any more and is given
    back at once (no error code: the coordinator resumes it elsewhere); the drain then ends as any other (exit 0)."""
    from worker_harness import deltas

    from infer.protocol.messages import KvMove, MoveTargets

    h = kv_port_harness(ExportingPort())
    drain_started(h)
    h.send(MoveTargets(moves=[KvMove(request_id="a", kv_address="tcp://127.0.0.1:6001", kv_key="")]))
    (offer,) = h.core.take_kv_outgoing()
    h.core.group_left("a member of EP group 'dp0' left", h.now)
    assert h.core.group_gone and not h.core.wants_step()
    (given_back,) = deltas(h.out())
    assert given_back.request_id == "b" and given_back.finish_reason == "abort" and given_back.error_code is None
    assert not h.core.drained(h.now)  # a is still shipping
    receiver = KvReceiver(FakePort())
    h.core.kv_sender.on_message(receiver.on_message(offer[2], b"fp0"))
    (blocks,) = h.core.take_kv_outgoing()
    h.core.on_kv_answer([encode(receiver.on_message(blocks[2], b"fp0"))], h.now)
    (moved,) = deltas(h.out())
    assert moved.request_id == "a" and moved.error_code == "kv_handoff"
    assert h.core.drained(h.now)


def test_a_mates_drain_drains_this_rank_too_and_its_departure_then_ends_no_request():
    """A round said a member of the EP group drains (worker/service/daemon.py `_advance_group`): this rank, serving and
    not signalled, drains as on SIGTERM: it asks where its requests go, refuses new ones; a second such round changes
    nothing. When the drained mate leaves, the requests move or are given back and the rank exits 0, not 1."""
    from worker_harness import deltas, dispatch

    from infer.protocol.messages import DrainMoves, KvMove, MoveTargets

    h = kv_port_harness(ExportingPort(), drain_timeout=5.0)
    for rid in ("a", "b"):
        h.send(dispatch(rid, max_tokens=50))
    h.step()
    h.core.group_drains(h.now)
    (ask,) = [m for m in h.out() if isinstance(m, DrainMoves)]
    assert ask.request_ids == ["a", "b"] and h.core.draining
    h.now += 1
    h.core.group_drains(h.now)  # every later round says it again
    assert not [m for m in h.out() if isinstance(m, DrainMoves)]
    h.send(dispatch("c", max_tokens=5))
    assert [(d.request_id, d.error_code) for d in deltas(h.step()) if d.finished] == [("c", "draining")]
    h.send(MoveTargets(moves=[KvMove(request_id="a", kv_address="tcp://127.0.0.1:6001", kv_key="")]))
    h.core.group_left("a member of EP group 'dp0' left", h.now)  # no WorkerExit: the departure is part of the drain
    (given_back,) = deltas(h.out())
    assert given_back.request_id == "b" and given_back.finish_reason == "abort"
    h.now += 5
    assert h.core.drained(h.now)


def test_a_rank_with_a_kv_port_and_nothing_running_says_it_drains():
    """An empty DrainMoves: the coordinator takes the rank, and its EP group, out of routing at once."""
    from infer.protocol.messages import DrainMoves

    h = kv_port_harness(ExportingPort())
    h.core.signals += 1
    (ask,) = [m for m in h.step() if isinstance(m, DrainMoves)]
    assert ask.request_ids == [] and h.core.drained(h.now)


def test_a_group_that_leaves_before_the_moves_are_answered_waits_for_them_and_one_not_draining_exits_1():
    """The peer left before MoveTargets came: the requests wait for it without stepping (the named one then moves, the
    other is given back). A rank that does not drain cannot go on without its group: every request back, exit 1."""
    from worker_harness import deltas, dispatch

    from infer.protocol.messages import KvMove, MoveTargets
    from infer.worker.service.core import EXIT_FATAL, WorkerExit

    h = kv_port_harness(ExportingPort())
    drain_started(h)
    h.core.group_left("a member of EP group 'dp0' left", h.now)
    assert not deltas(h.step()) and h.engine.has_unfinished() and not h.core.wants_step()
    assert h.core.poll_timeout(h.now) > 0  # nothing to step: it waits in poll
    out = h.send(MoveTargets(moves=[KvMove(request_id="a", kv_address="tcp://127.0.0.1:6001", kv_key="")]))
    assert len(h.core.take_kv_outgoing()) == 1
    (given_back,) = deltas(out)  # a's abort waits for its transfer
    assert given_back.request_id == "b" and given_back.finish_reason == "abort" and not h.engine.has_unfinished()

    serving = kv_port_harness(ExportingPort())
    serving.send(dispatch("a", max_tokens=50))
    serving.step()
    with pytest.raises(WorkerExit) as exit_:
        serving.core.group_left("a member of EP group 'dp0' left", serving.now)
    assert exit_.value.code == EXIT_FATAL and exit_.value.leave_group is None
    (given_back,) = deltas(serving.out())
    assert given_back.request_id == "a" and given_back.finish_reason == "abort"
