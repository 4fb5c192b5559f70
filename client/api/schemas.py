"""The OpenAI request bodies we accept, validated by pydantic, and their translation to SamplingParams.

Field names and ranges follow OpenAI's API reference; the extra vLLM-style sampling fields (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, ...) are accepted too. An
unknown field is an error that names it (a typo must not be silently ignored); a known OpenAI field we
do not implement is accepted only at its neutral value.

Our extension: `timeout` (seconds, > 0, at most 7 days), a per-request deadline counted from when the
request reaches the engine client. A request not finished by then is aborted (its KV blocks freed) and
answered 504 with code "timeout" (an SSE `error` event once a stream has begun).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infer.protocol.messages import MAX_REQUEST_TIMEOUT_S
from infer.protocol.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16
MAX_STOP = 8
MAX_COMPLETIONS_LOGPROBS = 5   # OpenAI's limit for /v1/completions

TokenIdList = list[Annotated[int, Field(ge=0)]]


class ApiError(Exception):
    """An error answered with OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 499: "client_closed_request",
             500: "internal_error", 503: "service_unavailable_error", 504: "timeout_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, headers: Mapping[str, str] | None = None) -> None:
        """`retry_after` (seconds) becomes the Retry-After header; `headers` are sent as given."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras), and `timeout`.

    `timeout` (our extension): seconds the request may take, in (0, 7 days]; past it the request is
    aborted, its KV blocks freed, and the answer is 504 with code "timeout" (mid-stream: an SSE error event).
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                       # accepted, not used
    # OpenAI fields we accept only at their neutral value
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIdList | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # our extension: a per-request deadline
    timeout: Annotated[float, Field(gt=0, le=MAX_REQUEST_TIMEOUT_S, allow_inf_nan=False)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        for s in [value] if isinstance(value, str) else value or []:
            if not s:
                raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> None:
        if value:
            raise ValueError("logit_bias is not supported")
        return None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        seed_offset: int = 0) -> SamplingParams:
        """SamplingParams of choice number `seed_offset` (a seeded request's choices get seed, seed+1...)."""
        seed = None if self.seed is None else (self.seed + seed_offset) % 2**63
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens or self.min_tokens),
            stop=self.stop, stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            seed=seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: str | TokenIdList | list[str] | list[TokenIdList]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16     # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETIONS_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of other than n is not supported (best_of={self.best_of}, n={self.n})")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (one request each)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # e.g. `name`; passed to the chat template as given
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = dict(self.model_extra or {})
        message.update(role="system" if self.role == "developer" else self.role, content=content or "")
        return message


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            kind = self.response_format.get("type")
            raise ValueError(f"response_format {kind!r} is not supported (only 'text')")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class UpdateWeightsRequest(BaseModel):
    """POST /v1/update_weights: new weights from a safetensors directory every worker can read."""

    model_config = ConfigDict(extra="forbid")
    model: str
    path: str = Field(min_length=1, max_length=4096)
    on_running: Literal["drain", "abort"] = "drain"
    timeout: float = Field(default=600.0, gt=0, le=86400.0)
