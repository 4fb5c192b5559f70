"""Wire messages: every type round-trips; every kind of malformed frame is a ProtocolError naming the problem."""

from __future__ import annotations

import random

import msgpack
import pytest

from infer.protocol.messages import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    REGISTRY,
    Abort,
    Accepted,
    BeamOutput,
    ClusterStats,
    CommitWeights,
    Control,
    ControlAck,
    Delta,
    DeltaBatch,
    Dispatch,
    DrainMoves,
    DrainStarted,
    DrainWorker,
    Error,
    Heartbeat,
    Hello,
    KvBlocks,
    KvEvents,
    KvMove,
    KvOffer,
    KvResync,
    KvStored,
    KvWant,
    Load,
    LoraCommand,
    LoraDone,
    ModelStats,
    MoveTargets,
    PeerAck,
    PeerBeat,
    Placement,
    ProtocolError,
    RankHold,
    Redirect,
    Refused,
    Replica,
    RequestSnapshot,
    RequestSpec,
    StatsRequest,
    StepBatch,
    StreamBatch,
    Submit,
    Subscribe,
    TokenIds,
    UpdateWeights,
    VoteGrant,
    VoteRequest,
    WeightsUpdated,
    WeightSync,
    WeightTensor,
    Welcome,
    WorkerStats,
    decode,
    encode,
)
from infer.protocol.outputs import Completion, RequestOutput
from infer.protocol.sampling import SamplingParams

