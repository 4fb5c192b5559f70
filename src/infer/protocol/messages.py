"""Wire messages: msgspec Structs with named, typed fields, one registry, explicit msgpack encode/decode.

A frame is one msgpack map: {"type": <header>, "v": <schema version>, "body": {<field>: <value>, ...}}. The header
selects the body's Struct (a tagged union keyed by type, read before the body so that an old peer's version is
named before its fields are looked at). Decoding checks everything once, where a frame enters a process: frame
size, msgpack, header, version, missing / unknown fields and every field's type and simple bounds (in C, by
msgspec, from the annotations), then what types cannot say (cross-field rules) in each Struct's `__post_init__`,
which also runs when a message is built. Any failure is a ProtocolError whose text names the field's path
("field 'sampling.top_p': ..."); nothing from the wire is ever pickled or evaluated. A field at its default
stays off the wire (`omit_defaults`): most deltas carry 3 fields. The frame's shape is bounded before anything
is built (protocol/bounds.py: at most MAX_FRAME_BYTES, nested at most 32 deep, no array or map past MAX_ITEMS);
`decode` raises nothing but ProtocolError, whatever the bytes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec.structs import force_setattr

from infer.protocol.bounds import Items, Mapping, ShapeError, check_shape
from infer.protocol.codes import ClusterState, Command, ErrorCode, FinishReason, Word, WorkerState
from infer.protocol.lora import check_lora_name
from infer.protocol.sampling import SamplingParams
from infer.protocol.tracing import parse_traceparent

# 2: error codes client_lost / client_too_slow / draining, Heartbeat.step_age_s
# 3: a re-dispatch carries the request's own max_tokens / min_tokens (the engine counts the resumed tokens); a worker
#    echoes the prompt's token ids only for a text prompt
# 4: msgspec Structs; token ids travel as msgpack arrays of ints (checked in C), SamplingParams with only the fields
#    that differ from the defaults; Submit and Dispatch carry `traceparent`
# 5: what a request asks for (prompt or ids, images, decoder prompt, SamplingParams, priority) is one nested
#    RequestSpec, carried unchanged by Submit, the coordinator's record and every Dispatch; RequestSpec.audio (an
#    optional field a v5 peer without it refuses as unknown only when a request carries audio)
#    Load.kv_offload_host_* (optional counters of the host-memory KV tier: a v5 peer without them refuses them
#    only from a worker with --kv-offload-host-gb)
PROTOCOL_VERSION = 5
MAX_FRAME_BYTES = 64 << 20  # also set as the sockets' ZMQ_MAXMSGSIZE
MAX_ID_LEN = 256
MAX_MODEL_ID_LEN = 4096  # a model id is a name or the model's path (Hello.model_id, Submit.model)
MAX_TOKENIZER_SOURCES = 8  # ModelStats.tokenizers: the distinct places a model's workers read their tokenizer
MAX_DP_RANK = (1 << 20) - 1
MAX_SESSION_ID_LEN = 256  # Submit.session_id (the HTTP front's X-Session-ID header)
MAX_KV_EVENTS = 1 << 16  # block hashes of one KvEvents' `stored` or `removed` (a worker sends at most 8,192 a frame)
LIFECYCLE_COMMANDS = tuple(Command)
ROLES = ("client", "worker")
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")  # vLLM's names (--kv-transfer-config's kv_role)
MAX_KV_BLOCKS_PER_FRAME = 4096  # KvBlocks.blocks: a transfer goes in frames under MAX_FRAME_BYTES
MAX_STATS_WAIT_S = 3600.0
MAX_REQUEST_TIMEOUT_S = 7 * 86400.0
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 in the engine
MAX_IMAGE_BYTES = 20 << 20  # one encoded image of a prompt (RequestSpec.images)
MAX_IMAGES = 16  # images one RequestSpec may carry (a worker's --limit-mm-per-prompt may allow fewer)
MAX_REQUEST_IMAGE_BYTES = MAX_FRAME_BYTES // 2  # all images of one request: its frame keeps room for the rest
AUDIO_SAMPLE_RATE = 16000  # RequestSpec.audio's samples per second (Whisper's rate; client/audio.py resamples to it)
# RequestSpec.audio: float32 samples of one request (a window of the model's: Whisper's 30 s are 1.9 MB), with room
MAX_AUDIO_BYTES = 16 << 20


class ProtocolError(ValueError):
    """A frame or message that is not valid; the text says what is wrong (and is sent back as is).

    `message_type` is the frame's header when it could be read (so a receiver can, say, answer a bad
    "hello" with Refused rather than Error), else None.
    """

    message_type: str | None = None


class TokenIds(list):
    """A list of token ids. On the wire a msgpack array of ints, each checked in [0, MAX_TOKEN_ID] by the decoder
    (fields are annotated `TokenIdList`)."""

    @classmethod
    def checked(cls, values: Any, name: str) -> TokenIds:
        """`values` (a list or tuple of ints in [0, MAX_TOKEN_ID]) as TokenIds, else ValueError naming `name`:
        what a sender checks before it builds a message of them."""
        if not isinstance(values, (list, tuple)):
            raise ValueError(f"{name} must be a string or a list of token ids, got {type(values).__name__}")
        bad = next(
            (v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKEN_ID), None
        )
        if bad is not None:
            raise ValueError(f"{name} token ids must be integers in [0, {MAX_TOKEN_ID}], got {bad!r}")
        return cls(values)


# Types with bounds the decoder checks in C (a message built in-process is not checked against them: its builder
# made the values).
TokenIdList = Items[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Token = Annotated[str, msgspec.Meta(min_length=16, max_length=64)]  # a direct stream's capability
Address = Annotated[str, msgspec.Meta(min_length=6, max_length=MAX_ID_LEN, pattern="^tcp://")]
Owner = Annotated[str, msgspec.Meta(max_length=40)]  # a direct stream's owner: a z85 public key, "" without keys
ModelId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODEL_ID_LEN)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
ShmPath = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]  # a KV transfer's shared-memory file
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Priority = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SESSION_ID_LEN)]
# a prompt's images, encoded (PNG, JPEG, ...: the worker decodes and checks them, worker/engine/images.py), in the order
# of its image tokens
Images = Annotated[
    list[Annotated[bytes, msgspec.Meta(max_length=MAX_IMAGE_BYTES)]], msgspec.Meta(max_length=MAX_IMAGES)
]
# a request's audio: float32 little-endian PCM, mono, at AUDIO_SAMPLE_RATE (checked by worker/engine/audio.py)
AudioSamples = Annotated[bytes, msgspec.Meta(max_length=MAX_AUDIO_BYTES)]
# a block hash: an unsigned 64-bit int (msgpack holds no larger integer, so `ge=0` is the whole bound)
BlockHashes = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_KV_EVENTS)]


DEFAULT_SAMPLING = SamplingParams()


class Message(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base of every message. Subclasses set TYPE (the header) and declare named, typed fields; checks that
    types cannot state go in `__post_init__` (raise ProtocolError), which runs when a message is built and
    when it is decoded."""

    TYPE: ClassVar[str] = ""


REGISTRY: dict[str, type[Message]] = {}


def message(cls: type[Message]) -> type[Message]:
    """Class decorator: register `cls` under its TYPE header."""
    if not cls.TYPE or cls.TYPE in REGISTRY:
        raise RuntimeError(f"message type {cls.TYPE!r} is empty or registered twice")
    REGISTRY[cls.TYPE] = cls
    return cls


def _require(condition: bool, text: str) -> None:
    if not condition:
        raise ProtocolError(text)


def _check_optional_lora_name(name: str | None) -> None:
    if name is not None:
        try:
            check_lora_name(name)
        except ValueError as e:
            raise ProtocolError(f"field 'lora_name': {e}") from None


def _check_id(name: str, value: str) -> None:
    if not 0 < len(value) <= MAX_ID_LEN:  # (not _require: the message is formatted only when it fails)
        raise ProtocolError(f"field {name!r} must be 1..{MAX_ID_LEN} characters, got {len(value)}")


def _check_priority(priority: int) -> None:
    if not -(2**63) <= priority < 2**63:
        raise ProtocolError(f"field 'priority' must be a 64-bit integer, got {priority}")


