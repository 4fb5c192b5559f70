"""The HTTP front's errors: failed requests' error codes to statuses (invalid_request 400, overloaded /
unavailable 503 with Retry-After, ...), validation errors in OpenAI's shape, the /health answer when unhealthy,
and the JSON body every error response has."""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from infer.client.api.schemas import ApiError
from infer.protocol.codes import ErrorCode
from infer.protocol.logsafe import safe
from infer.protocol.messages import ClusterStats
from infer.protocol.outputs import RequestOutput

if TYPE_CHECKING:
    from infer.client.api.jobs import Job

log = logging.getLogger("infer.api")


_RETRY_LATER = (ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE, ErrorCode.CLIENT_TOO_SLOW, ErrorCode.CLIENT_LOST)


def request_error(delta: RequestOutput, retry_after: int = 1) -> ApiError:
    """The answer to a request the cluster failed, by its error code. An internal failure's text stays in
    this front's log (it may quote exceptions); the client gets its id."""
    message = delta.error or "the request failed"
    code = delta.error_code
    if code == ErrorCode.INVALID_REQUEST:
        return ApiError(400, message)
    if code == ErrorCode.MODEL_NOT_FOUND:  # gone from the cluster after the front's check (its last worker left)
        return ApiError(404, message, param="model", code="model_not_found")
    if code in _RETRY_LATER:
        return ApiError(503, message, code=code, retry_after=retry_after)
    if code == ErrorCode.TIMEOUT:
        return ApiError(504, message, code="timeout")
    return internal_error(f"engine request {delta.request_id}", detail=f"{code}: {message}")


def ended_early(job: Job) -> ApiError:
    return internal_error(f"engine request {job.request_id}", detail="its stream ended without a final delta")


def internal_error(where: str, detail: str | None = None) -> ApiError:
    """A 500 that reveals nothing but a short id; the log gets the id with `detail`, or the exception being
    handled and its traceback."""
    error_id = uuid.uuid4().hex[:12]
    if detail is None:
        log.exception("internal error %s in %s", error_id, where)
    else:
        log.error("internal error %s in %s: %s", error_id, safe(where), safe(detail, 2000))  # the cluster's text
    return ApiError(
        500,
        f"internal server error (id {error_id}); the server log has the details under this id",
        code="internal_error",
    )


def too_large(size: str, limit: int) -> ApiError:
    return ApiError(
        413, f"the request body is {size}; the limit is {limit} bytes (--max-body-bytes)", code="request_too_large"
    )


def validation_error(e: ValidationError) -> ApiError:
    """A 400 naming the field of the most specific problem: of the errors a union's members give (a token id list
    tried as a string, as ids, as strings...), the one deepest in the body (`[-5]`: item 0 is below 0, not "the
    prompt is no string"); the first among equals."""
    errors = e.errors()
    first = max(errors, key=lambda err: sum(not _is_union_tag(part) for part in err["loc"]))
    param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part)) or None
    given = first.get("input")
    detail = first["msg"]
    if first["type"] not in ("missing", "extra_forbidden"):
        detail += f" (got {json.dumps(given, default=str)[:80]})"
    if first["type"] == "extra_forbidden":
        detail = "unknown field"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return ApiError(400, f"{param}: {detail}{more}" if param else f"{detail}{more}", param=param)


def _is_union_tag(part: Any) -> bool:
    """pydantic names union members in `loc` (e.g. 'list[str]', 'function-after[...]'); not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def unhealthy(why: str, retry_after: int, view: ClusterStats | None = None) -> JSONResponse:
    body: dict[str, Any] = {"status": "unavailable", "reason": why}
    if view is not None:
        body.update(state=view.state, healthy_workers=view.num_healthy_workers, workers=len(view.workers))
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(retry_after)})


def error_response(error: ApiError) -> JSONResponse:
    headers = dict(error.headers)
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


def http_phrase(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"
