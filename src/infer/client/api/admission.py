"""The HTTP front's gate: the API key (resolve_api_key: flag, file or $INFER_API_KEY; authorize: the bearer
header, compared in constant time) and admission (a cluster view at most `view_max_age` old, the bound on
requests in flight through this front, the context length prompts are checked against)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING

from fastapi import Request

from infer.client.api.schemas import ApiError
from infer.client.engine_client import ClusterError, EngineClient
from infer.protocol import env
from infer.protocol.codes import ClusterState
from infer.protocol.messages import ClusterStats

if TYPE_CHECKING:
    from infer.client.api.config import FrontConfig

log = logging.getLogger("infer.api")


def max_model_len(view: ClusterStats, healthy_only: bool = True, model: str | None = None) -> int | None:
    """The smallest context length of the view's workers (healthy ones, unless not `healthy_only`), of `model`'s
    workers when given."""
    lens = [
        w.max_model_len
        for w in view.workers
        if (w.healthy or not healthy_only) and (model is None or w.model_id in (None, model))
    ]
    return min(lens) if lens else None


def check_length(num_prompt: int, max_tokens: int | None, max_len: int) -> None:
    if num_prompt >= max_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {max_len} tokens, but the prompt has "
            f"{num_prompt} tokens; shorten it to leave room for at least one generated token",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt + max_tokens > max_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {max_len} tokens, but "
            f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, "
            f"{max_tokens} in the completion); reduce the prompt or max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )


def resolve_api_key(api_key: str | None, api_key_file: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The front's API key: `api_key` (a flag), else the first line of `api_key_file`, else $INFER_API_KEY
    (read here only; `environ` defaults to os.environ), else None (no key). ValueError, naming the source,
    for both flags at once, an unreadable or empty file, or an empty value."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        return read_key_file(api_key_file, "--api-key-file")
    if api_key is None:
        api_key = env.read_raw(env.API_KEY, environ)
        if api_key is not None and not api_key.strip():
            raise ValueError(f"${API_KEY_ENV} is set but empty; unset it to serve without a key")
    elif not api_key.strip():
        raise ValueError("--api-key must not be empty")
    return None if api_key is None else api_key.strip()


API_KEY_ENV = env.API_KEY.name


def read_key_file(path: str, flag: str) -> str:
    """The first line of `path`, stripped; ValueError naming `flag` if it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ValueError(f"{flag} {path}: cannot read it: {why}") from None
    if not key:
        raise ValueError(f"{flag} {path}: the file is empty (its first line is the key)")
    return key


def authorize(request: Request, key: str | None) -> None:
    """401 unless the header is 'Authorization: Bearer <key>' (no key: anyone). The key is compared in constant
    time, and a missing header, another scheme and a wrong key get the same answer."""
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    matches = hmac.compare_digest(token.strip().encode(), key.encode())
    if not (matches and scheme.lower() == "bearer"):
        raise ApiError(
            401,
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


class Admission:
    """Whether the cluster can take a request now, and room for it in this front."""

    def __init__(self, engine: EngineClient, config: FrontConfig) -> None:
        self.engine, self.config = engine, config
        self.in_flight = 0  # engine requests through this front (n counts n times)
        self._view: ClusterStats | None = None
        self._view_at = 0.0
        self._refresh: asyncio.Task | None = None

    @property
    def last_view(self) -> ClusterStats | None:
        """The last view fetched (None before the first), however old."""
        return self._view

    async def cluster_view(self, fresh: bool = False) -> ClusterStats:
        """The cluster's stats, at most `view_max_age` old (or fresh); one round trip serves every waiter."""
        age = time.monotonic() - self._view_at
        if not fresh and self._view is not None and age < self.config.view_max_age:
            return self._view
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._fetch_view())
        return await asyncio.shield(self._refresh)

    async def _fetch_view(self) -> ClusterStats:
        try:
            view = await asyncio.wait_for(self.engine.stats(), self.config.health_timeout)
        except (ClusterError, asyncio.TimeoutError) as e:
            raise ApiError(
                503,
                f"the cluster did not answer: {e or 'timed out'}",
                code="unavailable",
                retry_after=self.config.retry_after,
            ) from None
        self._view, self._view_at = view, time.monotonic()
        return view

    def reserve(self, num_requests: int, param: str | None = None) -> None:
        """Count `num_requests` engine requests in flight, or 503 "overloaded" at once past the limit. One HTTP
        request of more engine requests than the limit itself could never pass: a 400 naming the limit (`param`: the
        field that makes them many), not a 503 to retry forever. The caller releases them when they end; a StreamRun
        does it in close()."""
        limit = self.config.max_concurrent_requests
        if num_requests > limit:
            raise ApiError(
                400,
                f"this request needs {num_requests} engine requests at once (one per input or prompt, times n or "
                f"best_of), more than this server ever admits (--max-concurrent-requests {limit}); split it",
                param=param,
                code="too_many_engine_requests",
            )
        if self.in_flight + num_requests > limit:
            raise ApiError(
                503,
                f"the server is overloaded: {self.in_flight} requests in flight, its limit "
                f"is {limit} (--max-concurrent-requests); retry later",
                code="overloaded",
                retry_after=self.config.retry_after,
            )
        self.in_flight += num_requests

    def release(self, num_requests: int) -> None:
        self.in_flight -= num_requests

    async def admit(self, model: str | None = None) -> int:
        """The context length to check prompts against (`model`'s workers' on a cluster of several models); ApiError
        503 when the cluster, or every worker of `model`, cannot take them."""
        view = await self.cluster_view()
        if view.state == ClusterState.STOPPED:
            raise self.unavailable("the cluster is stopping")
        max_len = max_model_len(view, model=model)
        if max_len is None:
            if view.state == ClusterState.RUNNING:
                of_model = "" if model is None else f" of the model {model[:200]!r}"
                raise self.unavailable(f"no worker{of_model} is available to serve the request; retry later")
            max_len = max_model_len(view, healthy_only=False, model=model) or 0
        return max_len

    def unavailable(self, message: str) -> ApiError:
        return ApiError(503, message, code="unavailable", retry_after=self.config.retry_after)