EXAMPLES = [
    Hello(role="client", peer_id="c1"),
    Hello(
        role="worker",
        peer_id="w0",
        model_id="m",
        dp_rank=0,
        group_id="g0",
        num_kv_blocks=100,
        block_size=16,
        max_num_seqs=8,
        max_model_len=2048,
        running=["a", "b"],
    ),
    Hello(
        role="worker",
        peer_id="w1",
        model_id="m",
        dp_rank=1,
        group_id="g1",
        num_kv_blocks=100,
        block_size=16,
        max_num_seqs=8,
        max_model_len=2048,
        running=["a"],
        max_waiting=32,
        snapshots=[
            RequestSnapshot(
                request_id="a",
                prompt_token_ids=TokenIds([1, 2]),
                token_ids=TokenIds([7, 8, 9]),
                resumed=1,
                text="xy",
                delta_ends=[2, 3],
                text_ends=[1, 2],
            )
        ],
    ),
    RequestSnapshot(request_id="b", prompt_token_ids=TokenIds([3])),
    Welcome(coordinator_id="coord", state="running", model_id="m"),
    Welcome(coordinator_id="coord", state="running", model_id="m", instance="5f3a"),
    Refused(reason="model id differs: coordinator serves 'a', worker has 'b'"),
    Submit(
        request_id="r1",
        spec=RequestSpec(prompt="hello", sampling=SamplingParams(temperature=0.0, max_tokens=4, stop=["\n"])),
    ),
    Submit(request_id="r2", spec=RequestSpec(prompt_token_ids=TokenIds([1, 2, 2**31 - 1])), pin_rank=1),
    Submit(request_id="r3", spec=RequestSpec(prompt="hi"), model="/models/qwen3-0.6b-int4"),
    Submit(
        request_id="r4",
        spec=RequestSpec(prompt_token_ids=TokenIds([1, 2])),
        timeout_s=2.5,
        reattach=True,
        delivered_token_ids=TokenIds([3, 4]),
    ),
    Dispatch(
        request_id="r1",
        spec=RequestSpec(prompt_token_ids=TokenIds([5, 6, 7]), sampling=SamplingParams(max_tokens=3)),
        resumed_token_ids=TokenIds([8]),
    ),
    Dispatch(request_id="r3", spec=RequestSpec(prompt="text", sampling=SamplingParams())),
    Dispatch(
        request_id="r5",
        spec=RequestSpec(prompt="text", sampling=SamplingParams(structured_outputs={"regex": "[a-z]+"})),
        client="5f3a9c0d1e2b4a68",
    ),
    Accepted(request_id="r1"),
    Delta(request_id="r1", token_ids=TokenIds([9, 10]), text="ab", logprobs=[{9: -0.5, 3: -1.5}, {10: -0.1}]),
    Delta(request_id="r1", token_ids=TokenIds([]), text="", finished=True, finish_reason="error", error="boom"),
    BeamOutput(token_ids=TokenIds([4, 0]), text="d", cumulative_logprob=-1.5, score=-0.75, finish_reason="stop"),
    Delta(
        request_id="r2",
        token_ids=TokenIds([4, 0]),
        text="d",
        finished=True,
        finish_reason="stop",
        beams=[
            BeamOutput(
                token_ids=TokenIds([4, 0]), text="d", cumulative_logprob=-1.5, score=-0.75, finish_reason="stop"
            ),
            BeamOutput(
                token_ids=TokenIds([5, 6, 7]), text="efg", cumulative_logprob=-2.5, score=-0.83, finish_reason="length"
            ),
        ],
    ),
    Abort(request_ids=["r1", "r2"]),
    Error(message="bad frame"),
    Load(num_waiting=1, num_running=2, num_free_blocks=3, num_total_blocks=4, num_queued_tokens=5),
    StepBatch(
        deltas=[
            Delta(request_id="a", token_ids=TokenIds([1]), text="x", prompt_token_ids=TokenIds([4, 5])),
            Delta(request_id="b", token_ids=TokenIds([2]), text="y", finished=True, finish_reason="stop"),
        ],
        load=Load(num_waiting=0, num_running=1, num_free_blocks=9, num_total_blocks=10, num_queued_tokens=1),
    ),
    Heartbeat(sent_at=12.5),
    Heartbeat(sent_at=12.5, instance="5f3a"),
    Heartbeat(
        sent_at=1.0, load=Load(num_waiting=0, num_running=0, num_free_blocks=7, num_total_blocks=7, num_queued_tokens=0)
    ),
    Control(command="pause"),
    ControlAck(command="pause", state="paused"),
    ControlAck(command="suspend", state="suspended", bytes_released=123456789),
    WeightTensor(name="model.norm.weight", dtype="float32", shape=[64]),
    WeightSync(
        init_method="tcp://10.0.0.1:29511",
        world_size=3,
        rank=2,
        backend="gloo",
        bucket_bytes=1 << 20,
        tensors=[WeightTensor(name="a.weight", dtype="bfloat16", shape=[2, 3])],
    ),
    UpdateWeights(path="/models/step-100", on_running="abort", timeout_s=60.0, version=4),
    UpdateWeights(
        sync=WeightSync(
            init_method="tcp://h:1", world_size=2, tensors=[WeightTensor(name="x", dtype="float16", shape=[])]
        )
    ),
    WeightsUpdated(version=3, num_tensors=20),
    WeightsUpdated(version=3, error="weight update: tensor 'x' has dtype int32"),
    WeightsUpdated(version=3, prepared=True, num_tensors=20),
    CommitWeights(version=3),
    CommitWeights(version=3, commit=False),
    LoraCommand(action="load", lora_name="sql", lora_path="/adapters/sql"),
    LoraCommand(action="unload", lora_name="sql"),
    LoraDone(action="load", lora_name="sql", lora_adapters={"sql": "/adapters/sql"}),
    LoraDone(action="unload", lora_name="x", error="no LoRA adapter 'x' is loaded"),
    Load(
        num_waiting=0,
        num_running=0,
        num_free_blocks=3,
        num_total_blocks=4,
        num_queued_tokens=0,
        weight_version=2,
        suspended=True,
        bytes_released=1 << 30,
    ),
    DeltaBatch(
        deltas=[
            Delta(request_id="a", token_ids=TokenIds([3]), text="z", prompt_token_ids=TokenIds([1])),
            Delta(request_id="b", token_ids=TokenIds([]), text="", finished=True, finish_reason="abort"),
        ]
    ),
    StatsRequest(),
    StatsRequest(min_healthy_workers=2, timeout_s=30.0),
    ModelStats(model_id="m", num_workers=2, num_healthy_workers=1),
    WorkerStats(
        worker_id="w0",
        dp_rank=0,
        group_id="g0",
        healthy=True,
        num_kv_blocks=10,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        requests_routed=3,
        num_in_flight=1,
        seconds_since_heard=0.2,
    ),
    ClusterStats(
        coordinator_id="coord",
        state="running",
        policy="least-loaded",
        model_id="m",
        workers=[
            WorkerStats(
                worker_id="w1",
                dp_rank=1,
                group_id="g1",
                healthy=False,
                num_kv_blocks=10,
                block_size=16,
                max_num_seqs=8,
                max_model_len=256,
                requests_routed=0,
                num_in_flight=0,
                seconds_since_heard=9.5,
                registrations=2,
                load=Load(num_waiting=1, num_running=2, num_free_blocks=3, num_total_blocks=10, num_queued_tokens=40),
                model_id="m",
            )
        ],
        models=[
            ModelStats(
                model_id="m",
                num_workers=1,
                num_healthy_workers=0,
                num_held=2,
                requests_submitted=5,
                max_model_len=256,
                lora_adapters={"sql": "/adapters/sql"},
                default=True,
            )
        ],
        num_clients=1,
        num_in_flight=0,
        num_held=2,
        requests_submitted=5,
        requests_completed=3,
        requests_failed=0,
        requests_aborted=0,
        requests_redispatched=1,
        frames_rejected=4,
        uptime_s=1.5,
    ),
]