def _check_traceparent(value: str | None) -> None:
    if value is not None and parse_traceparent(value) is None:
        raise ProtocolError(
            f"field 'traceparent' must be a W3C traceparent '00-<32 hex>-<16 hex>-<2 hex>' with "
            f"non-zero ids, got {value[:80]!r}"
        )


_Kind = type[Word]


def _member(kinds: tuple[_Kind, ...], value: Any, name: str, nullable: bool = False) -> Any:
    """`value` as a member of the first of `kinds` that has it (a member of one of them stays as it is), or
    ProtocolError naming field `name` and its choices. A str enum is its string, so this never changes a frame."""
    if type(value) in kinds or (value is None and nullable):
        return value
    if isinstance(value, str):
        for kind in kinds:
            member = kind._value2member_map_.get(value)
            if member is not None:
                return member
    choices = ", ".join(dict.fromkeys(m.value for kind in kinds for m in kind))
    raise ProtocolError(f"field {name!r} must be one of {choices}{' or null' if nullable else ''}, got {value!r:.80}")


def _set_members(msg: Message, nullable: bool = False, **kinds: _Kind | tuple[_Kind, ...]) -> None:
    """In `__post_init__`: each named field of `msg` as a member of its enum(s) (see `_member`); a decoded
    field already is one (msgspec made it)."""
    for name, kind in kinds.items():
        value = getattr(msg, name)
        member = _member(kind if isinstance(kind, tuple) else (kind,), value, name, nullable)
        if member is not value:
            force_setattr(msg, name, member)


# ---- handshake -----------------------------------------------------------------------------------


@message
class RequestSnapshot(Message, frozen=True):
    """A request a worker is running, as it stands, sent in its Hello when it registers again (say, with a
    restarted coordinator), so the coordinator can hand the stream back to its client without a gap.

    `token_ids` is every output token so far; the first `resumed` of them came with the Dispatch
    (`resumed_token_ids`: the client had them before this worker ran it), the rest left in deltas. Delta j
    carried output tokens up to `delta_ends[j]` and text up to `text_ends[j]` of `text` (the text of the
    tokens after the resumed ones); a client that holds n tokens gets the rest from that boundary on
    (protocol/journal.py: StreamJournal, which makes and reads these).
    """

    TYPE: ClassVar[str] = "request_snapshot"
    request_id: str
    prompt_token_ids: TokenIdList
    token_ids: TokenIdList = msgspec.field(default_factory=list)
    resumed: int = 0
    text: str = ""
    delta_ends: Items[int] = msgspec.field(default_factory=list)
    text_ends: Items[int] = msgspec.field(default_factory=list)
    seed: Seed | None = None  # the sampling seed it runs with
    # A direct stream's (Dispatch.stream_owner / stream_token): a restarted coordinator hands it back to its owner
    # only, with a Placement at this worker under the same token (docs/architecture.md, "Direct streams")
    stream_owner: Owner | None = None
    stream_token: Token | None = None

    def __post_init__(self) -> None:
        _check_id("request_id", self.request_id)
        _require(
            (self.stream_owner is None) == (self.stream_token is None), "'stream_owner' and 'stream_token' go together"
        )
        _require(
            0 <= self.resumed <= len(self.token_ids),
            f"field 'resumed' must be in [0, {len(self.token_ids)}], got {self.resumed}",
        )
        _require(len(self.delta_ends) == len(self.text_ends), "'delta_ends' and 'text_ends' differ in length")
        _require(
            list(self.delta_ends) == sorted(self.delta_ends) and list(self.text_ends) == sorted(self.text_ends),
            "'delta_ends' and 'text_ends' must not decrease",
        )
        _require(
            not self.delta_ends
            or (
                self.resumed <= self.delta_ends[0]
                and self.delta_ends[-1] <= len(self.token_ids)
                and self.text_ends[-1] <= len(self.text)
            ),
            "'delta_ends' / 'text_ends' point outside 'token_ids' / 'text'",
        )


@message
class Hello(Message, frozen=True):
    """First frame of every peer. Workers also state what they serve and what they can hold."""

    TYPE: ClassVar[str] = "hello"
    role: str
    peer_id: str
    protocol_version: int = PROTOCOL_VERSION
    model_id: ModelId | None = (
        None  # a worker's: the model it serves (a name or its path); its DP ranks are the model's
    )
    # A worker's DP rank and EP group: None asks the coordinator to assign them (the lowest free rank, group
    # "dp<rank>"); `rank_hint` is the rank a coordinator gave this process before (kept across a restart).
    dp_rank: int | None = None
    group_id: str | None = None
    rank_hint: int | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    running: Items[str] = msgspec.field(default_factory=list)  # request ids a worker still runs (re-registration)
    snapshots: Items[RequestSnapshot] = msgspec.field(default_factory=list)  # those requests as they stand
    max_waiting: int | None = None  # a worker's bound on requests waiting in its engine (admission control)
    # A worker process's random id, and the Dispatch frames it had received (since the Welcome of this
    # coordinator instance) when it sent this Hello: a Hello that crossed later Dispatches does not lose them.
    incarnation: str | None = None
    dispatches_seen: int | None = None
    weight_version: int = 0  # a worker's: the weights it serves (routed only at the cluster's version)
    lora_adapters: Mapping[str, str] = msgspec.field(default_factory=dict)  # a worker's LoRA adapters: name -> folder
    # A worker's model directory (absolute), where an HTTP front reads the model's tokenizer; sent only when
    # `model_id` does not say it (--served-model-name), so a worker named by its path sends nothing new.
    tokenizer: ModelId | None = None
    # A worker's stream socket (docs/architecture.md, "Direct streams"): where clients subscribe to its requests'
    # deltas (tcp://HOST:PORT). A client's `streams`: it subscribes at workers (else the coordinator relays).
    stream_address: Address | None = None
    streams: bool = False
    # A worker's KV role (docs/architecture.md, "Disaggregated prefill and decode"): kv_producer workers prefill
    # and hand requests off, kv_consumer workers receive their KV blocks at `kv_address` and decode them. Any worker
    # started with --kv-transfer-config has a `kv_address` (a drain moves requests there with their KV).
    kv_role: str = "kv_both"
    kv_address: Address | None = None

    def __post_init__(self) -> None:
        _require(self.role in ROLES, f"field 'role' must be one of {', '.join(ROLES)}, got {self.role!r}")
        _require(
            self.kv_role in KV_ROLES, f"field 'kv_role' must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r:.80}"
        )
        _require(
            self.kv_role != "kv_consumer" or self.kv_address is not None,
            "a kv_consumer hello needs field 'kv_address'",
        )
        _check_id("peer_id", self.peer_id)
        if self.role == "worker":
            for name in ("model_id", "num_kv_blocks", "block_size", "max_num_seqs", "max_model_len"):
                _require(getattr(self, name) is not None, f"a worker hello needs field {name!r}")
            for name in ("dp_rank", "rank_hint"):
                value = getattr(self, name)
                _require(
                    value is None or 0 <= value <= MAX_DP_RANK,
                    f"field {name!r} must be in [0, {MAX_DP_RANK}], got {value}",
                )
            if self.group_id is not None:
                _check_id("group_id", self.group_id)
            for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_model_len"):
                _require(getattr(self, name) >= 1, f"field {name!r} must be >= 1, got {getattr(self, name)}")
            _require(
                self.max_waiting is None or self.max_waiting >= 0,
                f"field 'max_waiting' must be >= 0, got {self.max_waiting}",
            )
            _require(
                {s.request_id for s in self.snapshots} <= set(self.running),
                "every snapshot must be of a request listed in 'running'",
            )
            _require(self.weight_version >= 0, f"field 'weight_version' must be >= 0, got {self.weight_version}")


@message
class Welcome(Message, frozen=True):
    TYPE: ClassVar[str] = "welcome"
    coordinator_id: str
    state: ClusterState
    model_id: str | None = None
    instance: str | None = None  # new with every coordinator process: a change means it restarted
    dp_rank: int | None = None  # to a worker: the DP rank it serves (assigned when its Hello gave none)
    group_id: str | None = None  # to a worker: its group
    # Several coordinators (docs/architecture.md, "Several coordinators"): the leader's term. A worker follows no
    # coordinator whose term is below one it has followed (a deposed leader that has not noticed yet).
    term: NonNegative = 0
    # To a worker: publish the prefix cache's changes (KvEvents on StepBatch), starting with a full snapshot; the
    # coordinator asks only when it routes on them (--policy kv-aware).
    kv_events: bool = False

    def __post_init__(self) -> None:
        _set_members(self, state=ClusterState)


