"""Cancelling a request by its id over HTTP: `POST /v1/requests/{id}/cancel` (the shape of OpenAI's cancel routes,
`/v1/responses/{id}/cancel` and `/v1/batches/{id}/cancel`; one route for both endpoints, since the id is the
response's `id` of either).

The id: the response's `id` (random, 128 bits), sent in the `X-Request-Id` response header (a stream's headers go
out with its first chunk) and in every chunk; or the caller's own, given in the `X-Request-Id` request header
(vLLM's header), which the response then carries instead (so a non-streamed request can be cancelled before its
answer). Engine request ids stay the front's own either way: two callers choosing the same id never meet.

Who may cancel (`Cancellations.find`): the caller that sent the request, recognised by the bearer token it sent
(compared as SHA-256 digests in constant time), or the holder of the front's admin key (`--admin-api-key-file`).
A request sent without a bearer token can be cancelled by the admin only (and by its own disconnect), so an
anonymous caller never cancels anyone's request, even knowing its id. With the front's `--api-key` every caller
sends that key: they are one principal, and may cancel each other's requests. An id that is not in flight and an
id the caller may not cancel get the same 404, so ids cannot be probed.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from fastapi import Request

MAX_REQUEST_ID_CHARS = 128


def bearer_digest(request: Request) -> bytes | None:
    """SHA-256 of the request's bearer token; None without one."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return hashlib.sha256(token.encode()).digest()


def caller_request_id(request: Request) -> str | None:
    """The caller's `X-Request-Id` (printable ASCII, at most MAX_REQUEST_ID_CHARS); ValueError otherwise."""
    value = request.headers.get("x-request-id")
    if value is None:
        return None
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not (value.isascii() and value.isprintable()) or "/" in value:
        raise ValueError(
            f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters without "
            f"'/', got {value[:40]!r}"
        )
    return value


@dataclass
class Cancellable:
    """One HTTP request in flight: the bearer digest it came with, its engine requests."""

    owner: bytes | None
    engine_request_ids: list[str] = field(default_factory=list)


class Cancellations:
    """The front's HTTP requests in flight by id (several may share a caller-chosen id)."""

    def __init__(self, admin_key: str | None) -> None:
        self._admin = None if admin_key is None else hashlib.sha256(admin_key.encode()).digest()
        self._by_id: dict[str, list[Cancellable]] = {}

    def add(self, request_id: str, entry: Cancellable) -> None:
        self._by_id.setdefault(request_id, []).append(entry)

    def remove(self, request_id: str, entry: Cancellable) -> None:
        entries = self._by_id.get(request_id, [])
        if entry in entries:
            entries.remove(entry)
        if not entries:
            self._by_id.pop(request_id, None)

    def is_admin(self, caller: bytes | None) -> bool:
        return caller is not None and self._admin is not None and hmac.compare_digest(caller, self._admin)

    def find(self, request_id: str, caller: bytes | None) -> list[Cancellable]:
        """The requests under `request_id` that `caller` (a bearer digest) may cancel: all for the admin, its own
        for a caller with a token, none for a caller without one."""
        entries = self._by_id.get(request_id, [])
        if self.is_admin(caller):
            return list(entries)
        if caller is None:
            return []
        return [e for e in entries if e.owner is not None and hmac.compare_digest(e.owner, caller)]