TOKEN = "0123456789abcdef0123456789abcdef"
KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a z85 public key: 40 characters

EXAMPLES += [
    Hello(role="client", peer_id="c2", streams=True),
    Dispatch(
        request_id="r",
        spec=RequestSpec(sampling=SamplingParams(), prompt_token_ids=TokenIds([1, 2])),
        stream_owner=KEY,
        stream_token=TOKEN,
    ),
    Dispatch(
        request_id="r", spec=RequestSpec(sampling=SamplingParams(), prompt="hi"), stream_owner="", stream_token=TOKEN
    ),
    Placement(request_id="r", stream_address="tcp://127.0.0.1:5555", worker_key=KEY, stream_token=TOKEN),
    Placement(request_id="r"),
    Subscribe(request_id="r", stream_token=TOKEN, num_tokens=3, text_len=7),
    StreamBatch(
        deltas=[Delta(request_id="r", token_ids=TokenIds([4]), text="a"), Delta.final("s", "length")],
        token_starts=[3, 0],
        text_starts=[7, 0],
    ),
    Error(message="no such stream", request_id="r", code="unavailable", stream_token=TOKEN),
    RequestSnapshot(request_id="r", prompt_token_ids=TokenIds([1]), stream_owner="", stream_token=TOKEN),
    # several coordinators
    Redirect(reason="not the leader", leader="tcp://127.0.0.1:5556"),
    Redirect(reason="no leader yet"),
    PeerBeat(
        term=3,
        sender=1,
        seq=9,
        replica=Replica(
            version=2,
            state="paused",
            weight_version=4,
            lora_adapters={"sql": "/a/sql"},
            lora_models={"sql": "m"},
            ranks=[RankHold(worker_id="w0", model_id="m", dp_rank=0, group_id="dp0")],
        ),
    ),
    PeerBeat(term=3, sender=0, seq=10),
    PeerAck(term=3, sender=2, seq=10),
    VoteRequest(term=4, sender=2),
    VoteGrant(term=4, sender=0, granted=True),
    Welcome(coordinator_id="c", state="running", term=4),
    # routing by what the workers hold (coordinator/kv_index.py)
    Welcome(coordinator_id="c", state="running", kv_events=True),
    StepBatch(
        deltas=[],
        load=Load(num_waiting=0, num_running=1, num_free_blocks=9, num_total_blocks=10, num_queued_tokens=1),
        kv_events=KvEvents(epoch=3, seq=0, reset=True, stored=[0, 2**64 - 1]),
    ),
    KvResync(reason="a gap in its KV events"),
    Submit(request_id="r", spec=RequestSpec(prompt_token_ids=TokenIds([1])), session_id="conversation-7"),
    # disaggregated prefill and decode (worker/kv/transfer.py)
    Hello(
        role="worker",
        peer_id="w",
        model_id="m",
        num_kv_blocks=4,
        block_size=16,
        max_num_seqs=2,
        max_model_len=64,
        kv_role="kv_consumer",
        kv_address="tcp://127.0.0.1:5557",
    ),
    Dispatch(
        request_id="r",
        spec=RequestSpec(sampling=SamplingParams(), prompt_token_ids=TokenIds([1])),
        kv_consumer_address="tcp://127.0.0.1:5557",
        kv_consumer_key=KEY,
    ),
    KvOffer(transfer_id="r", fingerprint=b"f" * 16, token_ids=TokenIds([1, 2, 3])),
    KvOffer(
        transfer_id="r",
        fingerprint=b"f" * 16,
        token_ids=TokenIds([1]),
        shm_probe="/dev/shm/infer-kv-0123456789abcdef.probe",
        shm_token=TOKEN,
    ),
    KvBlocks(
        transfer_id="r",
        fingerprint=b"f" * 16,
        token_ids=TokenIds([1, 2, 3]),
        first_block=0,
        blocks=[],
        checksums=[7, 8],
        shm_path="/dev/shm/infer-kv-0123456789abcdef.1",
    ),
    KvWant(transfer_id="r", first_block=1, shm=True),
    KvWant(transfer_id="r", refusal="another model"),
    KvBlocks(
        transfer_id="r",
        fingerprint=b"f" * 16,
        token_ids=TokenIds([1, 2, 3]),
        first_block=0,
        blocks=[b"\0" * 8],
        checksums=[2**64 - 1],
        last=False,
    ),
    KvStored(transfer_id="r", stored=1, refusal="no free block"),
    DrainMoves(request_ids=["r1", "r2"]),
    MoveTargets(moves=[KvMove(request_id="r1", kv_address="tcp://127.0.0.1:5601", kv_key="")]),
    DrainWorker(worker_id="w-1"),
    DrainStarted(worker_id="w-1", num_requests=3),
]