@message
class Refused(Message, frozen=True):
    """The peer is not accepted; `reason` says exactly what differs or is wrong."""

    TYPE: ClassVar[str] = "refused"
    reason: str


@message
class Redirect(Message, frozen=True):
    """Coordinator -> client or worker: this coordinator does not lead the cluster now (one of several: docs/
    architecture.md, "Several coordinators"), and did nothing with the frame. Go to `leader`, or (None: no
    leader known yet) to the next coordinator address. Not an end, unlike Refused."""

    TYPE: ClassVar[str] = "redirect"
    reason: str
    leader: Address | None = None


# ---- coordinator to coordinator (docs/architecture.md, "Several coordinators") ----------------------

MAX_COORDINATORS = 15
PeerIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_COORDINATORS)]  # a coordinator's place in the address list


class RankHold(Message, frozen=True):
    """A DP rank the leader gave a worker (part of a Replica)."""

    worker_id: Id
    model_id: ModelId
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_DP_RANK)]
    group_id: Id


class Replica(Message, frozen=True):
    """What the leader's successor must know that no worker can tell it: the lifecycle state, the cluster's weight
    version, the LoRA adapters loaded (name -> folder, name -> base model) and the DP ranks given out. `version`
    grows with every change."""

    version: NonNegative
    state: ClusterState
    weight_version: NonNegative = 0
    lora_adapters: Mapping[str, str] = msgspec.field(default_factory=dict)
    lora_models: Mapping[str, str] = msgspec.field(default_factory=dict)
    ranks: Items[RankHold] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        _set_members(self, state=ClusterState)


@message
class PeerBeat(Message, frozen=True):
    """Leader -> the other coordinators, every beat: I lead in `term`; acknowledge beat `seq` (a majority's
    acknowledgements extend the leader's lease). Carries the Replica when it changed (and now and then)."""

    TYPE: ClassVar[str] = "peer_beat"
    term: NonNegative
    sender: PeerIndex
    seq: NonNegative
    replica: Replica | None = None


@message
class PeerAck(Message, frozen=True):
    """A coordinator -> the leader: beat `seq` of `term` received (a `term` above the leader's deposes it)."""

    TYPE: ClassVar[str] = "peer_ack"
    term: NonNegative
    sender: PeerIndex
    seq: NonNegative


@message
class VoteRequest(Message, frozen=True):
    """A candidate -> the other coordinators: make me leader of `term`."""

    TYPE: ClassVar[str] = "vote_request"
    term: NonNegative
    sender: PeerIndex


@message
class VoteGrant(Message, frozen=True):
    """A coordinator -> a candidate: its vote in `term` (`granted`), or (not granted) the term it is at."""

    TYPE: ClassVar[str] = "vote_grant"
    term: NonNegative
    sender: PeerIndex
    granted: bool


# ---- requests and their streams ------------------------------------------------------------------


