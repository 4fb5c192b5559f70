"""Wire messages: small typed classes with named fields, one registry, explicit msgpack encode/decode.

A frame is one msgpack map: {"type": <header>, "v": <schema version>, "body": {<field>: <value>, ...}}.
Decoding validates everything (frame size, msgpack, header, version, missing / extra fields, field
types, value ranges) and raises ProtocolError whose text names the problem; nothing from the wire is
ever pickled or evaluated. Token ids travel as packed little-endian int32 bytes (`TokenIds`).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from array import array
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack

from infer.protocol.sampling import SamplingParams

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 << 20          # also set as the sockets' ZMQ_MAXMSGSIZE
MAX_ID_LEN = 256
LIFECYCLE_COMMANDS = ("pause", "unpause", "suspend", "resume", "stop")
ROLES = ("client", "worker")
MAX_STATS_WAIT_S = 3600.0


class ProtocolError(ValueError):
    """A frame or message that is not valid; the text says what is wrong (and is sent back as is).

    `message_type` is the frame's header when it could be read (so a receiver can, say, answer a bad
    "hello" with Refused rather than Error), else None.
    """

    message_type: str | None = None


class TokenIds(list):
    """A list of token ids that travels as packed little-endian int32 bytes."""

    def pack(self) -> bytes:
        packed = array("i", self)
        if sys.byteorder != "little":
            packed.byteswap()
        return packed.tobytes()

    @classmethod
    def unpack(cls, data: bytes, name: str) -> "TokenIds":
        if len(data) % 4:
            raise ProtocolError(f"field {name!r}: packed int32 token ids need a multiple of 4 bytes, got {len(data)}")
        values = array("i")
        values.frombytes(data)
        if sys.byteorder != "little":
            values.byteswap()
        if values and min(values) < 0:
            raise ProtocolError(f"field {name!r}: token ids must be >= 0, got {min(values)}")
        return cls(values)


@dataclass(frozen=True)
class Message:
    """Base of every message. Subclasses set TYPE (the header) and declare named, typed fields."""

    TYPE: ClassVar[str] = ""

    def validate(self) -> None:
        """Range checks beyond types; raise ProtocolError. Called on construction and after decode."""

    def __post_init__(self) -> None:
        self.validate()


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


def _check_id(name: str, value: str) -> None:
    _require(0 < len(value) <= MAX_ID_LEN, f"field {name!r} must be 1..{MAX_ID_LEN} characters, got {len(value)}")


# ---- handshake -----------------------------------------------------------------------------------

@message
@dataclass(frozen=True)
class Hello(Message):
    """First frame of every peer. Workers also state what they serve and what they can hold."""

    TYPE: ClassVar[str] = "hello"
    role: str
    peer_id: str
    protocol_version: int = PROTOCOL_VERSION
    model_id: str | None = None
    dp_rank: int | None = None
    group_id: str | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    running: list[str] = field(default_factory=list)   # request ids a worker still runs (re-registration)

    def validate(self) -> None:
        _require(self.role in ROLES, f"field 'role' must be one of {', '.join(ROLES)}, got {self.role!r}")
        _check_id("peer_id", self.peer_id)
        if self.role == "worker":
            for name in ("model_id", "dp_rank", "group_id", "num_kv_blocks", "block_size", "max_num_seqs",
                         "max_model_len"):
                _require(getattr(self, name) is not None, f"a worker hello needs field {name!r}")
            _require(self.dp_rank >= 0, f"field 'dp_rank' must be >= 0, got {self.dp_rank}")
            for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_model_len"):
                _require(getattr(self, name) >= 1, f"field {name!r} must be >= 1, got {getattr(self, name)}")


@message
@dataclass(frozen=True)
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"
    coordinator_id: str
    state: str
    model_id: str | None = None


@message
@dataclass(frozen=True)
class Refused(Message):
    """The peer is not accepted; `reason` says exactly what differs or is wrong."""

    TYPE: ClassVar[str] = "refused"
    reason: str


# ---- requests and their streams ------------------------------------------------------------------

@message
@dataclass(frozen=True)
class Submit(Message):
    """A generation request: a prompt string or token ids, and SamplingParams as named fields."""

    TYPE: ClassVar[str] = "submit"
    request_id: str
    prompt: str | None = None
    prompt_token_ids: TokenIds | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    pin_rank: int | None = None

    def validate(self) -> None:
        _check_id("request_id", self.request_id)
        _require((self.prompt is None) != (self.prompt_token_ids is None),
                 "exactly one of 'prompt' and 'prompt_token_ids' must be given")
        _require(self.pin_rank is None or self.pin_rank >= 0, f"field 'pin_rank' must be >= 0, got {self.pin_rank}")
        self.sampling_params()

    def sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams.from_dict(self.sampling)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"field 'sampling': {e}") from None


@message
@dataclass(frozen=True)
class Dispatch(Message):
    """Coordinator -> worker: run this request.

    After a failover, `resumed_token_ids` holds the tokens already delivered to the client: the worker
    appends them to the prompt, and `sampling["max_tokens"]` is the remaining budget, so the stream goes
    on with no token lost or repeated.
    """

    TYPE: ClassVar[str] = "dispatch"
    request_id: str
    sampling: dict[str, Any]
    prompt: str | None = None
    prompt_token_ids: TokenIds | None = None
    resumed_token_ids: TokenIds = field(default_factory=TokenIds)

    def validate(self) -> None:
        _check_id("request_id", self.request_id)
        _require((self.prompt is None) != (self.prompt_token_ids is None),
                 "exactly one of 'prompt' and 'prompt_token_ids' must be given")
        _require(not self.resumed_token_ids or self.prompt_token_ids is not None,
                 "'resumed_token_ids' needs 'prompt_token_ids'")
        try:
            SamplingParams.from_dict(self.sampling)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"field 'sampling': {e}") from None


@message
@dataclass(frozen=True)
class Accepted(Message):
    TYPE: ClassVar[str] = "accepted"
    request_id: str


@message
@dataclass(frozen=True)
class Delta(Message):
    """New tokens of one request (a stream delta); the last one has `finished` and `finish_reason`."""

    TYPE: ClassVar[str] = "delta"
    request_id: str
    token_ids: TokenIds
    text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: TokenIds | None = None   # a worker's first delta of a request: what it tokenized

    def validate(self) -> None:
        _check_id("request_id", self.request_id)
        _require(self.finish_reason in (None, "stop", "length", "abort", "error"),
                 f"field 'finish_reason' must be stop, length, abort, error or null, got {self.finish_reason!r}")
        _require(self.finished == (self.finish_reason is not None),
                 "a finished delta needs a finish_reason, and only a finished one")


@message
@dataclass(frozen=True)
class Abort(Message):
    TYPE: ClassVar[str] = "abort"
    request_ids: list[str]

    def validate(self) -> None:
        for rid in self.request_ids:
            _check_id("request_ids", rid)


@message
@dataclass(frozen=True)
class Error(Message):
    """A failure sent back to the peer: for a request (request_id set) or for a frame/command."""

    TYPE: ClassVar[str] = "error"
    message: str
    request_id: str | None = None


# ---- load, liveness, lifecycle -------------------------------------------------------------------

@message
@dataclass(frozen=True)
class Load(Message):
    """A worker's load, sent with every batch of deltas and on each heartbeat."""

    TYPE: ClassVar[str] = "load"
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_queued_tokens: int

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _require(value >= 0, f"field {f.name!r} must be >= 0, got {value}")


