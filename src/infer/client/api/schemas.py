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
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from infer.client.api.tools import MAX_TOOLS, parameters_schema, required_schema
from infer.protocol.messages import MAX_REQUEST_TIMEOUT_S
from infer.protocol.sampling import MAX_LOGPROBS, SamplingParams
from infer.protocol.structured import StructuredOutputsParams

MAX_N = 16
MAX_STOP = 8
MAX_COMPLETIONS_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_USER_CHARS = 512

TokenIdList = list[Annotated[int, Field(ge=0)]]


class ApiError(Exception):
    """An error answered with OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        499: "client_closed_request",
        500: "internal_error",
        503: "service_unavailable_error",
        504: "timeout_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """`retry_after` (seconds) becomes the Retry-After header; `headers` are sent as given."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    """`include_usage`: a last chunk with the whole request's usage (OpenAI's); `continuous_usage_stats` (vLLM's):
    every chunk carries its choice's usage so far (with or without include_usage)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_only_with_its_type(cls, value: JsonSchemaFormat | None, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("json_schema goes with type 'json_schema' only")
        return value

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, choice, grammar (EBNF), json_object."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras), and `timeout`.

    `timeout` (our extension): seconds the request may take, in (0, 7 days]; past it the request is
    aborted, its KV blocks freed, and the answer is 504 with code "timeout" (mid-stream: an SSE error event).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the server's default model (--served-model-name), as vLLM takes it
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # Ranges of what becomes SamplingParams are stated there, once (its FieldError is a 400 naming the field); the
    # fields bounded here are the ones the front itself uses first (max_tokens, n, stop, seed, timeout, priority).
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None  # OpenAI's end-user id: accepted, unused
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIdList | None = None
    allowed_token_ids: TokenIdList | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the logprobs of the prompt's tokens (not with stream)
    prompt_logprobs: int | None = None
    # our extension: a per-request deadline
    timeout: Annotated[float, Field(gt=0, le=MAX_REQUEST_TIMEOUT_S, allow_inf_nan=False)] | None = None
    # vLLM's: lower is served first (workers with --scheduling-policy priority; the coordinator sheds by it)
    priority: Annotated[int, Field(ge=-(2**63), lt=2**63, strict=True)] = 0
    # vLLM's beam search: one engine request of best_of (completions) or n beams, the best n returned as choices
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # our extension: this request never speculates (SamplingParams.disable_speculative_decoding)
    disable_speculative_decoding: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        for s in [value] if isinstance(value, str) else value or []:
            if not s:
                raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdecimal() and len(key) <= 10):
                raise ValueError(f"logit_bias keys must be token ids (decimal strings), got {key[:20]!r}")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs cannot be streamed yet")
        return value

    def structured_spec(self) -> tuple[str, StructuredOutputsParams] | None:
        """The body's output constraint and the field that gave it; ApiError (400 naming the field) if more
        than one field gives one or the one given is malformed. Whether it compiles is checked by the front."""
        given: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        if self.response_format is not None and self.response_format.json_schema is not None:  # type json_schema
            given.append(("response_format.json_schema.schema", {"json": self.response_format.json_schema.schema_}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            if fields.get("json_object") is False:
                del fields["json_object"]
            given.append(("structured_outputs", fields))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise ApiError(400, f"give one output constraint, got several: {names}", param=given[1][0])
        field, spec = given[0]
        try:
            return field, StructuredOutputsParams.from_dict(spec)
        except ValueError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None

    def token_id_fields(self) -> dict[str, list[int]]:
        """The token ids the body names outside its prompt, by field (the front checks them against the
        vocabulary)."""
        return {
            "logit_bias": [int(k) for k in self.logit_bias or {}],
            "allowed_token_ids": list(self.allowed_token_ids or ()),
            "stop_token_ids": list(self.stop_token_ids or ()),
        }

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def beam_width(self) -> int | None:
        """With use_beam_search, the beams: completions' best_of when given, else n."""
        return (getattr(self, "best_of", None) or self.n) if self.use_beam_search else None

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        seed_offset: int = 0,
        structured: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """SamplingParams of choice number `seed_offset` (a seeded request's choices get seed, seed+1...). A
        sampling field the body leaves out takes `defaults` (the generation config's), else ours."""
        seed = None if self.seed is None else (self.seed + seed_offset) % 2**63
        ours = {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            **(defaults or {}),
        }
        beams: dict[str, Any] = {}  # SamplingParams' beam-search keywords, each of its own type
        if self.use_beam_search:  # deterministic: the sampling defaults do not apply (a given temperature > 0 fails)
            ours.update(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)
            beams = dict(
                beam_width=self.beam_width,
                n=self.n,
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
            )
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        value = {name: ours[name] if v is None else v for name, v in given.items()}
        # the casts: SamplingParams.__post_init__ takes a single stop string or a list, and logit_bias as a
        # mapping of decimal-string ids, and stores them as tuples
        return SamplingParams(
            temperature=value["temperature"],
            top_p=value["top_p"],
            top_k=value["top_k"],
            min_p=value["min_p"],
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens or self.min_tokens),
            stop=cast("tuple[str, ...]", self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=value["repetition_penalty"],
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=cast("tuple[tuple[int, float], ...] | None", self.logit_bias or None),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()),
            structured_outputs=structured,
            prompt_logprobs=prompt_logprobs,
            disable_speculative_decoding=self.disable_speculative_decoding,
            **beams,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def _prompt_list(value: list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A list field's prompts: one prompt when it holds token ids, else one prompt per item."""
    ids = [p for p in value if isinstance(p, int)]
    return [ids] if len(ids) == len(value) else [p for p in value if not isinstance(p, int)]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: str | TokenIdList | list[str] | list[TokenIdList]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETIONS_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    # Field validators (not a model validator) so that a 400 names the field: each sees the fields declared
    # before it in `info.data`.
    @field_validator("echo")
    @classmethod
    def _echo_with_logprobs_not_streamed(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None and info.data.get("stream"):
            raise ValueError("echo with logprobs cannot be streamed yet (it needs the prompt's logprobs)")
        return value

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """The prompt logprobs to ask the engine for: prompt_logprobs, and echo's logprobs of the prompt."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(wanted) if wanted else None

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"best_of must be >= n (best_of={value}, n={n})")
        if value is not None and value > n and info.data.get("stream") and not info.data.get("use_beam_search"):
            raise ValueError("best_of greater than n cannot be streamed (the best are known only at the end)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value:
            raise ValueError("suffix is not supported")
        return None

    @property
    def num_candidates(self) -> int:
        """Engine requests per prompt: best_of when given, else n."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (one request each)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        return _prompt_list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; every image is taken at the model's size


class ImageUrlPart(BaseModel):
    """OpenAI's image content part: a base64 `data:` URL, or a `file://` URL under --allowed-local-media-path
    (client/api/images.py)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. `name`; passed to the chat template as given
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @property
    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImageUrlPart)]

    def as_template_message(self, image_marker: str = "") -> dict[str, Any]:
        """The message for the chat template: content parts joined into one text, each image part as
        `image_marker` (where client/chat_encoding.py puts the model's image token)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text if isinstance(part, TextPart) else image_marker for part in content)
        message = dict(self.model_extra or {})
        message.update(role="system" if self.role == "developer" else self.role, content=content or "")
        return message

    def as_template_parts(self) -> dict[str, Any]:
        """The message for a chat template that iterates content parts (llava-hf's): a list of {"type": "text",
        "text"} and {"type": "image"}, in order (the template writes the image token itself)."""
        content = self.content
        if isinstance(content, list):
            parts = [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in content
            ]
        else:
            parts = [{"type": "text", "text": content}] if content else []
        message = dict(self.model_extra or {})
        message.update(role="system" if self.role == "developer" else self.role, content=parts)
        return message


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Annotated[str, Field(max_length=8192)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    """One entry of `tools`: OpenAI's function tool."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "tokenize",
        "add_generation_prompt",
        "chat_template",
        "return_dict",
        "continue_final_message",
    }
)
MAX_TEMPLATE_KWARGS = 32


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs, unless they set what the front itself passes to the template."""
    reserved = sorted(set(value or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    return value


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. Tools: see client/api/tools.py."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None
    allow_special_tokens_in_content: bool = False  # ours: special-token text in content stays live (see README)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_its_tool(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if value in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {value!r} needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"tool_choice names {value.function.name[:64]!r}, which is not among the tools")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _template_kwargs(value)

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice "none"), "auto" (the default with tools), "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def structured_spec(self) -> tuple[str, StructuredOutputsParams] | None:
        """As for completions, plus tool_choice "required" or a named function, which constrain the output
        themselves (client/api/tools.py) and so exclude the other constraints."""
        given = super().structured_spec()
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return given
        if given is not None:
            raise ApiError(
                400,
                f"tool_choice {mode!r} constrains the output itself; it cannot be combined with {given[0]}",
                param=given[0],
            )
        if isinstance(self.tool_choice, NamedToolChoice):  # mode "named"
            tool = next(t for t in self.tool_dicts if t["function"]["name"] == self.tool_choice.function.name)
            schema = parameters_schema(tool)
        else:
            schema = required_schema(self.tool_dicts, self.parallel_tool_calls)
        try:
            # the cast: StructuredOutputsParams.__post_init__ takes a schema dict and stores it as compact JSON text
            return "tools", StructuredOutputsParams(json=cast(str, schema))
        except ValueError as e:
            raise ApiError(400, f"tools: {e}", param="tools") from None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a text `prompt`, or chat `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None  # with messages, as in chat
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None
    allow_special_tokens_in_content: bool = False  # with messages, as in chat

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _template_kwargs(value)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: TokenIdList


MAX_EMBEDDING_INPUTS = 512


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's body (`input`: a string, strings, token ids or lists of them; `encoding_format`
    float or base64; `dimensions` for a Matryoshka model only; `user`), plus `pooling` (last / mean / cls; default
    last, the one for decoder models) and `normalize` (L2, default true: vLLM's), and our `timeout` and vLLM's
    `priority` as for generation."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # None: the server's default model
    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[TokenIdList, Field(min_length=1)]
        | Annotated[
            list[Annotated[TokenIdList, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
        ]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None
    pooling: Literal["last", "mean", "cls"] = "last"
    normalize: bool = True
    timeout: Annotated[float, Field(gt=0, le=MAX_REQUEST_TIMEOUT_S, allow_inf_nan=False)] | None = None
    priority: Annotated[int, Field(ge=-(2**63), lt=2**63, strict=True)] = 0

    def prompts(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        return _prompt_list(value)


class UpdateWeightsRequest(BaseModel):
    """POST /v1/update_weights: new weights from a safetensors directory every worker can read."""

    model_config = ConfigDict(extra="forbid")
    model: str
    path: str = Field(min_length=1, max_length=4096)
    on_running: Literal["drain", "abort"] = "drain"
    timeout: float = Field(default=600.0, gt=0, le=86400.0)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter: a PEFT LoRA folder every worker can read, served as model `lora_name`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter (`lora_path` allowed, as vLLM's clients send it, and not used)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str | None = None