class RequestSpec(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """What a request asks of a model: built once where it enters the cluster (the client, the HTTP front), nested
    unchanged in its Submit, kept as the coordinator's record of it and nested in every Dispatch of it; a worker's
    engine takes it as it is (`Engine.add_request(..., **spec.engine_args())`). The coordinator replaces it (never
    edits it) in two ways only: a sampled request without a seed is given one, and a text prompt's token ids, once
    the first worker tokenized it, take the text's place, so that a failover runs the same tokens.

    `prompt` / `prompt_token_ids`: exactly one.
    `sampling`: SamplingParams (fields at their default stay off the wire).
    `priority`: lower is served first (vLLM's convention) by workers with the priority scheduling policy; the
    coordinator holds and sheds requests by it too (coordinator/core.py).
    `images`: the prompt's images, encoded, in the order of its image tokens (a model that takes images). A request
    without images leaves the field out (omit_defaults).
    `decoder_prompt` / `decoder_prompt_token_ids` (at most one): for an encoder-decoder model (T5, BART), whose
    `prompt` is its encoder's input, the decoder's prefix after its start token; a decoder-only worker refuses it by
    name.
    `audio`: an audio model's input (Whisper's; its `prompt` is then the decoder's), float32 little-endian PCM, mono,
    at AUDIO_SAMPLE_RATE; empty (off the wire) for any other request. A model that takes no audio refuses it.
    """

    prompt: str | None = None
    prompt_token_ids: TokenIdList | None = None
    sampling: SamplingParams = DEFAULT_SAMPLING
    priority: Priority = 0
    images: Images = msgspec.field(default_factory=list)
    decoder_prompt: str | None = None
    decoder_prompt_token_ids: TokenIdList | None = None
    audio: AudioSamples = b""

    def __post_init__(self) -> None:
        # (`if ...: raise`, not _require: the messages are formatted only for a bad request, once per request)
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ProtocolError("exactly one of 'prompt' and 'prompt_token_ids' must be given")
        if self.decoder_prompt is not None and self.decoder_prompt_token_ids is not None:
            raise ProtocolError("at most one of 'decoder_prompt' and 'decoder_prompt_token_ids' may be given")
        _check_priority(self.priority)
        if self.images:
            image_bytes = sum(map(len, self.images))
            if image_bytes > MAX_REQUEST_IMAGE_BYTES:
                limit = MAX_REQUEST_IMAGE_BYTES
                raise ProtocolError(f"field 'images' holds {image_bytes} bytes, more than {limit} a request")
        if type(self.sampling) is not SamplingParams:  # (a user's spec is built, not decoded)
            raise ProtocolError(f"field 'sampling' must be SamplingParams, got {type(self.sampling).__name__}")

    @property
    def routing_prompt(self) -> str | list[int]:
        """The prompt as routing and cost estimates read it: its token ids when known, else its text."""
        return self.prompt_token_ids if self.prompt_token_ids is not None else (self.prompt or "")

    def engine_args(self) -> dict[str, Any]:
        """`Engine.add_request`'s keyword arguments for what this spec asks (the prompt given as ids when both
        could be read: a re-dispatch runs the ids the first worker tokenized)."""
        decoder = self.decoder_prompt if self.decoder_prompt is not None else self.decoder_prompt_token_ids
        return {
            "prompt": self.routing_prompt,
            "params": self.sampling,
            "priority": self.priority,
            "images": self.images,
            "decoder_prompt": decoder,
            "audio": self.audio or None,
        }


@message
class Submit(Message, frozen=True):
    """A generation request: what it asks (`spec`, a RequestSpec) and how the cluster is to run it.

    `timeout_s`: the request fails with error code "timeout" (and is aborted, its KV blocks freed) unless it
    finishes within that many seconds of reaching the coordinator.
    `reattach`: the client sends it again after the coordinator restarted; `delivered_token_ids` are the
    output tokens the client already holds and `delivered_text_len` the characters of text it has of them,
    so the stream goes on from there (a request the coordinator already has from this client is left as
    it is). Its `spec.sampling` then carries the seed the first delta reported.
    `model`: the model to run it (a worker's model id, or a LoRA adapter: routed to the workers of its base model);
    None: the cluster's only model, or its default (coordinator/models.py says which; several models and no
    default: refused, naming them).
    `session_id`: the conversation it belongs to (the HTTP front's X-Session-ID header): the coordinator sends it to
    the DP rank that ran the session's previous request while that rank is healthy and not overloaded
    (coordinator/sessions.py), where its KV blocks are.
    """

    TYPE: ClassVar[str] = "submit"
    request_id: str
    spec: RequestSpec
    pin_rank: int | None = None
    timeout_s: float | None = None
    reattach: bool = False
    delivered_token_ids: TokenIdList = msgspec.field(default_factory=list)
    delivered_text_len: int | None = None
    traceparent: str | None = None  # W3C trace context of the request (OpenTelemetry), passed through
    model: ModelId | None = None
    session_id: SessionId | None = None

    def __post_init__(self) -> None:
        # (`if ...: raise`, not _require: the messages are formatted only for a bad Submit, once per request)
        _check_id("request_id", self.request_id)
        if self.model is not None and not 0 < len(self.model) <= MAX_MODEL_ID_LEN:
            raise ProtocolError(f"field 'model' must be 1..{MAX_MODEL_ID_LEN} characters, got {len(self.model)}")
        if self.session_id is not None and not 0 < len(self.session_id) <= MAX_SESSION_ID_LEN:
            raise ProtocolError(
                f"field 'session_id' must be 1..{MAX_SESSION_ID_LEN} characters, got {len(self.session_id)}"
            )
        _check_traceparent(self.traceparent)
        if self.delivered_text_len is not None and self.delivered_text_len < 0:
            raise ProtocolError(f"field 'delivered_text_len' must be >= 0, got {self.delivered_text_len}")
        if self.pin_rank is not None and self.pin_rank < 0:
            raise ProtocolError(f"field 'pin_rank' must be >= 0, got {self.pin_rank}")
        if self.timeout_s is not None and not 0 < self.timeout_s <= MAX_REQUEST_TIMEOUT_S:
            raise ProtocolError(
                f"field 'timeout_s' must be in (0, {MAX_REQUEST_TIMEOUT_S:g}] seconds, got {self.timeout_s}"
            )
        if type(self.spec) is not RequestSpec:  # (a user's Submit is built, not decoded)
            raise ProtocolError(f"field 'spec' must be RequestSpec, got {type(self.spec).__name__}")
        if self.delivered_token_ids:
            self._check_delivered()

    def _check_delivered(self) -> None:
        _require(
            self.reattach and self.spec.prompt_token_ids is not None,
            "'delivered_token_ids' needs 'reattach' and 'spec.prompt_token_ids'",
        )
        max_tokens = self.spec.sampling.max_tokens
        _require(
            max_tokens is None or len(self.delivered_token_ids) <= max_tokens,
            f"'delivered_token_ids' hold {len(self.delivered_token_ids)} tokens, more than sampling.max_tokens "
            f"({max_tokens})",
        )


@message
class Dispatch(Message, frozen=True):
    """Coordinator -> worker: run this request (`spec`: the RequestSpec its Submit carried, with the seed the
    coordinator gave it and, once known, its prompt's token ids).

    After a failover, `resumed_token_ids` holds the tokens already delivered to the client and
    `resumed_text_len` the characters of their text the client has (None: unknown, all that the worker's
    detokenizer would have shown): the worker appends the tokens to the prompt, rebuilds its detokenizer
    and stop-string state from them, and sends only the text past that point. `spec.sampling` is the request's
    own, unchanged (the engine counts the resumed tokens toward max_tokens and min_tokens), with its seed, so
    the stream goes on with no token or character lost or repeated, as if nothing had happened.

    `client` is a short tag of the client that submitted it (a hash of its identity, the same for all its
    requests): the worker counts each client's grammar compiles by it (worker/engine/structured.py).
    """

    TYPE: ClassVar[str] = "dispatch"
    request_id: Id
    spec: RequestSpec
    resumed_token_ids: TokenIdList = msgspec.field(default_factory=list)
    resumed_text_len: NonNegative | None = None
    client: Id | None = None
    traceparent: str | None = None  # W3C trace context of the request (OpenTelemetry), passed through
    # A direct stream: its deltas go to the stream peer that subscribes with `stream_token` and, with keys, whose
    # authenticated key is `stream_owner` (z85; "" without keys). None: relayed through the coordinator.
    stream_owner: Owner | None = None
    stream_token: Token | None = None
    # To a kv_producer: prefill it, stream its first token, send its KV blocks to this consumer's KV socket
    # (`kv_consumer_key`: the consumer's public key, z85, "" without keys), then give it back (ErrorCode.KV_HANDOFF).
    kv_consumer_address: Address | None = None
    kv_consumer_key: Owner | None = None

    def __post_init__(self) -> None:
        _check_traceparent(self.traceparent)
        if (self.kv_consumer_address is None) != (self.kv_consumer_key is None):
            raise ProtocolError("'kv_consumer_address' and 'kv_consumer_key' go together")
        if (self.stream_owner is None) != (self.stream_token is None):
            raise ProtocolError("'stream_owner' and 'stream_token' go together")
        if type(self.spec) is not RequestSpec:
            raise ProtocolError(f"field 'spec' must be RequestSpec, got {type(self.spec).__name__}")
        if self.resumed_token_ids and self.spec.prompt_token_ids is None:
            raise ProtocolError("'resumed_token_ids' needs 'spec.prompt_token_ids'")


@message
class Accepted(Message, frozen=True):
    TYPE: ClassVar[str] = "accepted"
    request_id: Id


@message
class BeamOutput(Message, frozen=True):
    """One beam of a finished beam search (worker/engine/beam_search.py), best first in `Delta.beams`: its output
    tokens, their text, the sum of their log-probabilities, its length-penalized score and why it ended;
    `logprobs`: for each output token, the top log-probabilities of its step (the token's own among them; vLLM's
    beam logprobs)."""

    TYPE: ClassVar[str] = "beam"
    token_ids: TokenIdList
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason
    logprobs: Items[Mapping[int, float]] | None = None

    def __post_init__(self) -> None:
        _set_members(self, finish_reason=FinishReason)


@message
class Delta(Message, frozen=True):
    """New tokens of one request (a stream delta); the last one has `finished` and `finish_reason`.

    The one record of a request's output, from the engine that makes it (`Engine.step`) over the wire to the
    user (`RequestOutput` is this class): `token_ids` and `text` are new since the previous delta; the last
    delta carries `finish_reason` (and `error`, `error_code` when it is "error"); make it with `final`.
    """

    TYPE: ClassVar[str] = "delta"
    request_id: Id
    token_ids: TokenIdList
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: Items[Mapping[int, float]] | None = None
    num_prompt_tokens: NonNegative = 0
    num_cached_tokens: NonNegative = 0
    prompt_token_ids: TokenIdList | None = None  # a worker's first delta of a text prompt: what it tokenized
    error_code: ErrorCode | None = None  # with finish_reason "error": why (protocol/codes.py)
    queue_time_s: float | None = None  # a worker's first delta: seconds waiting before first scheduled
    seed: Seed | None = None  # the first delta: the sampling seed the request runs with
    prompt_logprobs: Items[Mapping[int, float]] | None = None  # the first delta, when asked: prompt tokens 1..
    weight_version: int = 0  # the version of the weights that computed it (update_weights)
    embedding: Items[float] | None = None  # a pooling request's last delta: its vector (worker/engine/pooling.py)
    beams: Items[BeamOutput] | None = None  # a beam search's last (and only) delta: its best n beams, best first
    # a direct stream's end as its worker tells the coordinator (tokens and text went to the client): the output
    # tokens the stream carried in all, resumed ones included (docs/architecture.md, "Direct streams")
    num_output_tokens: NonNegative = 0

    @classmethod
    def final(
        cls,
        request_id: str,
        finish_reason: FinishReason | str,
        error: str | None = None,
        error_code: ErrorCode | str | None = None,
        *,
        token_ids: Sequence[int] = (),
        text: str = "",
        **fields: Any,
    ) -> Delta:
        """The last delta of a request; every one is made here. With no tokens: how a request ends when it is
        refused, aborted, failed or out of budget; the engine's carries its last tokens and text. `fields`: any
        other Delta field (prompt_token_ids, num_prompt_tokens, queue_time_s, ...)."""
        return cls(
            request_id=request_id,
            token_ids=TokenIds(token_ids),
            text=text,
            finished=True,
            finish_reason=_member((FinishReason,), finish_reason, "finish_reason"),
            error=error,
            error_code=_member((ErrorCode,), error_code, "error_code", nullable=True),
            **fields,
        )

    def __post_init__(self) -> None:
        reason, code = self.finish_reason, self.error_code
        if (reason is not None and type(reason) is not FinishReason) or (
            code is not None and type(code) is not ErrorCode
        ):  # words given as plain strings
            _set_members(self, nullable=True, finish_reason=FinishReason, error_code=ErrorCode)
        if self.finished != (reason is not None):
            raise ProtocolError("a finished delta needs a finish_reason, and only a finished one")


@message
class Abort(Message, frozen=True):
    TYPE: ClassVar[str] = "abort"
    request_ids: Items[Id]


@message
class Error(Message, frozen=True):
    """A failure sent back to the peer: for a request (request_id set) or for a frame/command."""

    TYPE: ClassVar[str] = "error"
    message: str
    request_id: str | None = None
    code: ErrorCode | None = None  # for a request's failure: why (protocol/codes.py)
    stream_token: Token | None = None  # a worker stream socket's answer to a Subscribe: the token it named

    def __post_init__(self) -> None:
        _set_members(self, nullable=True, code=ErrorCode)


# ---- load, liveness, lifecycle -------------------------------------------------------------------


@message
class Load(Message, frozen=True):
    """What one engine has to do and what it holds, now: the engine fills it (`Engine.load`), the worker sends it
    with every batch of deltas and on each heartbeat, the coordinator routes on it, LocalEngine reports it.

    num_queued_tokens: over its unfinished requests, tokens whose KV is not computed yet (prompt, or prompt +
        output after a preemption) + tokens still to generate (up to max_tokens): an upper bound on the work left.
    num_preemptions, prefix_cache_queries, prefix_cache_hits: counters since the engine started (prompt tokens
        looked up in the prefix cache / found there).
    weight_version: the weights it serves (update_weights); suspended, bytes_released: its KV pool and weights
        are released (suspend), and what that gave back.
    spec_decode_*: speculative decoding's counters since the engine started (vLLM's names): verification chunks,
        their draft tokens, the drafts accepted, and accepted drafts by position (index j: position j + 1).
    kv_offload_*: the KV tier beyond the pool (--kv-offload-dir), blocks since the engine started: written to disk,
        read back into the pool (their tokens count in prefix_cache_hits), not written (the writer's queue full, a
        write error), and files rejected (corrupt, truncated, foreign: deleted, recomputed).
    kv_offload_host_*: the KV tier in host memory (--kv-offload-host-gb), blocks since the engine started: copied in,
        read back into the pool (their tokens count in prefix_cache_hits), let go with nowhere to go (pushed out with
        no disk tier below, or no slot free; a block moved down to disk is not dropped: it counts in
        kv_offload_spilled_blocks once written), and entries rejected (checksum or prefix mismatch: recomputed).
    """

    TYPE: ClassVar[str] = "load"
    num_waiting: NonNegative
    num_running: NonNegative
    num_free_blocks: NonNegative
    num_total_blocks: NonNegative
    num_queued_tokens: NonNegative
    num_preemptions: NonNegative = 0
    prefix_cache_queries: NonNegative = 0
    prefix_cache_hits: NonNegative = 0
    weight_version: NonNegative = 0
    suspended: bool = False
    bytes_released: NonNegative = 0
    spec_decode_num_drafts: NonNegative = 0
    spec_decode_num_draft_tokens: NonNegative = 0
    spec_decode_num_accepted_tokens: NonNegative = 0
    spec_decode_num_accepted_tokens_per_pos: Annotated[list[NonNegative], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=list
    )
    kv_offload_spilled_blocks: NonNegative = 0
    kv_offload_loaded_blocks: NonNegative = 0
    kv_offload_dropped_blocks: NonNegative = 0
    kv_offload_corrupt_blocks: NonNegative = 0
    kv_offload_host_spilled_blocks: NonNegative = 0
    kv_offload_host_loaded_blocks: NonNegative = 0
    kv_offload_host_dropped_blocks: NonNegative = 0
    kv_offload_host_corrupt_blocks: NonNegative = 0
    # KV transfers between workers (disaggregated prefill and decode): blocks a producer sent, blocks a consumer
    # stored in its prefix cache, blocks it received but could not store (no free block, a gap, a bad checksum)
    kv_transfer_sent_blocks: NonNegative = 0
    kv_transfer_received_blocks: NonNegative = 0
    kv_transfer_dropped_blocks: NonNegative = 0
    # images (a model that takes them, worker/engine/vision.py): images run through the vision encoder, and images whose
    # features came from its cache instead, since the engine started
    mm_images_encoded: NonNegative = 0
    mm_encoder_cache_hits: NonNegative = 0


class KvEvents(Message, frozen=True):
    """A worker's prefix-cache changes since its previous KvEvents (worker/kv/events.py; the coordinator's index:
    coordinator/kv_index.py). Hashes are the cache's own block keys (protocol/prefix_hash.py); a hash is held while
    at least one cached block of the worker has it. `stored` and `removed` are disjoint (a hash's latest state).

    `epoch` changes with every snapshot and `seq` counts the KvEvents of an epoch from 0, so the coordinator sees a
    lost or rejected frame as a gap; `reset`: forget every hash this worker held before applying (the first frame of
    a snapshot, whose hashes may span several frames). On a gap the coordinator drops the worker's entries and sends
    KvResync; the worker's next KvEvents is a reset.
    """

    TYPE: ClassVar[str] = "kv_events"
    epoch: NonNegative
    seq: NonNegative
    reset: bool = False
    stored: BlockHashes = msgspec.field(default_factory=list)
    removed: BlockHashes = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        _require(not self.reset or self.seq == 0, f"a reset starts its epoch: field 'seq' must be 0, got {self.seq}")


@message
class StepBatch(Message, frozen=True):
    """Worker -> coordinator, once per engine step: every request's delta of that step and the load after it, and
    the prefix cache's changes (`kv_events`) when the coordinator asked for them (Welcome.kv_events)."""

    TYPE: ClassVar[str] = "step_batch"
    deltas: Items[Delta]
    load: Load
    kv_events: KvEvents | None = None


@message
class KvResync(Message, frozen=True):
    """Coordinator -> worker: its KvEvents had a gap (a frame lost or rejected) or broke a bound; the coordinator
    forgot what the worker holds, and the worker's next KvEvents is a full snapshot (reset)."""

    TYPE: ClassVar[str] = "kv_resync"
    reason: str = ""


@message
class Heartbeat(Message, frozen=True):
    """Liveness, both ways. A worker attaches its load (an idle worker sends no StepBatch); the coordinator
    its instance, so a peer notices a restart."""

    TYPE: ClassVar[str] = "heartbeat"
    sent_at: float
    load: Load | None = None
    instance: str | None = None  # the coordinator's (see Welcome.instance)
    step_age_s: float | None = None  # a worker inside an engine step: how long that step has run so far


@message
class Control(Message, frozen=True):
    """A lifecycle command: pause / unpause / suspend / resume / stop."""

    TYPE: ClassVar[str] = "control"
    command: Command

    def __post_init__(self) -> None:
        _set_members(self, command=Command)


@message
class ControlAck(Message, frozen=True):
    """A worker's (or the coordinator's) answer to a Control. A worker's suspend / resume ack says the bytes
    its engine released / restored; the coordinator answers suspend and resume once every worker acked."""

    TYPE: ClassVar[str] = "control_ack"
    command: Command
    state: str  # a ClusterState (the cluster's) or WorkerState (a worker's), made a member when built or decoded:
    # a ClusterState where the name is one, so "draining" is the only WorkerState a decoder sees
    bytes_released: int = 0
    bytes_restored: int = 0
    error: str | None = None  # a worker whose engine failed to carry the command out

    def __post_init__(self) -> None:
        _set_members(self, command=Command, state=(ClusterState, WorkerState))


# ---- weight refit --------------------------------------------------------------------------------

ON_RUNNING = ("drain", "abort")
SYNC_BACKENDS = ("gloo", "nccl")
MAX_REFIT_TIMEOUT_S = 24 * 3600.0


@message
class WeightTensor(Message, frozen=True):
    """One tensor a trainer broadcasts: its checkpoint name, dtype ("float32", "bfloat16", "float16") and
    shape, in broadcast order."""

    TYPE: ClassVar[str] = "weight_tensor"
    name: str
    dtype: str
    shape: Items[int]

    def __post_init__(self) -> None:
        _require(0 < len(self.name) <= 1024, f"field 'name' must be 1..1024 characters, got {len(self.name)}")
        _require(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"tensor {self.name!r}: dtype must be float32, bfloat16 or float16, got {self.dtype!r}",
        )
        _require(
            all(type(d) is int and d >= 0 for d in self.shape),
            f"tensor {self.name!r}: shape must be non-negative integers, got {self.shape!r}",
        )


@message
class WeightSync(Message, frozen=True):
    """A weight-sync group: the trainer (rank 0) hosts the rendezvous store at `init_method` and broadcasts
    `tensors` in buckets of at most `bucket_bytes` (consecutive tensors of one dtype; one tensor larger than
    that is a bucket of its own) to ranks 1..world_size-1, one per worker (`rank`: set by the coordinator)."""

    TYPE: ClassVar[str] = "weight_sync"
    init_method: str
    world_size: int
    tensors: Items[WeightTensor]
    rank: int = 0
    backend: str = "gloo"
    bucket_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        _require(
            self.init_method.startswith("tcp://") and ":" in self.init_method[6:],
            f"field 'init_method' must be tcp://HOST:PORT, got {self.init_method!r}",
        )
        _require(
            self.world_size >= 2, f"field 'world_size' must be >= 2 (the trainer and a worker), got {self.world_size}"
        )
        _require(0 <= self.rank < self.world_size, f"field 'rank' must be in [0, {self.world_size}), got {self.rank}")
        _require(
            self.backend in SYNC_BACKENDS,
            f"field 'backend' must be one of {', '.join(SYNC_BACKENDS)}, got {self.backend!r}",
        )
        _require(self.bucket_bytes >= 1, f"field 'bucket_bytes' must be >= 1, got {self.bucket_bytes}")
        _require(bool(self.tensors), "field 'tensors' must name at least one tensor")


@message
class UpdateWeights(Message, frozen=True):
    """Load new weights into every worker (client -> coordinator -> workers): from the safetensors directory
    `path` (read by each worker), or from a trainer over torch.distributed (`sync`). Requests in flight
    either finish on the old weights first ("drain") or are aborted ("abort"); new ones wait. `version`: set
    by the coordinator (the cluster's next weight version)."""

    TYPE: ClassVar[str] = "update_weights"
    path: str | None = None
    sync: WeightSync | None = None
    on_running: str = "drain"
    timeout_s: float = 600.0
    version: int | None = None

    def __post_init__(self) -> None:
        _require((self.path is None) != (self.sync is None), "exactly one of 'path' and 'sync' must be given")
        _require(self.path is None or 0 < len(self.path) <= 4096, "field 'path' must be 1..4096 characters")
        _require(
            self.on_running in ON_RUNNING,
            f"field 'on_running' must be one of {', '.join(ON_RUNNING)}, got {self.on_running!r}",
        )
        _require(
            0 < self.timeout_s <= MAX_REFIT_TIMEOUT_S,
            f"field 'timeout_s' must be in (0, {MAX_REFIT_TIMEOUT_S:g}], got {self.timeout_s}",
        )
        _require(self.version is None or self.version >= 1, f"field 'version' must be >= 1, got {self.version}")


@message
class WeightsUpdated(Message, frozen=True):
    """A worker's answers in a refit's two phases, and the coordinator's to the client. To UpdateWeights:
    `prepared` (every tensor read, checked and held in memory, no request left: ready to apply `version`), or
    `error` (nothing changed). To CommitWeights: its engine serves `version` now, or `error` says why it still
    serves the old weights. To the client: the version every serving worker has."""

    TYPE: ClassVar[str] = "weights_updated"
    version: int
    error: str | None = None
    num_tensors: int = 0
    prepared: bool = False


@message
class CommitWeights(Message, frozen=True):
    """Coordinator -> worker, a refit's second phase: apply the prepared weights of `version` (`commit`), or
    drop them (another worker could not prepare its part: nothing changes anywhere)."""

    TYPE: ClassVar[str] = "commit_weights"
    version: int
    commit: bool = True

    def __post_init__(self) -> None:
        _require(self.version >= 1, f"field 'version' must be >= 1, got {self.version}")


LORA_ACTIONS = ("load", "unload")


@message
class LoraCommand(Message, frozen=True):
    """Load or unload a LoRA adapter on every worker of its base model (client -> coordinator -> workers; an
    administrator's key):
    `lora_path` a PEFT folder each worker reads (load), none for unload. Answered by LoraDone once every worker
    did (the coordinator also loads the cluster's adapters into a worker that registers later)."""

    TYPE: ClassVar[str] = "lora_command"
    action: str
    lora_name: str
    lora_path: str | None = None
    model: ModelId | None = None  # the base model whose workers load it (None: the cluster's default model)

    def __post_init__(self) -> None:
        _require(
            self.action in LORA_ACTIONS,
            f"field 'action' must be one of {', '.join(LORA_ACTIONS)}, got {self.action!r:.40}",
        )
        try:
            check_lora_name(self.lora_name)
        except ValueError as e:
            raise ProtocolError(f"field 'lora_name': {e}") from None
        _require((self.lora_path is not None) == (self.action == "load"), "field 'lora_path' goes with load only")
        _require(
            self.lora_path is None or 0 < len(self.lora_path) <= 4096, "field 'lora_path' must be 1..4096 characters"
        )


@message
class LoraDone(Message, frozen=True):
    """A worker's answer to a LoraCommand (its adapters after it, or `error`: nothing changed), and the
    coordinator's to the client (the cluster's adapters; `error` names each worker that failed)."""

    TYPE: ClassVar[str] = "lora_done"
    action: str
    lora_name: str
    error: str | None = None
    lora_adapters: Mapping[str, str] = msgspec.field(default_factory=dict)


# ---- coordinator <-> client extras ---------------------------------------------------------------


@message
class Placement(Message, frozen=True):
    """Coordinator -> client: where a direct stream runs now (docs/architecture.md, "Direct streams"): subscribe at
    `stream_address` (a worker's stream socket; with keys its public key is `worker_key`, z85) with
    `stream_token`. `stream_address` None: the request left its worker; send it again with `reattach` and what
    you hold, and it resumes from there."""

    TYPE: ClassVar[str] = "placement"
    request_id: Id
    stream_address: Address | None = None
    worker_key: Annotated[str, msgspec.Meta(min_length=40, max_length=40)] | None = None
    stream_token: Token | None = None

    def __post_init__(self) -> None:
        if (self.stream_address is None) != (self.stream_token is None):
            raise ProtocolError("'stream_address' and 'stream_token' go together")


@message
class Subscribe(Message, frozen=True):
    """Client -> worker stream socket: send me request `request_id`'s deltas past the `num_tokens` output tokens
    and `text_len` characters of text I hold (at a delta boundary of the worker's journal), then every later one."""

    TYPE: ClassVar[str] = "subscribe"
    request_id: Id
    stream_token: Token
    num_tokens: NonNegative = 0
    text_len: NonNegative = 0


@message
class StreamBatch(Message, frozen=True):
    """Worker stream socket -> client: one step's deltas of that client's direct streams; delta i continues a
    copy holding `token_starts[i]` output tokens and `text_starts[i]` characters (the client drops any other)."""

    TYPE: ClassVar[str] = "stream_batch"
    deltas: Items[Delta]
    token_starts: Items[NonNegative]
    text_starts: Items[NonNegative]

    def __post_init__(self) -> None:
        if not len(self.deltas) == len(self.token_starts) == len(self.text_starts):
            raise ProtocolError("'deltas', 'token_starts' and 'text_starts' must be of one length")


@message
class DeltaBatch(Message, frozen=True):
    """Coordinator -> client: the deltas of one client's requests gathered into one frame."""

    TYPE: ClassVar[str] = "delta_batch"
    deltas: Items[Delta]


@message
class StatsRequest(Message, frozen=True):
    """Client -> coordinator: ask for ClusterStats.

    With `min_healthy_workers` > 0 the answer waits (at most `timeout_s`) until that many workers are
    healthy, so a launcher can wait for readiness without polling; the answer comes either way.
    """

    TYPE: ClassVar[str] = "stats_request"
    min_healthy_workers: int = 0
    timeout_s: float = 0.0

    def __post_init__(self) -> None:
        _require(
            self.min_healthy_workers >= 0, f"field 'min_healthy_workers' must be >= 0, got {self.min_healthy_workers}"
        )
        _require(
            0.0 <= self.timeout_s <= MAX_STATS_WAIT_S,
            f"field 'timeout_s' must be in [0, {MAX_STATS_WAIT_S}], got {self.timeout_s}",
        )


@message
class WorkerStats(Message, frozen=True):
    """One worker (DP rank) as the coordinator sees it: identity, health, capacity, its last load report
    (None before the first) and the coordinator's own counts."""

    TYPE: ClassVar[str] = "worker_stats"
    worker_id: str
    dp_rank: int
    group_id: str
    healthy: bool
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    requests_routed: int  # dispatches sent to it (re-dispatches included)
    num_in_flight: int  # requests the coordinator has on it now
    seconds_since_heard: float
    registrations: int = 1  # 1 + how often it re-registered
    load: Load | None = None
    model_id: str | None = None  # the model it serves (its DP rank and group are that model's)


@message
class ModelStats(Message, frozen=True):
    """One model the cluster serves, as the coordinator sees it: its workers, what it runs and holds, what it was
    asked, its LoRA adapters (name -> folder). Every model some worker registered with (healthy or not) has one."""

    TYPE: ClassVar[str] = "model_stats"
    model_id: str
    num_workers: int
    num_healthy_workers: int  # routable: healthy, whole group healthy, at the cluster's weight version
    num_in_flight: int = 0
    num_held: int = 0
    requests_submitted: int = 0
    requests_completed: int = 0
    requests_failed: int = 0
    max_model_len: int | None = None  # the smallest of its workers'
    lora_adapters: Mapping[str, str] = msgspec.field(default_factory=dict)
    default: bool = False  # requests that name no model go to it
    # Where its workers read its tokenizer (their Hello.tokenizer: model directories), distinct, the lowest rank's
    # first; empty when none said (the model id is then the model's path). An HTTP front loads the first it can.
    tokenizers: Annotated[list[ModelId], msgspec.Meta(max_length=MAX_TOKENIZER_SOURCES)] = msgspec.field(
        default_factory=list
    )
    # Under --policy kv-aware (0 under the others): the (block hash, worker) pairs its index holds now, the snapshots
    # it asked workers for (KvResync: a gap in their events, a bound broken), and, over the requests it routed by
    # overlap, the prompt tokens they had and those the chosen rank held by the index (the hits it expected).
    kv_index_entries: int = 0
    kv_index_resyncs: int = 0
    kv_routed_prompt_tokens: int = 0
    kv_routed_cached_tokens: int = 0


def _counter(text: str) -> Any:
    return field(default=0, metadata={"help": text})


@dataclass
class Counters:
    """What the coordinator counted since it started, declared once: its jobs increment them (coordinator/books.py
    holds the one record), ClusterStats carries each under its name (`ClusterStats.counters`), and the HTTP front
    exports each as the Prometheus counter `infer:coordinator_<name>` with its metadata's help (client/api/
    metrics.py)."""

    requests_submitted: int = _counter("Requests the coordinator admitted (Submits it held or routed).")
    requests_completed: int = _counter("Requests that finished without an error.")
    requests_failed: int = _counter("Requests that ended with an error (shed from the full queue included).")
    requests_aborted: int = _counter("Requests aborted: by their client, a lost client, or a stop.")
    requests_redispatched: int = _counter(
        "Requests failed over: sent to another worker after theirs died, hung or gave them back."
    )
    frames_rejected: int = _counter("Frames refused: undecodable, invalid, or not allowed for their key.")
    requests_rejected: int = _counter("Submits refused at once as overloaded (admission control).")
    requests_timed_out: int = _counter("Requests ended by their own timeout.")
    requests_reattached: int = _counter(
        "Requests handed back to their clients from the workers' copies after a coordinator restart."
    )
    clients_lost: int = _counter("Clients declared lost with requests in flight (silent, or unroutable).")
    clients_too_slow: int = _counter("Clients whose send queue reached the high-water mark (they read nothing).")


@message
class ClusterStats(Message, frozen=True):
    """Coordinator -> client: the cluster's state, every known worker, and the coordinator's counters (each field
    of `Counters`, under its name)."""

    TYPE: ClassVar[str] = "cluster_stats"
    coordinator_id: str
    state: ClusterState
    policy: str
    model_id: str | None
    workers: Items[WorkerStats]
    num_clients: int
    num_in_flight: int  # dispatched to a worker, not finished
    num_held: int  # waiting in the coordinator (paused, or no healthy worker)
    requests_submitted: int
    requests_completed: int
    requests_failed: int
    requests_aborted: int
    requests_redispatched: int
    frames_rejected: int
    uptime_s: float
    requests_rejected: int = 0
    requests_timed_out: int = 0
    requests_reattached: int = 0
    clients_lost: int = 0
    clients_too_slow: int = 0
    weight_version: int = 0  # the weights the cluster serves (the last update_weights every worker applied)
    # the healthy workers' LoRA adapters: name -> folder
    lora_adapters: Mapping[str, str] = msgspec.field(default_factory=dict)
    models: Items[ModelStats] = msgspec.field(default_factory=list)  # every model some worker serves, by id

    def __post_init__(self) -> None:
        _set_members(self, state=ClusterState)

    def model(self, model_id: str) -> ModelStats | None:
        return next((m for m in self.models if m.model_id == model_id), None)

    @property
    def num_healthy_workers(self) -> int:
        return sum(w.healthy for w in self.workers)

    @property
    def counters(self) -> Counters:
        return Counters(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Counters)})