def test_kv_roles_and_transfers_are_checked_when_built_and_decoded():
    common = dict(role="worker", peer_id="w", model_id="m", num_kv_blocks=4, block_size=16, max_num_seqs=2)
    with pytest.raises(ProtocolError, match="field 'kv_role' must be one of kv_both, kv_producer, kv_consumer"):
        Hello(**common, max_model_len=64, kv_role="kv_decoder")
    with pytest.raises(ProtocolError, match="a kv_consumer hello needs field 'kv_address'"):
        Hello(**common, max_model_len=64, kv_role="kv_consumer")
    with pytest.raises(ProtocolError, match="'kv_consumer_address' and 'kv_consumer_key' go together"):
        Dispatch(
            request_id="r", spec=RequestSpec(sampling=SamplingParams(), prompt="x"), kv_consumer_address="tcp://h:1"
        )
    with pytest.raises(ProtocolError, match="with 'shm_path': no 'blocks', a checksum per block"):
        KvBlocks(
            transfer_id="r",
            fingerprint=b"",
            token_ids=TokenIds([1]),
            first_block=0,
            blocks=[b""],
            checksums=[1],
            shm_path="/x",
        )
    with pytest.raises(ProtocolError, match="'shm_probe' and 'shm_token' go together"):
        KvOffer(transfer_id="r", fingerprint=b"", token_ids=TokenIds([1]), shm_probe="/dev/shm/x")
    with pytest.raises(ProtocolError, match="'blocks' and 'checksums' must have one item each"):
        KvBlocks(transfer_id="r", fingerprint=b"", token_ids=TokenIds([1]), first_block=0, blocks=[b""], checksums=[])


def test_every_registered_type_has_an_example():
    assert {type(m).TYPE for m in EXAMPLES} == set(REGISTRY)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).TYPE)
def test_round_trip(msg):
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)


def test_token_ids_travel_as_an_int_array_checked_by_the_decoder():
    r2 = next(m for m in EXAMPLES if isinstance(m, Submit) and m.request_id == "r2")
    frame = msgpack.unpackb(encode(r2), raw=False)
    assert frame["body"]["spec"]["prompt_token_ids"] == [1, 2, 2**31 - 1]
    for bad in ([1, -1], [2**31], [1, "2"]):
        with pytest.raises(
            ProtocolError, match=r"field 'spec.prompt_token_ids\[1\]|field 'spec.prompt_token_ids\[0\]'"
        ):
            decode(
                _frame(
                    "submit", {"request_id": "r", "spec": {"prompt_token_ids": bad if bad[0] != 2**31 else [0, *bad]}}
                )
            )


