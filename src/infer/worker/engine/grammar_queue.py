"""The grammar queue: structured-output requests between add_request and the scheduler.

Owns the engine's grammar compiler (worker/engine/structured.py's GrammarCompilerPool, made at the first
structured-output request) and the requests whose grammar is compiling. A request enters with `compile` (past the
compile bounds it is refused at once as "overloaded"); `admit_ready`, at the start of each step, gives each request
whose compile is done its matcher (advanced over its resumed tokens) and adds it to the scheduler, or fails it (a spec
that did not compile, not in time, or too costly to start). `fail_costly` fails, after a step, each request whose
grammar took more CPU in it than its budget. Every failure is a final Delta made by the OutputProcessor.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any, Collection, Sequence, cast

from infer.protocol.messages import Delta
from infer.protocol.structured import NO_FIRST_TOKEN, StructuredOutputsParams, grammar_reason
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.output_processor import OutputProcessor
from infer.worker.engine.request import Request, RequestStatus
from infer.worker.engine.scheduler import ScheduledChunk, Scheduler
from infer.worker.engine.structured import (
    COMPILE_TIMEOUT_S,
    COMPILE_WAIT_TIMEOUT_S,
    CompileFuture,
    CompilesFull,
    GrammarCompilerPool,
    GrammarState,
    step_cost_error,
)

log = logging.getLogger("infer.engine")

GRAMMAR_WAIT_S = 0.05  # a step with nothing to run but grammars compiling waits this long for one


@dataclass
class _Compiling:
    """A structured-output request whose grammar is compiling: scheduled when `future` is done."""

    request: Request
    future: CompileFuture
    arrived: float  # time.monotonic() when it came
    resumed: list[int]  # delivered tokens (a failover) its matcher must replay

    def late(self, now: float) -> tuple[str, str] | None:
        """(error, code) when it fails before its grammar is ready: its compile ran past COMPILE_TIMEOUT_S (the
        grammar's fault: "invalid_request"), or it waited past COMPILE_WAIT_TIMEOUT_S in all, most of it queued
        ("overloaded"; worker/engine/structured.py); None while it may wait on."""
        started = self.future.started_at
        if started is not None and now - started > COMPILE_TIMEOUT_S:
            return f"structured_outputs: the grammar did not compile within {COMPILE_TIMEOUT_S:g} s", "invalid_request"
        if now - self.arrived > COMPILE_WAIT_TIMEOUT_S:
            return (
                f"structured_outputs: the grammar was not ready within {COMPILE_WAIT_TIMEOUT_S:g} s of the "
                f"request's arrival, queued behind other compiles on this worker; retry later",
                "overloaded",
            )
        return None


class GrammarQueue:
    """Structured-output requests waiting for their grammar (module docstring). Ready ones go to `scheduler`;
    failed ones end through `outputs`."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int],
        scheduler: Scheduler,
        outputs: OutputProcessor,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler
        self.outputs = outputs
        self._grammars: GrammarCompilerPool | None = None  # made at the first structured-output request
        self._compiling: dict[str, _Compiling] = {}  # requests waiting for their grammar, not yet scheduled

    def __len__(self) -> int:
        return len(self._compiling)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._compiling

    @property
    def requests(self) -> list[Request]:
        return [c.request for c in self._compiling.values()]

    def pop(self, request_id: str) -> Request | None:
        """Take a waiting request out (an abort); None if it is not waiting here."""
        waiting = self._compiling.pop(request_id, None)
        return None if waiting is None else waiting.request

    def wait(self) -> None:
        """A bounded wait (GRAMMAR_WAIT_S) for one compile to finish: a step with nothing else to do."""
        wait([c.future for c in self._compiling.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)

    def close(self) -> None:
        """End the compile thread (after the compile it runs). Idempotent."""
        if self._grammars is not None:
            self._grammars.close()
            self._grammars = None

    def compile(self, request: Request, resumed: list[int], client: str | None) -> Delta | None:
        """Compile the request's grammar on the compiler's thread; `admit_ready` schedules it once ready.
        Past the compile bounds it fails at once as "overloaded": its final delta is returned."""
        if self._grammars is None:
            self._grammars = GrammarCompilerPool(
                self.tokenizer,
                self.vocab_size,
                list(self.eos_token_ids),
                max_compiles=self.config.max_grammar_compiles,
                max_compiles_per_client=self.config.max_grammar_compiles_per_client,
                step_budget_s=self._budget_s,
            )
        try:
            # set: add_request compiles only a request with structured outputs
            future = self._grammars.compile(cast(StructuredOutputsParams, request.params.structured_outputs), client)
        except CompilesFull as e:
            log.warning("request %r refused: %s", request.request_id, e)
            request.status, request.error, request.error_code = RequestStatus.FINISHED_ERROR, str(e), "overloaded"
            request.queue_time_s = 0.0  # with it, the coordinator tells the client (coordinator/relay.py)
            return self.outputs.final(request, "", [], queue_time_s=0.0)
        self._compiling[request.request_id] = _Compiling(request, future, time.monotonic(), resumed)
        return None

    @property
    def _budget_s(self) -> float:
        return self.config.max_grammar_step_ms / 1e3

    def admit_ready(self) -> list[Delta]:
        """Schedule the requests whose grammar is ready (their matcher replays tokens already delivered);
        fail those whose spec did not compile, or not in time, or costs too much, as invalid requests."""
        outputs = []
        now = time.monotonic()
        for rid, waiting in list(self._compiling.items()):
            # (a compile that is late stays in flight: other requests may share it, and it still counts against the
            # bounds while the compile thread works on it)
            failed = None if waiting.future.done() else waiting.late(now)
            if failed is None and not waiting.future.done():
                continue
            del self._compiling[rid]
            if failed is None:
                error = self._start_grammar(waiting)
                if error is None:
                    self.scheduler.add(waiting.request)
                    continue
                failed = error, "invalid_request"
            request = waiting.request
            request.status, request.error, request.error_code = RequestStatus.FINISHED_ERROR, *failed
            outputs.append(self.outputs.final(request, "", []))
        return outputs

    def _start_grammar(self, waiting: _Compiling) -> str | None:
        """Give the request its matcher (its compile done), advanced over its resumed tokens; the reason it cannot
        have one."""
        try:
            state = GrammarState(waiting.future.result())
        except Exception as e:  # xgrammar's reason: an invalid schema, regex or grammar; or one too costly
            return f"structured_outputs: {grammar_reason(e)}"
        for token_id in waiting.resumed:
            if not state.accept(token_id):
                return f"structured_outputs: resumed token {token_id} does not match the grammar"
        if not state.terminated and not state.admits_a_token():  # the sampler would have no token to choose
            if waiting.resumed:
                return f"structured_outputs: the grammar admits no token after the {len(waiting.resumed)} resumed"
            return f"structured_outputs: {NO_FIRST_TOKEN}"
        cost, steps = state.take_step_cost(), 1 + len(waiting.resumed)  # a resumed request's replay: a step each
        if cost > self._budget_s * steps:
            return f"structured_outputs: {step_cost_error(cost, self._budget_s, 'to start', steps)}"
        waiting.request.grammar = state
        return None

    def fail_costly(self, chunks: Sequence[ScheduledChunk]) -> list[Delta]:
        """Fail (invalid_request) each request of the step whose grammar took more CPU than its budget in it
        (worker/engine/structured.py): it slowed this step; it slows no other."""
        failed = []
        for chunk in chunks:
            request, budget = chunk.request, self._budget_s
            cost = 0.0 if request.grammar is None else request.grammar.take_step_cost()
            if cost > budget and not request.is_finished:
                message = f"structured_outputs: {step_cost_error(cost, budget)}"
                log.warning("request %r failed: %s", request.request_id, message)
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, message)
                request.error_code = "invalid_request"
                failed.append(self.outputs.final(request, "", []))
        return failed