# ---- KV transfer between workers (worker/kv/transfer.py) -----------------------------------------------------


@message
class KvOffer(Message, frozen=True):
    """Producer -> consumer's KV socket: the KV of these tokens' full blocks is here (`fingerprint`: the model,
    weights, dtype and block geometry it was computed with). The consumer answers KvWant."""

    TYPE: ClassVar[str] = "kv_offer"
    transfer_id: Id
    fingerprint: bytes
    token_ids: TokenIdList
    # shared memory (worker/service/kv_links.py ShmArea): a file of the producer's in its shared-memory directory and
    # the token it holds; a consumer that reads that token there shares the directory (the same host, the same mounts)
    shm_probe: ShmPath | None = None
    shm_token: Token | None = None
    lora_name: str | None = None  # the LoRA adapter the KV was computed with (None: the base model)

    def __post_init__(self) -> None:
        _require((self.shm_probe is None) == (self.shm_token is None), "'shm_probe' and 'shm_token' go together")
        _check_optional_lora_name(self.lora_name)


@message
class KvWant(Message, frozen=True):
    """Consumer -> producer: send the blocks from `first_block` on (those before it are in its prefix cache);
    `refusal` set: send nothing (another model or geometry, no prefix caching), why in words."""

    TYPE: ClassVar[str] = "kv_want"
    transfer_id: Id
    first_block: NonNegative = 0
    refusal: str | None = None
    shm: bool = False  # it read the offer's probe: send the blocks through shared memory


