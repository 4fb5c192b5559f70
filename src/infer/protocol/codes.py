"""The closed sets of words the wire carries: why a request ended, why it failed, lifecycle commands and states.

Each is a `StrEnum`: a member is its string (it compares, hashes, formats, JSON-encodes and even reprs as the
string, and msgpack packs it as one), so frames are byte for byte what plain strings made, old and new peers
interoperate, and user code comparing `finish_reason == "stop"` (or messages quoting `{reason!r}`) keeps working.
Messages turn the strings they are built or decoded with into members, and refuse any other string with a
ProtocolError naming the field and the choices (protocol/messages.py).
"""

from __future__ import annotations

import enum


class Word(enum.StrEnum):
    """A str enum whose repr is its string's, as a plain str's would be ('stop', not <FinishReason.STOP: 'stop'>):
    error and log messages that quote a value read the same whether it came as a member or a plain string."""

    def __repr__(self) -> str:
        return repr(self.value)


class FinishReason(Word):
    """Why a request's stream ended (its last delta's `finish_reason`)."""

    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the context length
    ABORT = "abort"  # aborted (by its client, or by a worker giving it back)
    ERROR = "error"  # failed: `error` says why and `error_code` what kind


class ErrorCode(Word):
    """Why a request failed (with finish_reason "error"), for callers that must tell bad input from a busy cluster."""

    INVALID_REQUEST = "invalid_request"  # the request can never be served (prompt too long, bad token ids, options)
    MODEL_NOT_FOUND = "model_not_found"  # it names a model (or LoRA adapter) no worker serves; the text names those
    # that are served (HTTP 404)
    UNAVAILABLE = "unavailable"  # the cluster cannot serve it now (no healthy worker in time, draining,
    # stopping, retries spent)
    INTERNAL = "internal"  # a component failed while serving it
    OVERLOADED = "overloaded"  # a queue on its way was full (coordinator, worker or HTTP front): retry
    # later, it was not run
    TIMEOUT = "timeout"  # it did not finish within its own `timeout`; aborted, KV blocks freed
    CLIENT_TOO_SLOW = "client_too_slow"  # its client did not read what the coordinator sent it (its queue reached
    # the high-water mark), so the coordinator aborted its requests; the
    # client hears it when it reads again
    CLIENT_LOST = "client_lost"  # (an Error, no request id) the coordinator declared this client lost
    # (silent past --client-timeout, or unroutable) and aborted its requests
    # on the workers; the client re-attaches them (they resume from the
    # tokens it holds) or fails them
    DRAINING = "draining"  # (worker -> coordinator only) a draining worker refused a dispatch; the
    # coordinator moves the request to another worker and routes nothing more
    # to this one
    KV_HANDOFF = "kv_handoff"  # (worker -> coordinator only, finish_reason "abort") a kv_producer prefilled it and
    # sent its KV blocks to the consumer the Dispatch named, or a draining worker sent them to the target MoveTargets
    # named: the coordinator continues it there


class Command(Word):
    """A lifecycle command (`Control`): coordinator/lifecycle.py and worker/service/lifecycle.py say what each does."""

    PAUSE = "pause"
    UNPAUSE = "unpause"
    SUSPEND = "suspend"
    RESUME = "resume"
    STOP = "stop"


class ClusterState(Word):
    """The cluster's lifecycle state (coordinator/lifecycle.py): in Welcome, ClusterStats and the coordinator's
    ControlAck."""

    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    STOPPED = "stopped"


class WorkerState(Word):
    """A worker's lifecycle state (worker/service/lifecycle.py), in its ControlAck."""

    RUNNING = "running"  # steps the engine
    PAUSED = "paused"  # keeps its requests and memory, does not step
    SUSPENDED = "suspended"  # paused, with the KV pool and the weights released
    STOPPED = "stopped"  # every request given back; the process exits
    DRAINING = "draining"  # reported only: a RUNNING worker after SIGTERM (a deadline, not a state of the table)