@message
@dataclass(frozen=True)
class StepBatch(Message):
    """Worker -> coordinator, once per engine step: every request's delta of that step and the load after it."""

    TYPE: ClassVar[str] = "step_batch"
    deltas: list[Delta]
    load: Load


@message
@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness, both ways. A worker may attach its load (an idle worker sends no StepBatch)."""

    TYPE: ClassVar[str] = "heartbeat"
    sent_at: float
    load: Load | None = None


@message
@dataclass(frozen=True)
class Control(Message):
    """A lifecycle command: pause / unpause / suspend / resume / stop."""

    TYPE: ClassVar[str] = "control"
    command: str

    def validate(self) -> None:
        _require(self.command in LIFECYCLE_COMMANDS,
                 f"field 'command' must be one of {', '.join(LIFECYCLE_COMMANDS)}, got {self.command!r}")


@message
@dataclass(frozen=True)
class ControlAck(Message):
    TYPE: ClassVar[str] = "control_ack"
    command: str
    state: str


# ---- coordinator <-> client extras ---------------------------------------------------------------

@message
@dataclass(frozen=True)
class DeltaBatch(Message):
    """Coordinator -> client: the deltas of one client's requests gathered into one frame."""

    TYPE: ClassVar[str] = "delta_batch"
    deltas: list[Delta]


@message
@dataclass(frozen=True)
class StatsRequest(Message):
    """Client -> coordinator: ask for ClusterStats.

    With `min_healthy_workers` > 0 the answer waits (at most `timeout_s`) until that many workers are
    healthy, so a launcher can wait for readiness without polling; the answer comes either way.
    """

    TYPE: ClassVar[str] = "stats_request"
    min_healthy_workers: int = 0
    timeout_s: float = 0.0

    def validate(self) -> None:
        _require(self.min_healthy_workers >= 0,
                 f"field 'min_healthy_workers' must be >= 0, got {self.min_healthy_workers}")
        _require(0.0 <= self.timeout_s <= MAX_STATS_WAIT_S,
                 f"field 'timeout_s' must be in [0, {MAX_STATS_WAIT_S}], got {self.timeout_s}")


@message
@dataclass(frozen=True)
class WorkerStats(Message):
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
    requests_routed: int          # dispatches sent to it (re-dispatches included)
    num_in_flight: int            # requests the coordinator has on it now
    seconds_since_heard: float
    registrations: int = 1        # 1 + how often it re-registered
    load: Load | None = None


