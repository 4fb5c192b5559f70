"""The worker's logic driven by hand (the twin of tests/core_harness.py): frames in, decoded messages out, a
clock the test moves, and BenchmarkEngine as the engine (no model, no torch: token i of a P-token prompt is
(P + i) % 1000, one per step)."""

from __future__ import annotations

from infer.protocol.messages import (
    Delta,
    Dispatch,
    Heartbeat,
    Message,
    RequestSpec,
    StepBatch,
    TokenIds,
    Welcome,
    decode,
    encode,
)
from infer.protocol.sampling import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.service.benchmark_engine import BenchmarkEngine
from infer.worker.service.core import WorkerCore
from infer.worker.service.options import WorkerOptions


class WorkerHarness:
    def __init__(self, max_num_seqs: int = 4, max_model_len: int = 64, **options) -> None:
        defaults = {
            "coordinator": "tcp://127.0.0.1:5555",
            "worker_id": "w-test",
            "heartbeat_interval": 1.0,
            "coordinator_timeout": 10.0,
            "drain_timeout": 30.0,
            "connect_timeout": 60.0,
        }
        self.now = 0.0
        self.engine = BenchmarkEngine(EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len))
        self.core = WorkerCore(self.engine, WorkerOptions(**{**defaults, **options}), self.now, wall_offset=1e9)
        self.core.start(self.now)

    def send(self, msg: Message) -> list[Message]:
        self.core.on_frame([encode(msg)], self.now)
        return self.out()

    def raw(self, frames: list[bytes]) -> list[Message]:
        self.core.on_frame(frames, self.now)
        return self.out()

    def out(self) -> list[Message]:
        """What the core queued, each message through the codec (proves it encodes)."""
        return [decode(encode(msg)) for msg in self.core.take_outgoing()]

    def step(self) -> list[Message]:
        """One turn of the daemon's loop after its frames: the signals, the queue-time bound, a step if the core
        wants one (else what the engine has pending), then the liveness timers."""
        self.core.check_signals(self.now)
        self.core.shed_overdue(self.now)
        outputs = self.engine.step() if self.core.wants_step() else self.engine.take_pending()
        self.core.after_step(outputs, self.now)
        self.core.tick(self.now)
        return self.out()

    def advance(self, seconds: float) -> list[Message]:
        self.now += seconds
        self.core.check_signals(self.now)
        self.core.tick(self.now)
        return self.out()

    def welcome(self, instance: str = "coord-1", dp_rank: int | None = 0) -> list[Message]:
        return self.send(
            Welcome(
                coordinator_id="c",
                state="running",
                instance=instance,
                dp_rank=dp_rank,
                group_id=None if dp_rank is None else f"dp{dp_rank}",
            )
        )

    def run_until_finished(self, max_steps: int = 100) -> list[Delta]:
        """Steps until the engine is idle; every delta sent meanwhile, in order."""
        out: list[Delta] = []
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                return out
            out += deltas(self.step())
        raise AssertionError("the engine did not finish")


def dispatch(
    rid: str, prompt: list[int] | str = (1, 2, 3), max_tokens: int = 4, resumed: list[int] = (), **fields
) -> Dispatch:
    text = prompt if isinstance(prompt, str) else None
    ids = None if isinstance(prompt, str) else TokenIds(list(prompt))
    return Dispatch(
        request_id=rid,
        spec=RequestSpec(
            sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens), prompt=text, prompt_token_ids=ids
        ),
        resumed_token_ids=TokenIds(list(resumed)),
        **fields,
    )


def deltas(out: list[Message]) -> list[Delta]:
    return [d for m in out if isinstance(m, StepBatch) for d in m.deltas]


def of_type(out: list[Message], kind: type[Message]) -> list[Message]:
    return [m for m in out if isinstance(m, kind)]


def heartbeats(out: list[Message]) -> list[Heartbeat]:
    return [m for m in out if isinstance(m, Heartbeat)]
