"""FrontConfig: the options of one HTTP front (client/api/app.py builds the front from them; the routes' helpers
read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer.client.api.reasoning import REASONING_PARSERS
from infer.client.api.tokenization import DEFAULT_LOAD_TIMEOUT_S
from infer.client.api.tools import TOOL_PARSERS
from infer.protocol.tracing import require_sdk

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class FrontConfig:
    """Options of one HTTP front. `served_model_name`: the name clients put in `model`."""

    served_model_name: str
    api_key: str | None = None
    max_concurrent_requests: int = 1024  # engine requests in flight through this front (n counts n times)
    health_timeout: float = 5.0  # seconds /health (and /metrics) wait for the cluster's answer
    view_max_age: float = 1.0  # seconds a cluster view serves admission before a fresh round trip
    retry_after: int = 1  # seconds, in the Retry-After header of a 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is refused with 413
    allowed_local_media_path: Path | None = None  # file:// image URLs are read under it (client/api/images.py)
    tool_call_parser: str | None = None  # client/api/tools.py; None: the one the chat template's format calls for
    matryoshka_dimensions: tuple[int, ...] | None = None  # /v1/embeddings' dimensions: None refused, () any size
    reasoning_parser: str | None = None  # client/api/reasoning.py; None: no reasoning_content
    admin_api_key: str | None = None  # may cancel any request (client/api/cancel.py)
    chat_template: str | None = None  # instead of the tokenizer's (--chat-template)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # --generation-config: model_defaults.py
    otlp_traces_endpoint: str | None = None  # OpenTelemetry spans of the front's hops (protocol/tracing.py)
    # (model name, tokenizer path): models whose tokenizer is read there, not where their workers say (--tokenizer-for)
    tokenizer_for: tuple[tuple[str, str], ...] = ()
    tokenizer_load_timeout: float = DEFAULT_LOAD_TIMEOUT_S  # seconds a request waits for its model's tokenizer to load

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
        if self.admin_api_key is not None and (not self.admin_api_key or self.admin_api_key == self.api_key):
            raise ValueError("admin_api_key must not be empty nor the same as api_key")
        for name in ("max_concurrent_requests", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_timeout", "view_max_age", "tokenizer_load_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.otlp_traces_endpoint is not None:
            require_sdk()
        if self.retry_after < 0:
            raise ValueError(f"retry_after must be >= 0, got {self.retry_after}")
        names = [name for name, _ in self.tokenizer_for]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"--tokenizer-for names {', '.join(map(repr, repeated))} more than once")
        if self.served_model_name in names:
            raise ValueError(
                f"--tokenizer-for {self.served_model_name}=...: {self.served_model_name!r} is this front's default "
                "model, whose tokenizer --model gives"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
