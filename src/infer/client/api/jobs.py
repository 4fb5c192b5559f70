"""Job: one engine request of an HTTP request, and what its deltas carried (the routes build them, the response
formats read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from infer.client.api.metrics import RequestTracker
from infer.client.transcription import audio_prompt
from infer.protocol.messages import BeamOutput
from infer.protocol.outputs import Completion, RequestOutput, TokenLogprobs
from infer.protocol.sampling import SamplingParams


@dataclass
class Job:
    """One engine request of an HTTP request: prompt `prompt_index`, choice `index` of the response. What its
    deltas carried is folded into `completion` (protocol/outputs.py, the same record `LLM` returns); the
    properties read it the way the response formats want it."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    tracker: RequestTracker
    timeout: float | None = None
    priority: int = 0
    echo: str = ""  # completions' `echo`: the prompt's text, shown before the first text
    num_prompt_tokens: int = 0
    traceparent: str | None = None  # the caller's W3C trace context (a valid `traceparent` header), passed on
    model: str | None = None  # the cluster's model it runs on, when it serves several (Front.model_of)
    session_id: str | None = None  # the caller's X-Session-ID: the cluster pins the conversation to its worker
    images: list[bytes] = field(default_factory=list)  # a chat's images, in the order of its image tokens
    audio: Any = None  # a transcription's window: samples at AUDIO_SAMPLE_RATE (client/transcription.py)
    completion: Completion = field(init=False)

    def __post_init__(self) -> None:
        self.completion = Completion(self.request_id, self.prompt_token_ids)

    @property
    def prompt(self) -> list[int] | dict[str, Any]:
        """What the engine client is given: the prompt's ids, with its images or audio in vLLM's multimodal form."""
        if self.audio is not None:
            return audio_prompt(self.prompt_token_ids, self.audio)
        if not self.images:
            return self.prompt_token_ids
        return {"prompt_token_ids": self.prompt_token_ids, "multi_modal_data": {"image": self.images}}

    def add(self, delta: RequestOutput) -> None:
        self.tracker.on_delta(delta)
        self.completion.add(delta)
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.completion.token_ids

    @property
    def text(self) -> str:
        return self.completion.text

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        return self.completion.logprobs or []

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """Prompt tokens 1.. (the Completion's list starts with None, vLLM's entry for the first prompt token)."""
        rows = self.completion.prompt_logprobs
        return None if rows is None else cast("list[TokenLogprobs]", rows[1:])

    @property
    def embedding(self) -> list[float] | None:
        return self.completion.embedding

    @property
    def beams(self) -> list[BeamOutput] | None:
        return self.completion.beams