@message
@dataclass(frozen=True)
class ClusterStats(Message):
    """Coordinator -> client: the cluster's state, every known worker, and the coordinator's counters."""

    TYPE: ClassVar[str] = "cluster_stats"
    coordinator_id: str
    state: str
    policy: str
    model_id: str | None
    workers: list[WorkerStats]
    num_clients: int
    num_in_flight: int            # dispatched to a worker, not finished
    num_held: int                 # waiting in the coordinator (paused, or no healthy worker)
    requests_submitted: int
    requests_completed: int
    requests_failed: int
    requests_aborted: int
    requests_redispatched: int
    frames_rejected: int
    uptime_s: float

    @property
    def num_healthy_workers(self) -> int:
        return sum(w.healthy for w in self.workers)


# ---- codec ---------------------------------------------------------------------------------------

def encode(msg: Message) -> bytes:
    """One frame for `msg`."""
    return msgpack.packb({"type": msg.TYPE, "v": PROTOCOL_VERSION, "body": _body(msg)}, use_bin_type=True)


def _body(msg: Message) -> dict[str, Any]:
    return {name: _wire(getattr(msg, name)) for name in _schema(type(msg)).names}


def _wire(value: Any) -> Any:
    if isinstance(value, TokenIds):
        return value.pack()
    if isinstance(value, Message):
        return _body(value)
    if isinstance(value, list) and value and isinstance(value[0], Message):
        return [_body(v) for v in value]
    return value


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """The message in `frame`, fully validated; ProtocolError (naming the problem) otherwise."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        outer = msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated exception types on bad input
        raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(outer, dict) or set(outer) != {"type", "v", "body"}:
        keys = sorted(map(str, outer)) if isinstance(outer, dict) else type(outer).__name__
        raise ProtocolError(f"a frame must be a map with exactly 'type', 'v' and 'body', got {keys}")
    kind, version, body = outer["type"], outer["v"], outer["body"]
    cls = REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}; known: {', '.join(sorted(REGISTRY))}")
    if version != PROTOCOL_VERSION:
        error = ProtocolError(f"schema version {version!r} of {kind!r} is not supported (this side speaks "
                              f"{PROTOCOL_VERSION})")
        error.message_type = kind
        raise error
    try:
        if not isinstance(body, dict):
            raise ProtocolError(f"the body of {kind!r} must be a map, got {type(body).__name__}")
        return _build(cls, body)
    except ProtocolError as e:
        e.message_type = kind
        raise


@dataclass(frozen=True)
class _Schema:
    """A message class's fields, resolved once: names in order, type hints, which ones are required."""

    names: tuple[str, ...]
    hints: dict[str, Any]
    required: tuple[str, ...]      # in declaration order
    labels: dict[str, str]          # field name -> "type.field", for error texts


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type[Message]) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        fields = dataclasses.fields(cls)
        hints = typing.get_type_hints(cls)
        schema = _Schema(
            names=tuple(f.name for f in fields),
            hints={f.name: hints[f.name] for f in fields},
            required=tuple(f.name for f in fields if f.default is dataclasses.MISSING
                           and f.default_factory is dataclasses.MISSING),
            labels={f.name: f"{cls.TYPE}.{f.name}" for f in fields})
        _SCHEMAS[cls] = schema
    return schema


def _build(cls: type[Message], body: dict) -> Message:
    schema = _schema(cls)
    hints = schema.hints
    if len(body) > len(hints) or any(k not in hints for k in body):
        unknown = sorted(str(k) for k in body if k not in hints)
        raise ProtocolError(f"{cls.TYPE!r} has no field(s) {', '.join(unknown)}")
    for name in schema.required:
        if name not in body:
            raise ProtocolError(f"{cls.TYPE!r} is missing field {name!r}")
    labels = schema.labels
    values = {name: _coerce(value, hints[name], labels[name]) for name, value in body.items()}
    try:
        return cls(**values)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{cls.TYPE!r}: {e}") from None


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """`value` checked against the annotation `hint` (and TokenIds unpacked); ProtocolError if it does not fit."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, name)
            except ProtocolError as e:
                errors.append(str(e))
        raise ProtocolError(errors[0] if len(errors) == 1 else f"field {name!r}: {value!r:.80} fits none of its types")
    if isinstance(hint, type) and issubclass(hint, Message):
        if not isinstance(value, dict):
            raise ProtocolError(f"field {name!r} must be a {hint.TYPE!r} map, got {type(value).__name__}")
        return _build(hint, value)
    if hint is TokenIds:
        if not isinstance(value, (bytes, bytearray)):
            raise ProtocolError(f"field {name!r} must be packed int32 bytes, got {type(value).__name__}")
        return TokenIds.unpack(bytes(value), name)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"field {name!r} must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, name) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"field {name!r} must be a map, got {type(value).__name__}")
        key_t, val_t = typing.get_args(hint)
        return {_coerce(k, key_t, name): _coerce(v, val_t, name) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"field {name!r} must be a number, got {type(value).__name__}")
        return float(value)
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ProtocolError(f"field {name!r} must be an integer, got {type(value).__name__}")
    if hint in (str, bool) and not isinstance(value, hint):
        raise ProtocolError(f"field {name!r} must be a {hint.__name__}, got {type(value).__name__}")
    return value