@message
class KvBlocks(Message, frozen=True):
    """Producer -> consumer: the KV of blocks `first_block ..` of `token_ids` (each payload: every layer's K and V
    of one block, in the pool's dtype and layout), `checksums[i]` the xxh3-64 of `blocks[i]`; `last`: the
    transfer's final frame. The consumer answers each with KvStored."""

    TYPE: ClassVar[str] = "kv_blocks"
    transfer_id: Id
    fingerprint: bytes
    token_ids: TokenIdList
    first_block: NonNegative
    blocks: Annotated[list[bytes], msgspec.Meta(max_length=MAX_KV_BLOCKS_PER_FRAME)]
    checksums: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_KV_BLOCKS_PER_FRAME)]
    last: bool = True
    shm_path: ShmPath | None = None  # the payloads, back to back, in this shared-memory file instead of `blocks`
    lora_name: str | None = None  # as KvOffer's

    def __post_init__(self) -> None:
        _check_optional_lora_name(self.lora_name)
        if self.shm_path is None:
            _require(len(self.blocks) == len(self.checksums), "fields 'blocks' and 'checksums' must have one item each")
        else:
            _require(not self.blocks and bool(self.checksums), "with 'shm_path': no 'blocks', a checksum per block")


@message
class KvStored(Message, frozen=True):
    """Consumer -> producer: of a KvBlocks frame, `stored` blocks are now cached there (the rest dropped:
    `refusal` says why: no free blocks, a bad checksum, a prefix it no longer holds)."""

    TYPE: ClassVar[str] = "kv_stored"
    transfer_id: Id
    stored: NonNegative = 0
    last: bool = True
    refusal: str | None = None