def test_fields_at_their_default_stay_off_the_wire():
    body = msgpack.unpackb(encode(Delta(request_id="r", token_ids=TokenIds([1]), text="a")), raw=False)["body"]
    assert set(body) == {"request_id", "token_ids", "text"}
    full = Delta(
        request_id="r",
        token_ids=TokenIds([]),
        text="",
        finished=True,
        finish_reason="stop",
        error="",
        num_prompt_tokens=0,
        num_cached_tokens=3,
        prompt_token_ids=TokenIds([]),
    )
    body = msgpack.unpackb(encode(full), raw=False)["body"]
    assert set(body) == {
        "request_id",
        "token_ids",
        "text",
        "finished",
        "finish_reason",
        "error",
        "num_cached_tokens",
        "prompt_token_ids",
    }  # [] is not None, "" is not None
    assert decode(encode(full)) == full


def test_sampling_travels_nested_with_only_the_fields_that_differ_from_the_defaults():
    body = msgpack.unpackb(encode(Submit(request_id="r", spec=RequestSpec(prompt="x"))), raw=False)["body"]
    assert body == {"request_id": "r", "spec": {"prompt": "x"}}
    params = SamplingParams(
        temperature=0.0,
        max_tokens=None,
        stop="\n",
        logit_bias={5: -1.5},
        seed=0,
        structured_outputs={"choice": ["a", "b"]},
    )
    submit = Submit(request_id="r", spec=RequestSpec(prompt="x", sampling=params))
    assert msgpack.unpackb(encode(submit), raw=False)["body"]["spec"]["sampling"] == {
        "temperature": 0.0,
        "max_tokens": None,
        "stop": ["\n"],
        "seed": 0,
        "logit_bias": [[5, -1.5]],
        "structured_outputs": {"choice": ["a", "b"]},
    }
    back = decode(encode(submit))
    assert back.spec.sampling == params and type(back.spec.sampling) is SamplingParams


def _frame(kind, body, version=PROTOCOL_VERSION):
    return msgpack.packb({"type": kind, "v": version, "body": body}, use_bin_type=True)


