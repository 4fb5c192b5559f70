"""Structured outputs in the worker, through xgrammar: grammars compiled off the engine step, one matcher per
request, and the step's token bitmask. A grammar's work is bounded three ways (README, "Structured outputs"):

- Compiles, per engine and per client: `GrammarCompilerPool.compile(spec, client)` returns a Future, done at once
  for a spec compiled before (an LRU of compiled grammars by spec, bounded by CACHE_BYTES: a cached spec never
  waits behind others' compiles), shared with a compile of the same spec in flight, else queued for the pool's
  thread, which takes turns between clients (FairQueue: one client's backlog is not another's wait). A new
  compile past `max_compiles` in flight on this engine, or past `max_compiles_per_client` in flight for the
  client that asks, raises CompilesFull (the request is refused as "overloaded", not queued). The engine
  keeps the request out of the scheduler until its Future is done (worker/engine/engine.py), so a slow compile never
  stalls a step. A compile cannot be interrupted: a request whose grammar is not ready COMPILE_TIMEOUT_S after its
  compile started fails, and with one compile thread at most one runaway compile occupies a core (the specs' sizes
  are bounded in protocol/structured.py; what a schema costs depends on xgrammar's version: maxLength 10**7 took
  ~4 s with 0.1.x, milliseconds with 0.2.9, so the tests hold a compile on an event instead). The time it waits in
  the queue before that is not counted there (a burst of distinct schemas is worked off in turn, however loaded
  the machine: `CompileFuture.started_at`), only against COMPILE_WAIT_TIMEOUT_S from its arrival, the bound on a
  queue stuck behind a runaway compile.
- Up front, by the grammar's cost: on the compile thread, a compiled grammar's first token mask is filled once
  and timed (CPU time of the thread); one that takes more than a step's budget (`step_budget_s`) is refused
  (GrammarTooCostly, "invalid_request") before its request enters a batch. So is one whose compiled form is
  larger than MAX_GRAMMAR_BYTES.
- Per step: `GrammarState` meters the CPU time of its matcher's work (`fill`, `accept`); the engine takes it
  after each step (`take_step_cost`) and fails a request whose grammar took more than its budget, so a grammar
  that grows costly as it goes slows the others by one step at most.

Costs are CPU time of the engine's thread (time.thread_time): what the grammar took from the step, not what the
machine's other processes took from it. The TokenizerInfo (the vocabulary's bytes, ~0.3 s) is built on the
pool's thread at the first request. JSON schemas compile without free whitespace (compact JSON): with it, small
models can emit whitespace until their token budget ends.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from infer.protocol import env
from infer.protocol.structured import StructuredOutputsParams, admits_no_value
from infer.worker.loading.tokenizer import transformers_tokenizer

log = logging.getLogger("infer.structured")

COMPILE_TIMEOUT_S = 30.0  # a compile's own time, from when the compile thread takes it up
COMPILE_WAIT_TIMEOUT_S = 300.0  # a request's whole wait for its grammar, queued and compiling
CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse (their memory_size_bytes)
MAX_CACHED = 4096  # ... and at most this many specs (refusals included)
MAX_GRAMMAR_BYTES = 64 << 20  # a compiled grammar larger than this is refused


class CompilesFull(Exception):
    """A new compile would pass a bound (per engine or per client): refuse the request as overloaded."""


class GrammarTooCostly(ValueError):
    """A grammar whose work is over the engine's bounds (its message says which and by how much)."""


def step_cost_error(cost_s: float, budget_s: float, what: str = "in one engine step", steps: int = 1) -> str:
    """The error of a request whose grammar took `cost_s` CPU seconds `what`, over `steps` x `budget_s`."""
    times = "" if steps == 1 else f" x {steps}"
    return (
        f"the grammar is too costly to follow: its token mask and matcher took {cost_s * 1e3:.1f} ms of CPU "
        f"{what}, over this worker's bound of {budget_s * 1e3:g} ms a step{times} (--max-grammar-step-ms); "
        f"bound it more tightly (e.g. smaller or fewer nested repeats)"
    )


@dataclass
class _Compile:
    """A compile in flight: its Future, and the client it is counted against (None: no client known)."""

    future: CompileFuture
    client: str | None