# ---- a drain that moves requests with their KV (worker/service/core.py `_start_moves`) ---------------------------


@message
class DrainMoves(Message, frozen=True):
    """Worker -> coordinator: it drains (SIGTERM, DrainWorker, its EP group draining) and would move these running
    requests, with their KV blocks, to the workers that continue them (none, as from a worker without a KV port: it
    only says it drains).
    The coordinator routes nothing new to it, nor to its EP group, from now on and answers MoveTargets; requests it
    names no target for stay and finish here within the drain timeout."""

    TYPE: ClassVar[str] = "drain_moves"
    request_ids: Items[Id]


class KvMove(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request's new worker: its KV socket and its public key (z85, "" without keys)."""

    request_id: Id
    kv_address: Address
    kv_key: Owner


@message
class MoveTargets(Message, frozen=True):
    """Coordinator -> draining worker: for each request, the worker that continues it (chosen by the model's
    routing policy among the workers with a KV port, draining ones left out). The worker ships the request's KV
    blocks the target lacks there, then gives the request back (ErrorCode.KV_HANDOFF), as a kv_producer does."""

    TYPE: ClassVar[str] = "move_targets"
    moves: Items[KvMove]


@message
class DrainWorker(Message, frozen=True):
    """Scale-down, one worker at a time. Administrator -> coordinator: drain worker `worker_id` (as ClusterStats
    names it); the coordinator routes nothing new to it, forwards this frame to it and answers DrainStarted (or an
    Error naming why not). Coordinator -> that worker: drain as on SIGTERM (with --kv-transfer-config its running
    requests move to other workers with their KV; the rest finish there within --drain-timeout), then exit 0."""

    TYPE: ClassVar[str] = "drain_worker"
    worker_id: Id


@message
class DrainStarted(Message, frozen=True):
    """Coordinator -> administrator: worker `worker_id` drains; it held `num_requests` requests then. It leaves the
    cluster's stats once it has exited."""

    TYPE: ClassVar[str] = "drain_started"
    worker_id: Id
    num_requests: Annotated[int, msgspec.Meta(ge=0)] = 0


# ---- codec ---------------------------------------------------------------------------------------


class _Frame(msgspec.Struct, forbid_unknown_fields=True):
    """A frame as read: the header and version, the body left undecoded until the header chose its Struct."""

    type: str
    v: Any  # any value, so that a peer with another version is told so whatever it wrote
    body: msgspec.Raw


class _OutFrame(msgspec.Struct):
    type: str
    v: int
    body: Message


class _PeekBody(msgspec.Struct):
    request_id: Any = None


class _PeekFrame(msgspec.Struct):
    body: _PeekBody


_ENCODER = msgspec.msgpack.Encoder()
_FRAME_DECODER = msgspec.msgpack.Decoder(_Frame)
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in REGISTRY.items()}
_PATH = re.compile(r"(?s)(.*) - at `\$\.?(.*)`")
_TYPE_KEY = b"\x83\xa4type"  # how `encode` begins a frame: a map of 3, its first key "type" ...
_VERSION_BODY = b"\xa1v" + _ENCODER.encode(PROTOCOL_VERSION) + b"\xa4body"  # ... then the type's name, "v", "body"
_FAST_DECODERS = {_ENCODER.encode(kind): decoder for kind, decoder in _DECODERS.items()}
_FAST_HEAD_BYTES = len(_TYPE_KEY) + 1 + max(map(len, REGISTRY)) + len(_VERSION_BODY)