@pytest.mark.parametrize(
    "frame, message",
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "must be a map with exactly"),
        (msgpack.packb({"type": "submit", "body": {}}), "must be a map with exactly.*missing required field `v`"),
        (_frame("nope", {}), "unknown message type 'nope'"),
        (_frame("accepted", {"request_id": "r"}, version=99), "schema version 99"),
        (_frame("accepted", [1]), "'accepted': Expected `object`, got `array`"),
        (_frame("accepted", {}), "'accepted': Object missing required field `request_id`"),
        (_frame("accepted", {"request_id": "r", "extra": 1}), "unknown field `extra`"),
        (_frame("accepted", {"request_id": 5}), "field 'request_id': Expected `str`, got `int`"),
        (_frame("heartbeat", {"sent_at": "soon"}), "field 'sent_at': Expected `float`, got `str`"),
        (
            _frame(
                "load",
                {
                    "num_waiting": -1,
                    "num_running": 0,
                    "num_free_blocks": 0,
                    "num_total_blocks": 0,
                    "num_queued_tokens": 0,
                },
            ),
            "field 'num_waiting': Expected `int` >= 0",
        ),
        (
            _frame(
                "load",
                {
                    "num_waiting": True,
                    "num_running": 0,
                    "num_free_blocks": 0,
                    "num_total_blocks": 0,
                    "num_queued_tokens": 0,
                },
            ),
            "field 'num_waiting': Expected `int`, got `bool`",
        ),
        (
            _frame(
                "load",
                {
                    "num_waiting": 0,
                    "num_running": 0,
                    "num_free_blocks": 0,
                    "num_total_blocks": 0,
                    "num_queued_tokens": 0,
                    "spec_decode_num_accepted_tokens_per_pos": [0] * 65,
                },
            ),
            "field 'spec_decode_num_accepted_tokens_per_pos': Expected `array` of length <= 64",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {}}),
            "field 'spec': exactly one of 'prompt' and 'prompt_token_ids'",
        ),
        (_frame("submit", {"request_id": "r"}), "'submit': Object missing required field `spec`"),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"temperature": -1}}}),
            "field 'spec.sampling.temperature': temperature must be >= 0",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"temprature": 1}}}),
            "field 'spec.sampling': Object contains unknown field `temprature`",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"top_p": 2}}}),
            "field 'spec.sampling.top_p': top_p must be in \\(0, 1\\]",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"top_p": "x"}}}),
            "field 'spec.sampling.top_p': Expected `float`, got `str`",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"max_tokens": 2**64 - 1}}}),
            "field 'spec.sampling.max_tokens': max_tokens must fit in 64 bits",
        ),
        (
            _frame(
                "submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"min_tokens": 9, "max_tokens": 3}}}
            ),
            "field 'spec.sampling.min_tokens': min_tokens \\(9\\) must be <= max_tokens \\(3\\)",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"stop": 5}}}),
            "field 'spec.sampling.stop': Expected `array`, got `int`",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"stop": ["a", 3]}}}),
            "field 'spec.sampling.stop\\[1\\]': Expected `str`, got `int`",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"stop": ["a", ""]}}}),
            "field 'spec.sampling.stop': stop must hold non-empty strings",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"logit_bias": [[1, 1e9]]}}}),
            "field 'spec.sampling.logit_bias': logit_bias values must be in \\[-100, 100\\]",
        ),
        (
            _frame(
                "submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"structured_outputs": {"regex": 5}}}}
            ),
            "field 'spec.sampling.structured_outputs.regex': Expected `str | null`, got `int`",
        ),
        (
            _frame(
                "submit",
                {"request_id": "r", "spec": {"prompt": "x", "sampling": {"structured_outputs": {"regex": ""}}}},
            ),
            "field 'spec.sampling.structured_outputs': structured_outputs.regex must be a non-empty string",
        ),
        (
            _frame(
                "submit",
                {
                    "request_id": "r",
                    "spec": {"prompt": "x", "sampling": {"structured_outputs": {"regex": "a", "x": 1}}},
                },
            ),
            "field 'spec.sampling.structured_outputs': Object contains unknown field `x`",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": {1: 2, "b": 3}}}),
            "Expected `str`, got `int` - at `key` in `\\$.spec.sampling`",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt": "x", "sampling": [1]}}),
            "field 'spec.sampling': Expected `object`, got `array`",
        ),
        (
            _frame("dispatch", {"request_id": "r", "spec": {"prompt": "x", "sampling": {"seed": -1}}}),
            "field 'spec.sampling.seed': seed must be in \\[0, 2\\*\\*63\\)",
        ),
        (
            _frame("dispatch", {"request_id": "r", "prompt": "x"}),
            "'dispatch': Object contains unknown field `prompt`",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt_token_ids": b"\x01\x02\x03"}}),
            "field 'spec.prompt_token_ids': Expected `array \\| null`, got `bytes`",
        ),
        (
            _frame("submit", {"request_id": "r", "spec": {"prompt_token_ids": [1, -1]}}),
            "field 'spec.prompt_token_ids\\[1\\]': Expected `int` >= 0",
        ),
        (_frame("submit", {"request_id": "", "spec": {"prompt": "x"}}), "'request_id' must be 1..256"),
        (
            _frame("dispatch", {"request_id": "", "spec": {"prompt": "x", "sampling": {}}}),
            "field 'request_id': Expected `str` of length >= 1",
        ),
        (_frame("control", {"command": "explode"}), "field 'command': Invalid enum value 'explode'"),
        (_frame("hello", {"role": "worker", "peer_id": "w"}), "a worker hello needs field 'model_id'"),
        (_frame("hello", {"role": "admin", "peer_id": "w"}), "'role' must be one of"),
        (_frame("delta", {"request_id": "r", "token_ids": [], "text": "", "finished": True}), "needs a finish_reason"),
        (
            _frame("step_batch", {"deltas": [{"request_id": "r"}], "load": {}}),
            "field 'deltas\\[0\\]': Object missing required field `token_ids`",
        ),
        (
            _frame(
                "step_batch",
                {"deltas": [{"request_id": "r", "token_ids": [], "text": "", "finished": True}], "load": {}},
            ),
            "field 'deltas\\[0\\]': a finished delta needs a finish_reason",
        ),
        (_frame("step_batch", {"deltas": [5], "load": {}}), "field 'deltas\\[0\\]': Expected `object`, got `int`"),
        (
            _frame("dispatch", {"request_id": "r", "spec": {"sampling": {}, "prompt": "x"}, "resumed_token_ids": [1]}),
            "'resumed_token_ids' needs 'spec.prompt_token_ids'",
        ),
        (_frame("stats_request", {"min_healthy_workers": -1}), "'min_healthy_workers' must be >= 0"),
        (_frame("stats_request", {"timeout_s": 1e9}), "'timeout_s' must be in"),
        (_frame("delta_batch", {"deltas": {}}), "field 'deltas': Expected `array`, got `object`"),
        (_frame("heartbeat", {"sent_at": 1.0, "load": 3}), "field 'load': Expected `object \\| null`, got `int`"),
        (_frame("cluster_stats", {"workers": []}), "missing required field `coordinator_id`"),
    ],
)
def test_malformed_frames_name_the_problem(frame, message):
    with pytest.raises(ProtocolError, match=message):
        decode(frame)


