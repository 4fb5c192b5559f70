"""The coordinator's logic driven by hand: frames in, decoded messages out, a clock the test moves."""

from __future__ import annotations

from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.core import Coordinator
from infer.protocol.messages import (
    Delta,
    DeltaBatch,
    Dispatch,
    Hello,
    Load,
    Message,
    RequestSpec,
    StepBatch,
    Submit,
    TokenIds,
    decode,
    encode,
)
from infer.protocol.sampling import SamplingParams

MODEL = "tiny-model"


class Harness:
    def __init__(self, keys=None, **options) -> None:
        """`keys`: a KeyRoles (CurveZMQ roles; frames then go in with the key `send` is given)."""
        defaults = {
            "heartbeat_interval": 0.1,
            "worker_timeout": 1.0,
            "client_timeout": 1.0,
            "max_retries": 2,
            "queue_timeout": 5.0,
            "stop_timeout": 1.0,
        }
        self.now = 0.0
        self.core = Coordinator(CoordinatorConfig(**{**defaults, **options}), self.now, keys=keys)

    def send(self, identity: bytes, msg: Message, key: bytes | None = None) -> list[tuple[bytes, Message]]:
        self.core.handle(identity, [encode(msg)], self.now, key=key)
        return self.out()

    def raw(self, identity: bytes, frames: list[bytes]) -> list[tuple[bytes, Message]]:
        self.core.handle(identity, frames, self.now)
        return self.out()

    def out(self) -> list[tuple[bytes, Message]]:
        """What the core queued, each message through the codec (proves it encodes)."""
        return [(identity, decode(encode(msg))) for identity, msg in self.core.take_outgoing()]

    def advance(self, seconds: float) -> list[tuple[bytes, Message]]:
        self.now += seconds
        self.core.tick(self.now)
        return self.out()

    def worker(
        self,
        wid: str,
        rank: int | None,
        *,
        group: str | None = None,
        model: str = MODEL,
        blocks: int = 100,
        running: list[str] | None = None,
    ) -> list[tuple[bytes, Message]]:
        return self.send(
            wid.encode(), worker_hello(wid, rank, group=group, model=model, blocks=blocks, running=running)
        )

    def submit(
        self, client: bytes, rid: str, prompt_ids: list[int] | None = None, prompt: str | None = None, **sampling
    ) -> list[tuple[bytes, Message]]:
        pin = sampling.pop("pin_rank", None)
        model = sampling.pop("model", None)
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": 10, **sampling})
        if prompt is None:
            ids = TokenIds(prompt_ids or [1, 2, 3])
            submit = Submit(
                request_id=rid, spec=RequestSpec(prompt_token_ids=ids, sampling=params), pin_rank=pin, model=model
            )
        else:
            submit = Submit(request_id=rid, spec=RequestSpec(prompt=prompt, sampling=params), pin_rank=pin, model=model)
        return self.send(client, submit)

    def step(self, wid: str, *deltas: Delta, free: int = 90) -> list[tuple[bytes, Message]]:
        load = Load(
            num_waiting=0, num_running=len(deltas), num_free_blocks=free, num_total_blocks=100, num_queued_tokens=0
        )
        return self.send(wid.encode(), StepBatch(deltas=list(deltas), load=load))


def worker_hello(
    wid: str,
    rank: int | None,
    *,
    group: str | None = None,
    model: str = MODEL,
    blocks: int = 100,
    running: list[str] | None = None,
    **extra,
) -> Hello:
    """A worker's Hello; rank None: no --dp-rank (the coordinator assigns one; the group follows it)."""
    if group is None and rank is not None:
        group = f"dp{rank}"
    return Hello(
        role="worker",
        peer_id=wid,
        model_id=model,
        dp_rank=rank,
        group_id=group,
        num_kv_blocks=blocks,
        block_size=16,
        max_num_seqs=64,
        max_model_len=256,
        running=running or [],
        **extra,
    )


def delta(
    rid: str,
    *tokens: int,
    prompt: list[int] | None = None,
    finish: str | None = None,
    error: str | None = None,
    code: str | None = None,
) -> Delta:
    return Delta(
        request_id=rid,
        token_ids=TokenIds(tokens),
        text="".join(f"<{t}>" for t in tokens),
        finished=finish is not None,
        finish_reason=finish,
        error=error,
        error_code=code,
        prompt_token_ids=None if prompt is None else TokenIds(prompt),
    )


def client_deltas(out: list[tuple[bytes, Message]], client: bytes) -> list[Delta]:
    """Every delta the core queued for `client`, in order (its DeltaBatches unpacked)."""
    return [d for identity, m in out if identity == client and isinstance(m, DeltaBatch) for d in m.deltas]


def dispatches(out: list[tuple[bytes, Message]]) -> dict[bytes, list[Dispatch]]:
    """The Dispatches the core queued, by worker identity."""
    by_worker: dict[bytes, list[Dispatch]] = {}
    for identity, m in out:
        if isinstance(m, Dispatch):
            by_worker.setdefault(identity, []).append(m)
    return by_worker
