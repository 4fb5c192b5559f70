"""The OpenAI-compatible HTTP front: an ASGI app over any EngineClient (a cluster or an in-process engine). This
file wires the routes and answers every error in OpenAI's shape. Beside it: `front.py` (what every route shares:
the body's checks, the model and its tokenizer, prompts, running engine requests), `routes/` by family
(`generation.py`: completions, chat completions and cancelling; `embeddings.py`; `tokens.py`: vLLM's tokenizer
routes; `admin.py`: models, version, health, metrics, new weights, LoRA adapters), `admission.py` (the API key,
admission), `formats.py` (OpenAI's response objects and stream chunks), `errors.py` (error codes to statuses, the
error body).

Routes (an unknown path's 404 lists them from the app: `route_list`): POST /v1/completions, POST
/v1/chat/completions (both with `stream: true` as server-sent events), POST /v1/embeddings, GET /v1/models (the
served model and its LoRA adapters, each with `parent`), GET /health, GET /metrics; vLLM's POST /tokenize, POST
/detokenize, GET /version, POST /v1/load_lora_adapter and /v1/unload_lora_adapter; POST /v1/update_weights; POST
/v1/requests/{id}/cancel (cancel.py: by the caller that sent it, or the admin key).

The path of a request:
1. `authorize` (admission.py: 401 without the API key when one is set: one answer for a missing header, another
   scheme or a wrong key), the body (413 past `max_body_bytes`, refused from Content-Length before it is
   read, or as soon as a chunked body passes it), `Front.parse` (400 for malformed or hostile JSON (body.py) or
   an invalid field, naming it), the model name (404 if it is neither the served model nor a LoRA adapter; an
   adapter's name runs the request with it: SamplingParams.lora_name).
2. Admission: 503 with Retry-After and code "overloaded" at once when this front already has
   `max_concurrent_requests` engine requests in flight (400 "too_many_engine_requests" for a request of more
   engine requests than that limit: it could never pass); 503 "unavailable" when the cluster is stopping or
   no worker is healthy (a cluster view at most `view_max_age` old, refreshed by one stats round trip).
3. Prompts are tokenized here, with the tokenizer of the model the request runs on (tokenization.py: 503 when
   this front cannot read it; chat: that tokenizer's chat template), so the length is checked against the
   cluster's context length before anything is sent (400, with both numbers). A text prompt is first
   checked by its size (protocol/prompt_limits.py: one too big to fit is refused untokenized); the body's
   JSON, the template and the tokenizer run on the front's tokenizer threads, never on the event loop.
4. One engine request per (prompt, choice), with the body's `timeout` as its deadline. Non-streaming: all
   run to the end, then one JSON answer.
   Streaming: the first delta of every request is awaited before the 200 goes out, so a request the
   cluster rejects still gets its proper status (400 / 503); then SSE chunks as deltas arrive, a usage
   chunk when asked for, and `data: [DONE]`.
5. A client that disconnects has its requests aborted: a watcher on the ASGI receive channel cancels the
   work (non-streaming and before the first byte), and the server cancels a stream whose client is gone;
   cancelling a stream aborts its request on the worker, which frees its KV blocks.
A stream always ends with `[DONE]`: a failure once the 200 is out (the cluster's, a timeout, an engine
stream that ends without a final delta, an exception here) is an SSE `error` event just before it.

Failed requests' error codes pick the status (`errors.request_error`): invalid_request 400 (404 model_not_found
when the request's LoRA adapter is gone: unloaded elsewhere since this front last listed them), overloaded 503 (+
Retry-After: a queue on the way was full, nothing ran), unavailable, client_too_slow and client_lost 503 (the
last two: this front, the coordinator's client, fell behind or was cut off), timeout 504, anything else 500.
Nothing internal leaves the front: an unexpected exception, or an "internal" failure in the cluster, is
answered 500 with a short id and logged here, with its traceback, under the same id. Unknown routes (404),
wrong methods (405) and every other error also answer in OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from infer.client.api.config import FrontConfig
from infer.client.api.errors import error_response, http_phrase, internal_error
from infer.client.api.front import Front
from infer.client.api.routes.admin import Admin
from infer.client.api.routes.embeddings import Embeddings
from infer.client.api.routes.generation import Generation
from infer.client.api.routes.tokens import Tokens
from infer.client.api.routes.transcriptions import Transcriptions
from infer.client.api.schemas import ApiError
from infer.client.engine_client import EngineClient


def route_list(app: FastAPI) -> list[str]:
    """The app's routes as "METHOD /path", in the order they were added (what a 404 answer lists)."""
    return [
        f"{method} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in sorted(route.methods or ())
    ]


def build_app(
    engine: EngineClient,
    tokenizer: Any,
    config: FrontConfig,
    tokenizers_for: Mapping[str, Any] | None = None,
    tokenizer_dir: Path | None = None,
) -> FastAPI:
    """The ASGI app of one front (Front's arguments). Every error leaves as OpenAI's error body; bad input never gets
    a 500, and no answer carries a traceback, an exception's text or a path."""
    front = Front(engine, tokenizer, config, tokenizers_for, tokenizer_dir)
    generation, embeddings, tokens, admin = Generation(front), Embeddings(front), Tokens(front), Admin(front)
    app = FastAPI(title="infer", version="0.1.0", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.front = front

    def route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return error_response(e)
            except Exception:
                return error_response(internal_error(f"{request.method} {request.url.path}"))

        endpoint.__name__ = handler.__name__
        return endpoint

    app.add_api_route("/v1/completions", route(generation.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", route(generation.chat_completions), methods=["POST"])
    app.add_api_route("/v1/embeddings", route(embeddings.embeddings), methods=["POST"])
    transcriptions = Transcriptions(front)
    app.add_api_route("/v1/audio/transcriptions", route(transcriptions.transcriptions), methods=["POST"])
    app.add_api_route("/v1/audio/translations", route(transcriptions.translations), methods=["POST"])
    app.add_api_route("/v1/models", route(admin.models), methods=["GET"])
    app.add_api_route("/health", route(admin.health), methods=["GET"])
    app.add_api_route("/metrics", route(admin.metrics_text), methods=["GET"])
    app.add_api_route("/tokenize", route(tokens.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", route(tokens.detokenize), methods=["POST"])
    app.add_api_route("/version", route(admin.version), methods=["GET"])
    app.add_api_route("/v1/update_weights", route(admin.update_weights), methods=["POST"])
    app.add_api_route("/v1/load_lora_adapter", route(admin.load_lora_adapter), methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", route(admin.unload_lora_adapter), methods=["POST"])
    app.add_api_route("/v1/requests/{request_id}/cancel", route(generation.cancel), methods=["POST"])

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405, ...
        if exc.status_code == 404:
            error = ApiError(
                404,
                f"no route {request.url.path[:200]!r}; the routes are {', '.join(route_list(request.app))}",
                code="not_found",
            )
        elif exc.status_code == 405:
            error = ApiError(
                405,
                f"method {request.method} is not allowed on {request.url.path[:200]!r}",
                code="method_not_allowed",
                headers=exc.headers,
            )
        else:
            error = ApiError(exc.status_code, http_phrase(exc.status_code), headers=exc.headers)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, "invalid request"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return error_response(internal_error(f"{request.method} {request.url.path}"))

    return app
