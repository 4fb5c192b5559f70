"""Structured outputs in the worker, through xgrammar: grammars compiled off the engine step, one matcher per
request, and the step's token bitmask.

- `GrammarCompilerPool.submit(spec)` compiles on the pool's own thread and returns a Future; the engine keeps
  the request out of the scheduler until it is done (worker/engine.py), so a slow compile never stalls a
  step. xgrammar's compiler caches what it compiled (bounded by CACHE_BYTES): a schema compiles once per
  engine. The TokenizerInfo (the vocabulary's bytes, ~0.3 s) is built on that thread at the first request.
  A compile cannot be interrupted: a request whose grammar is not ready within COMPILE_TIMEOUT_S fails, and
  with one compile thread at most one runaway compile occupies a core (the specs' sizes are bounded in
  protocol/structured.py; the costliest measured, maxLength 10**7, takes ~4 s).
- `GrammarState` is a request's matcher: `accept(token)` after each sampled token, `fill(bitmask, row)` before
  the next sample. A request resumed on this engine replays its delivered tokens into a fresh matcher.
- JSON schemas compile without free whitespace (compact JSON): with it, small models can emit whitespace
  until their token budget ends.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from infer.protocol.structured import StructuredOutputsParams

log = logging.getLogger("infer.structured")

COMPILE_THREADS = 1
COMPILE_TIMEOUT_S = 30.0
CACHE_BYTES = 256 << 20


class GrammarCompilerPool:
    """Compiles StructuredOutputsParams into xgrammar CompiledGrammars on a thread of its own."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="infer-grammar")
        self._compiler: Any = None        # built on the pool's thread, used only there

    def submit(self, spec: StructuredOutputsParams) -> Future:
        return self._executor.submit(self._compile, spec)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._compiler or self._make_compiler()
        kind = spec.kind
        if kind == "json":
            return compiler.compile_json_schema(spec.json, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return compiler.compile_grammar(spec.grammar)

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=CACHE_BYTES)
        return self._compiler


class GrammarState:
    """One request's place in its grammar. Not thread-safe: the engine's thread owns it."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = compiled.tokenizer_info.vocab_size

    def admits_a_token(self) -> bool:
        """Whether some token (a stop token included) may come next: False for a grammar that admits nothing
        from here, where the sampler would have no token to choose."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no change) if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row `row` of `bitmask` ([R, W] int32, CPU): the tokens allowed next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may be generated."""
        return bool(self._matcher.is_terminated())


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)