def encode(msg: Message) -> bytes:
    """One frame for `msg`."""
    return _ENCODER.encode(_OutFrame(msg.TYPE, PROTOCOL_VERSION, msg))


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """The message in `frame`, fully validated; ProtocolError (naming the problem) otherwise.

    Bounded before anything is built (protocol/bounds.py): a frame of at most `max_bytes`, nested at most
    MAX_DEPTH deep, no array or map longer than MAX_ITEMS. A frame as `encode` writes it ({"type", "v": this
    version, "body"} in that order) has its body decoded at once by its message's decoder, whose schema bounds
    every container at its header and goes only as deep as the schema does; any other frame, and any frame
    that fails there, has its shape checked first and is decoded the general way (so a bad frame's error is
    the same whichever way it came)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    fast = _fast_body(frame)
    if fast is not None:
        try:
            return fast[0].decode(memoryview(frame)[fast[1] :])
        except (msgspec.MsgspecError, ValueError):
            pass  # the general way names the problem
    try:
        check_shape(frame)
    except ShapeError as e:
        raise ProtocolError(f"frame refused: {e}") from None
    return _decode_checked(frame)


def _fast_body(frame: bytes | bytearray | memoryview) -> tuple[msgspec.msgpack.Decoder, int] | None:
    """(the body's decoder, the body's offset) when `frame` begins as `encode` writes one: a map of 3 whose
    keys are "type" (a known type), "v" (PROTOCOL_VERSION) and "body", in that order; else None."""
    head = bytes(frame[:_FAST_HEAD_BYTES])
    start = len(_TYPE_KEY)
    if len(head) <= start or not head.startswith(_TYPE_KEY):
        return None
    name_end = start + 1 + (head[start] & 0x1F) if 0xA0 <= head[start] <= 0xBF else 0
    decoder = _FAST_DECODERS.get(head[start:name_end])
    if decoder is None or head[name_end : name_end + len(_VERSION_BODY)] != _VERSION_BODY:
        return None
    return decoder, name_end + len(_VERSION_BODY)


def _decode_checked(frame: bytes | bytearray | memoryview) -> Message:
    """`decode` of a frame whose shape is within the bounds."""
    try:
        outer = _FRAME_DECODER.decode(frame)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"a frame must be a map with exactly 'type', 'v' and 'body': {e}") from None
    except (msgspec.DecodeError, ValueError) as e:  # ValueError: a string that is not UTF-8
        raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}: {e}") from None
    kind = outer.type
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ProtocolError(f"unknown message type {kind!r:.80}; known: {', '.join(sorted(REGISTRY))}")
    if outer.v != PROTOCOL_VERSION:
        raise _named(
            ProtocolError(
                f"schema version {outer.v!r:.80} of {kind!r} is not supported (this side speaks {PROTOCOL_VERSION})"
            ),
            kind,
        )
    try:
        return decoder.decode(outer.body)
    except ProtocolError as e:  # (msgspec wraps those raised by __post_init__: not expected)
        raise _named(e, kind) from None
    except (msgspec.MsgspecError, ValueError) as e:  # ValueError: a string that is not UTF-8
        text = _with_path(e)
        raise _named(ProtocolError(text if text.startswith("field ") else f"{kind!r}: {text}"), kind) from None


def _with_path(error: Exception) -> str:
    """msgspec's "text - at `$.a.b`" as "field 'a.b': text"; a check's own error (cause) speaks for itself, and a
    SamplingParams FieldError names its field inside the path ("field 'sampling.top_p': ...")."""
    text = str(error)
    match = _PATH.fullmatch(text)
    if match is None:
        return text
    problem, path = match.groups()
    inner = getattr(error.__cause__ or error.__context__, "field", None)
    if isinstance(inner, str) and path.rsplit(".", 1)[-1] != inner:
        path = f"{path}.{inner}"
    return f"field {path!r}: {problem}"


def _named(error: ProtocolError, kind: str) -> ProtocolError:
    error.message_type = kind
    return error


def peek_request_id(frame: bytes) -> str | None:
    """The request id of a frame that failed to decode, when it can be read (so that request alone fails);
    never raises."""
    try:
        check_shape(frame)  # (the peek skips values it does not want: recursively)
        request_id = msgspec.msgpack.decode(frame, type=_PeekFrame).body.request_id
    except Exception:  # noqa: BLE001 - a frame we cannot read
        return None
    return request_id if isinstance(request_id, str) and 0 < len(request_id) <= MAX_ID_LEN else None
