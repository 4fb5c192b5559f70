"""BenchmarkEngine: infer-worker --benchmark-mode, the engine interface with no model and no torch. It measures
the coordinator's overhead, and it is the fake engine the worker core's frame-by-frame tests drive."""

from __future__ import annotations

import time
from collections.abc import Sequence

from infer.protocol.messages import Delta, KvEvents, Load, TokenIds, UpdateWeights
from infer.protocol.sampling import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.request import Request, overdue_message


class BenchmarkEngine:
    """--benchmark-mode: the engine interface with no model and no torch, for measuring coordinator overhead.

    Every request "generates" one token per step: token i (0-based, resumed tokens included) of a request
    with a P-token prompt is `(P + i) % 1000`, with empty text, until max_tokens (resumed tokens count toward
    it) or the context length: finish_reason "length". A string prompt counts one token per UTF-8 byte. The
    first `max_num_seqs` requests in arrival order run; the KV pool is bookkept (blocks of the tokens held) but
    not allocated.
    """

    def __init__(self, config: EngineConfig, step_time: float = 0.0) -> None:
        self.config = config
        self.step_time = step_time  # --benchmark-step-time: each step lasts this long (a long prefill)
        self.model_id = config.model_id
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or 4096
        self._requests: dict[str, Request] = {}  # arrival order
        self._pending: list[Delta] = []
        self.weight_version = 0  # never changes: no weights

    @property
    def num_kv_blocks(self) -> int:
        return self.config.max_num_seqs * -(-self.max_model_len // self.block_size)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        resumed_token_ids: Sequence[int] = (),
        resumed_text_len: int | None = None,
        priority: int = 0,
        client: str | None = None,
        images: Sequence[object] = (),
        decoder_prompt: str | Sequence[int] | None = None,
        audio: bytes | None = None,
    ) -> Request:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if decoder_prompt is not None:
            raise ValueError("decoder_prompt is for encoder-decoder models; the benchmark engine is decoder-only")
        if images or audio:
            raise ValueError("the benchmark engine takes no images or audio: it runs no model")
        params = params or SamplingParams()
        if isinstance(prompt, str) and len(prompt) >= self.max_model_len:  # a token per byte: never fits
            raise ValueError(f"the prompt is {len(prompt)} characters; the context is {self.max_model_len} tokens")
        prompt_ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        num_tokens = len(prompt_ids) + len(resumed_token_ids)
        if not prompt_ids or num_tokens >= self.max_model_len:
            raise ValueError(f"prompt + resumed tokens must be 1..{self.max_model_len - 1} tokens, got {num_tokens}")
        max_tokens = self.max_model_len - len(prompt_ids) if params.max_tokens is None else params.max_tokens
        if len(resumed_token_ids) >= max_tokens:  # resumed tokens count toward max_tokens (as in Engine)
            raise ValueError(
                f"the resumed tokens ({len(resumed_token_ids)}) reach max_tokens ({max_tokens}): "
                f"nothing is left to generate"
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            max_tokens=max_tokens,
            token_ids=prompt_ids + list(resumed_token_ids),
            arrival_time=time.monotonic(),
        )
        self._requests[request_id] = request
        return request

    def _running(self) -> list[Request]:
        return list(self._requests.values())[: self.config.max_num_seqs]

    def step(self) -> list[Delta]:
        if self.step_time > 0:
            time.sleep(self.step_time)  # stands for compute: the step's cost, not a wait for anything
        outputs = self.take_pending()
        for request in self._running():
            token = (request.num_prompt_tokens + request.num_output_tokens) % 1000
            request.append_token(token)
            done = request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len
            if done:
                del self._requests[request.request_id]
                outputs.append(
                    Delta.final(
                        request.request_id, "length", token_ids=[token], num_prompt_tokens=request.num_prompt_tokens
                    )
                )
            else:
                outputs.append(
                    Delta(
                        request_id=request.request_id,
                        token_ids=TokenIds([token]),
                        text="",
                        num_prompt_tokens=request.num_prompt_tokens,
                    )
                )
        return outputs

    def take_pending(self) -> list[Delta]:
        outputs, self._pending = self._pending, []
        return outputs

    def shed_overdue(self, max_queue_time: float) -> int:
        """As Engine.shed_overdue: the requests past the first max_num_seqs have not started."""
        now = time.monotonic()
        overdue = [
            r
            for r in list(self._requests.values())[self.config.max_num_seqs :]
            if now - r.arrival_time > max_queue_time
        ]
        for request in overdue:
            waited = now - request.arrival_time
            del self._requests[request.request_id]
            self._pending.append(
                Delta.final(
                    request.request_id,
                    "error",
                    overdue_message(waited, max_queue_time),
                    "overloaded",
                    queue_time_s=waited,
                    num_prompt_tokens=request.num_prompt_tokens,
                )
            )
        return len(overdue)

    def abort(self, request_id: str, release_text: bool = True) -> bool:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._pending.append(Delta.final(request_id, "abort", num_prompt_tokens=request.num_prompt_tokens))
        return request is not None

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def suspend(self) -> int:
        return 0  # no KV pool, no weights

    def resume(self) -> int:
        return 0

    def prepare_update(self, msg: UpdateWeights) -> object:
        raise ValueError("a --benchmark-mode worker has no weights to update")

    def check_prepared(self, update: object) -> None:
        raise ValueError("a --benchmark-mode worker has no weights to update")

    def update_weights(self, source: object, version: int | None = None) -> int:
        raise ValueError("a --benchmark-mode worker has no weights to update")

    def add_lora(self, name: str, path: str, int_id: int | None = None) -> dict[str, object]:
        raise ValueError("LoRA adapters need a model: not in --benchmark-mode")

    def remove_lora(self, name: str) -> bool:
        return False

    def list_loras(self) -> list[dict[str, object]]:
        return []

    def publish_kv_events(self, on: bool) -> None:
        pass  # no prefix cache: nothing to publish

    def take_kv_events(self) -> KvEvents | None:
        return None

    def load(self) -> Load:
        running = self._running()
        used = sum(-(-r.num_tokens // self.block_size) for r in running)
        return Load(
            num_waiting=len(self._requests) - len(running),
            num_running=len(running),
            num_free_blocks=self.num_kv_blocks - used,
            num_total_blocks=self.num_kv_blocks,
            num_queued_tokens=sum(r.max_tokens - r.num_output_tokens for r in self._requests.values()),
        )