def test_protocol_error_names_the_header_when_readable():
    with pytest.raises(ProtocolError) as info:
        decode(_frame("hello", {"role": "worker", "peer_id": "w"}, version=7))
    assert info.value.message_type == "hello"
    with pytest.raises(ProtocolError) as info:
        decode(_frame("hello", {"role": 1, "peer_id": "w"}))
    assert info.value.message_type == "hello"
    with pytest.raises(ProtocolError) as info:
        decode(b"\xc1")
    assert info.value.message_type is None


def test_oversized_frame_is_refused_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(b"\x00" * 101, max_bytes=100)
    assert MAX_FRAME_BYTES >= 1 << 20


def test_non_bytes_frame():
    with pytest.raises(ProtocolError, match="must be bytes"):
        decode("text")  # type: ignore[arg-type]


def test_constructing_an_invalid_message_raises_too():
    with pytest.raises(ProtocolError, match="'command' must be one of"):
        Control(command="halt")


def _mutations(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(3)
        if op == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 1 and data:
            del data[rng.randrange(len(data)) :]
        else:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
    return bytes(data)


def test_fuzz_only_protocol_errors():
    """20,000 random and mutated frames: each decodes to a valid message or raises ProtocolError, never
    anything else."""
    rng = random.Random(2026)
    valid = [encode(m) for m in EXAMPLES]
    outcomes = {"ok": 0, "error": 0}
    for i in range(20_000):
        if i % 2:
            frame = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        else:
            frame = _mutations(rng, rng.choice(valid))
        try:
            decode(frame)
            outcomes["ok"] += 1
        except ProtocolError:
            outcomes["error"] += 1
    assert outcomes["error"] > 10_000 and sum(outcomes.values()) == 20_000


@pytest.mark.parametrize(
    "bad, text",
    [
        (dict(timeout_s=0.0), "timeout_s"),
        (dict(timeout_s=float("nan")), "timeout_s"),
        (dict(delivered_token_ids=TokenIds([3])), "reattach"),
        (
            dict(reattach=True, delivered_token_ids=TokenIds([3, 4, 5]), max_tokens=2),
            "'delivered_token_ids' hold 3 tokens, more than sampling.max_tokens \\(2\\)",
        ),
    ],
)
def test_submit_deadline_and_reattach_are_checked(bad, text):
    sampling = SamplingParams(max_tokens=bad.pop("max_tokens", 16))
    with pytest.raises(ProtocolError, match=text):
        Submit(request_id="r", spec=RequestSpec(prompt_token_ids=TokenIds([1]), sampling=sampling), **bad)


@pytest.mark.parametrize(
    "build, text",
    [
        (lambda: UpdateWeights(), "exactly one of 'path' and 'sync'"),
        (lambda: UpdateWeights(path="/m", on_running="later"), "'on_running' must be one of drain, abort"),
        (lambda: UpdateWeights(path="/m", timeout_s=0), "'timeout_s' must be in"),
        (
            lambda: WeightSync(init_method="10.0.0.1:5", world_size=2, tensors=[WeightTensor("x", "float32", [1])]),
            "tcp://HOST:PORT",
        ),
        (
            lambda: WeightSync(init_method="tcp://h:5", world_size=1, tensors=[WeightTensor("x", "float32", [1])]),
            "'world_size' must be >= 2",
        ),
        (lambda: WeightSync(init_method="tcp://h:5", world_size=2, tensors=[]), "at least one tensor"),
        (lambda: WeightTensor(name="x", dtype="int8", shape=[1]), "tensor 'x': dtype must be"),
        (lambda: WeightTensor(name="x", dtype="float32", shape=[-1]), "tensor 'x': shape"),
    ],
)
def test_weight_update_messages_are_checked(build, text):
    with pytest.raises(ProtocolError, match=text):
        build()


def test_request_output_is_the_wire_delta_and_final_makes_every_last_one():
    """The engine emits the record that travels (no copy per hop); users import it as RequestOutput."""
    assert RequestOutput is Delta
    last = Delta.final("r", "length", token_ids=[4, 5], text="ab", num_prompt_tokens=3, weight_version=2)
    assert last.finished and last.finish_reason == "length" and isinstance(last.token_ids, TokenIds)
    assert decode(encode(last)) == last
    completion = Completion("r", [1, 2, 3])
    completion.add(Delta(request_id="r", token_ids=TokenIds([3]), text="x", seed=7))
    completion.add(last)
    assert (completion.token_ids, completion.text, completion.finish_reason) == ([3, 4, 5], "xab", "length")
    assert completion.seed == 7 and completion.weight_version == 2


@pytest.mark.parametrize(
    "build, text",
    [
        (
            lambda: Placement(request_id="r", stream_address="tcp://h:1"),
            "'stream_address' and 'stream_token' go together",
        ),
        (lambda: Placement(request_id="r", stream_token=TOKEN), "'stream_address' and 'stream_token' go together"),
        (
            lambda: Dispatch(
                request_id="r", spec=RequestSpec(sampling=SamplingParams(), prompt="x"), stream_token=TOKEN
            ),
            "'stream_owner' and 'stream_token' go together",
        ),
        (
            lambda: RequestSnapshot(request_id="r", prompt_token_ids=TokenIds([1]), stream_owner=""),
            "'stream_owner' and 'stream_token' go together",
        ),
        (
            lambda: StreamBatch(
                deltas=[Delta(request_id="r", token_ids=TokenIds(), text="")], token_starts=[], text_starts=[0]
            ),
            "must be of one length",
        ),
    ],
)
def test_direct_stream_messages_are_checked(build, text):
    with pytest.raises(ProtocolError, match=text):
        build()


@pytest.mark.parametrize(
    "frame, message",
    [
        (_frame("subscribe", {"request_id": "r", "stream_token": "short"}), "stream_token"),
        (_frame("subscribe", {"request_id": "r", "stream_token": TOKEN, "num_tokens": -1}), "num_tokens"),
        (_frame("subscribe", {"request_id": "r", "stream_token": "x" * 65}), "stream_token"),
        (
            _frame("placement", {"request_id": "r", "stream_address": "ipc:///tmp/x", "stream_token": TOKEN}),
            "stream_address",
        ),
        (
            _frame(
                "placement",
                {"request_id": "r", "stream_address": "tcp://h:1", "stream_token": TOKEN, "worker_key": "k"},
            ),
            "worker_key",
        ),
        (_frame("stream_batch", {"deltas": [], "token_starts": [-1], "text_starts": [0]}), "token_starts"),
        (
            _frame(
                "dispatch",
                {
                    "request_id": "r",
                    "spec": {"sampling": {}, "prompt": "x"},
                    "stream_owner": "k" * 41,
                    "stream_token": TOKEN,
                },
            ),
            "stream_owner",
        ),
    ],
)
def test_malformed_direct_stream_frames_name_the_field(frame, message):
    with pytest.raises(ProtocolError, match=message):
        decode(frame)
