"""EngineClient: what the HTTP front and AsyncLLM need from "something that generates".

Two implementations share it: `InferenceClient` (a cluster behind a coordinator) and `LocalEngine`
(one engine in this process, stepped by its own thread). Code written against this protocol runs on
either, which is how `AsyncLLM.serve()` puts the same HTTP front on direct mode and on a cluster.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from infer.protocol.lora import LoRARequest
from infer.protocol.messages import ClusterStats
from infer.protocol.outputs import Completion, RequestOutput
from infer.protocol.sampling import SamplingParams

Prompt = (
    str | Sequence[int] | dict[str, Any]
)  # a dict: vLLM's multimodal or encoder-decoder form (client/multimodal.py, prompt_forms.py)
# new weights: a safetensors directory, or (checkpoint name, tensor) pairs (a mapping of them, or an iterable)
WeightSource = str | os.PathLike[str] | Iterable[tuple[str, Any]] | Mapping[str, Any]


class ClusterError(RuntimeError):
    """The cluster could not be reached or refused something; the text is the server's message where it gave one.
    Raised by every EngineClient (InferenceClient, LocalEngine) for what the cluster or the engine refused."""


@runtime_checkable
class EngineClient(Protocol):
    """An async source of generations.

    Contract:
    - `stream` yields deltas (`token_ids`/`text` new since the previous one); the last has `finished` and a
      `finish_reason`. A request-level failure is the last delta with finish_reason "error", `error` (text)
      and `error_code` (one of protocol.outputs.ERROR_CODES); it never raises for that. The first delta
      carries `num_prompt_tokens` (and `queue_time_s` where known). Leaving the iteration early aborts
      the request and frees its KV blocks.
    - `timeout` (seconds, in (0, MAX_REQUEST_TIMEOUT_S], counted from the call): a request that has not
      finished by then is aborted (its KV blocks freed) and its stream ends with a last delta with
      finish_reason "error", error_code "timeout". It never raises TimeoutError; a timeout outside that
      range raises ValueError.
    - A request refused because a queue on its way is full ends at once with error_code "overloaded"
      (it was not run: retrying later is safe).
    - `generate` is `stream` folded into one Completion (a timeout is its finish_reason / error_code).
    - `stats` answers from the live engine(s), never from a cache: it is the health check's round trip.
    - `pause / unpause / suspend / resume` return the new state, or raise RuntimeError where the
      implementation has no such lifecycle (direct mode) with a message that says so.
    - `update_weights(source)` loads new weights (a safetensors directory, or (name, tensor) pairs) and
      returns the new weight version once the engine(s) serve it; every later delta carries it
      (`weight_version`). A bad tensor raises (ValueError in-process, ClusterError from a cluster) and the
      old weights keep serving.
    - `add_lora(LoRARequest)` / `remove_lora(name)` load / unload a LoRA adapter (PEFT's folder) on the engine(s)
      and return the adapters then served (name -> folder); `list_loras()` returns them (vLLM's engine names, which
      LLM and AsyncLLM use too). A
      refusal (bad folder, LoRA not enabled, no administrator key on a cluster) raises (ValueError in-process,
      ClusterError from a cluster). Requests name an adapter by `SamplingParams.lora_name`.
    - `model`: the model the request runs on (a cluster of several: a worker's model id, or a LoRA adapter, which
      runs on its base model); None: the only model served, or the cluster's default. A model not served ends the
      request with error_code "model_not_found" (a cluster) or raises ValueError (in-process: one model).
    - `traceparent` (W3C trace context of the caller's span): the hops behind `stream` that trace record their
      spans under it (protocol/tracing.py); in-process, nothing further is traced.
    - `session_id` (the HTTP front's X-Session-ID): a cluster runs the request where the session's previous one ran,
      while that worker can take it (coordinator/sessions.py); in-process it changes nothing.
    - Transport failures (cluster unreachable, client closed) raise `ClusterError`.
    """

    @property
    def model_id(self) -> str | None: ...

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        traceparent: str | None = None,
        model: str | None = None,
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        priority: int = 0,
        model: str | None = None,
        session_id: str | None = None,
    ) -> Completion: ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> ClusterStats: ...

    async def pause(self) -> str: ...

    async def unpause(self) -> str: ...

    async def suspend(self) -> str: ...

    async def resume(self) -> str: ...

    async def update_weights(
        self, source: WeightSource, *, on_running: str = "drain", timeout: float = 600.0
    ) -> int: ...

    async def add_lora(self, lora_request: LoRARequest) -> dict[str, str]: ...

    async def remove_lora(self, lora_name: str) -> dict[str, str]: ...

    async def list_loras(self) -> dict[str, str]: ...

    async def close(self) -> None: ...