class GrammarCompilerPool:
    """Compiles StructuredOutputsParams into xgrammar CompiledGrammars on a thread of its own, bounded (module
    doc). Every method but the thread's `_compile` runs on the engine's thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_compiles: int,
        max_compiles_per_client: int,
        step_budget_s: float,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_compiles = max_compiles
        self.max_compiles_per_client = max_compiles_per_client
        self.step_budget_s = step_budget_s
        self._queue = FairQueue(self._compile)
        self._compiler: Any = None  # built on the pool's thread, used only there
        self._in_flight: dict[StructuredOutputsParams, _Compile] = {}
        self._done: OrderedDict[StructuredOutputsParams, tuple[CompileFuture, int]] = OrderedDict()  # (result, bytes)
        self._done_bytes = 0

    def compile(self, spec: StructuredOutputsParams, client: str | None = None) -> CompileFuture:
        """The Future of `spec`'s CompiledGrammar (module doc); CompilesFull past a bound."""
        self._collect()
        done = self._done.get(spec)
        if done is not None:
            self._done.move_to_end(spec)
            return done[0]
        running = self._in_flight.get(spec)
        if running is not None:
            return running.future
        self._check_room(client)
        future = self._queue.submit(spec, client)
        self._in_flight[spec] = _Compile(future, client)
        return future

    def close(self) -> None:
        self._queue.close()

    def _check_room(self, client: str | None) -> None:
        if len(self._in_flight) >= self.max_compiles:
            raise CompilesFull(
                f"the worker is overloaded: {len(self._in_flight)} grammars are compiling or queued "
                f"to compile here, its bound (--max-grammar-compiles {self.max_compiles}); retry "
                f"later"
            )
        mine = 0 if client is None else sum(c.client == client for c in self._in_flight.values())
        if mine >= self.max_compiles_per_client:
            raise CompilesFull(
                f"the worker is overloaded: this client already has {mine} grammars compiling or "
                f"queued to compile here, its bound (--max-grammar-compiles-per-client "
                f"{self.max_compiles_per_client}); retry later"
            )

    def _collect(self) -> None:
        """Move the compiles that ended into the LRU (their results, refusals too: a spec is judged once)."""
        for spec, job in list(self._in_flight.items()):
            if job.future.done():
                del self._in_flight[spec]
                self._remember(spec, job.future)

    def _remember(self, spec: StructuredOutputsParams, future: CompileFuture) -> None:
        size = len(repr(spec))
        if not future.cancelled() and future.exception() is None:
            size += future.result().memory_size_bytes
        self._done[spec] = (future, size)
        self._done_bytes += size
        while self._done and (self._done_bytes > CACHE_BYTES or len(self._done) > MAX_CACHED):
            _, (_, evicted) = self._done.popitem(last=False)
            self._done_bytes -= evicted

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        """(The pool's thread.) The compiled grammar, checked for size and for the cost of its first mask."""
        delay = env.read(env.GRAMMAR_COMPILE_DELAY)
        if delay is not None:  # the tests' compile slow by construction, whatever xgrammar's speed
            time.sleep(float(delay))
        compiled = self._compile_spec(spec)
        if compiled.memory_size_bytes > MAX_GRAMMAR_BYTES:
            raise GrammarTooCostly(
                f"the grammar is too large: compiled, it takes {compiled.memory_size_bytes >> 20} "
                f"MiB, over this worker's bound of {MAX_GRAMMAR_BYTES >> 20} MiB"
            )
        state = GrammarState(compiled)
        state.fill(torch.full((1, bitmask_width(self.vocab_size)), -1, dtype=torch.int32), 0)
        cost = state.take_step_cost()
        if cost > self.step_budget_s:
            raise GrammarTooCostly(step_cost_error(cost, self.step_budget_s, "for its first token"))
        return compiled

    def _compile_spec(self, spec: StructuredOutputsParams) -> Any:
        if (reason := admits_no_value(spec)) is not None:
            raise ValueError(reason)  # ours to name, whatever xgrammar's version would say (protocol/structured.py)
        compiler = self._compiler or self._make_compiler()
        kind = spec.kind
        if kind == "json":
            return compiler.compile_json_schema(spec.json, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice or ()))
        return compiler.compile_grammar(spec.grammar)

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        # xgrammar reads a transformers tokenizer: the engine's RustTokenizer loads its own here, on this thread
        info = xgr.TokenizerInfo.from_huggingface(
            transformers_tokenizer(self.tokenizer), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        # xgrammar's own cache is off: the pool keeps what it compiled (`_done`), looked up without the thread
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


class CompileFuture(Future):
    """The Future of one compile; `started_at`: time.monotonic() when the compile thread took it up (None while it
    is queued)."""

    started_at: float | None = None


class FairQueue:
    """One thread that runs `run(spec)` for the specs submitted, taking turns between clients (round robin; the
    requests without a client are one more): a client's backlog delays another client's compile by at most the
    compile running and one of each other client's, never by the whole backlog."""

    def __init__(self, run: Callable[[StructuredOutputsParams], Any]) -> None:
        self._run = run
        self._queues: OrderedDict[str | None, deque[tuple[StructuredOutputsParams, CompileFuture]]] = OrderedDict()
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._loop, name="infer-grammar", daemon=True).start()

    def submit(self, spec: StructuredOutputsParams, client: str | None) -> CompileFuture:
        future = CompileFuture()
        with self._cond:
            self._queues.setdefault(client, deque()).append((spec, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Cancel what has not started; the thread ends after the compile it runs (which cannot be stopped)."""
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for _, future in queue:
                    future.cancel()
            self._queues.clear()
            self._cond.notify()

    def _next(self) -> tuple[StructuredOutputsParams, CompileFuture] | None:
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()  # for a submit or close (both notify): nothing else wakes this thread
            if self._closed:
                return None
            client, queue = self._queues.popitem(last=False)
            job = queue.popleft()
            if queue:
                self._queues[client] = queue  # to the back of the line: the next client's turn
            return job

    def _loop(self) -> None:
        _lowest_cpu_priority()
        while (job := self._next()) is not None:
            spec, future = job
            if not future.set_running_or_notify_cancel():
                continue
            future.started_at = time.monotonic()
            try:
                future.set_result(self._run(spec))
            except Exception as e:  # xgrammar's reason, or GrammarTooCostly: the request's answer
                future.set_exception(e)


class GrammarState:
    """One request's place in its grammar, and the CPU time its work took since the engine last asked
    (`take_step_cost`). Not thread-safe: one thread owns it (the engine's; the pool's while it checks a grammar)."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = compiled.tokenizer_info.vocab_size
        self._cost_s = 0.0

    def admits_a_token(self) -> bool:
        """Whether some token (a stop token included) may come next: False for a grammar that admits nothing
        from here, where the sampler would have no token to choose."""
        bitmask = torch.full((1, bitmask_width(self._vocab_size)), 0, dtype=torch.int32)
        self.fill(bitmask, 0)
        return bool(bitmask.any())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no change) if the grammar does not allow it."""
        start = time.thread_time()
        try:
            return bool(self._matcher.accept_token(token_id))
        finally:
            self._cost_s += time.thread_time() - start

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row `row` of `bitmask` ([R, W] int32, CPU): the tokens allowed next."""
        start = time.thread_time()
        try:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        finally:
            self._cost_s += time.thread_time() - start

    def masks_along(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[len(token_ids) + 1, W] int32 bitmasks: the tokens allowed now, then after each of `token_ids` in turn
        (the rows of a verification step, speculative decoding); the matcher ends where it started. Past a token
        the grammar rejects (or its end), rows repeat the last filled one: acceptance stops before them (the
        rejected token is masked out of the row that would accept it)."""
        masks = torch.zeros((len(token_ids) + 1, bitmask_width(self._vocab_size)), dtype=torch.int32)
        start = time.thread_time()
        advanced = 0
        try:
            for row in range(len(token_ids) + 1):
                if row > advanced or self._matcher.is_terminated():
                    masks[row] = masks[row - 1]
                    continue
                self._matcher.fill_next_token_bitmask(masks, row)
                if row < len(token_ids) and self._matcher.accept_token(token_ids[row]):
                    advanced += 1
            if advanced:
                self._matcher.rollback(advanced)
        finally:
            self._cost_s += time.thread_time() - start
        return masks

    def take_step_cost(self) -> float:
        """CPU seconds of `fill` and `accept` since the last call (the engine asks once a step)."""
        cost, self._cost_s = self._cost_s, 0.0
        return cost

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may be generated."""
        return bool(self._matcher.is_terminated())


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _lowest_cpu_priority() -> None:
    """This thread (Linux: a nice value per thread) yields the CPU to the engine's threads: a compile takes the
    cores the steps leave, so requests beside it keep their step times (benchmarks/grammar_bystander.py)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: compiles share the CPU evenly
        pass
