"""Peer text made safe for a log line, and warnings a peer can trigger made rate-limited.

Anything a peer sends (ids, error texts, reasons, model names) goes through `safe` before it is logged: it
is escaped repr-style (a newline cannot forge a second log line, a control character cannot rewrite the
terminal) and cut to a bounded length (a 1 MiB error text costs the log a few hundred bytes).
"""

from __future__ import annotations

import logging
import time

MAX_LOGGED_CHARS = 200


def safe(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """`value` for a log line: printable, one line, at most `limit` characters plus a "... (N more)"
    marker. Strings lose their quotes (repr's escapes stay); bytes show as hex; None as "None"."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value).hex()
    elif isinstance(value, str):
        text = value if value.isprintable() else repr(value)[1:-1]
    else:
        text = str(value)
        if not text.isprintable():
            text = repr(text)[1:-1]
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more)"


class Throttle:
    """Lets `burst` events through per `period` seconds and counts the rest, so a peer's flood cannot fill
    the log. Thread-safe enough for counting: a lost increment under a race costs one count."""

    def __init__(self, burst: int = 5, period: float = 10.0) -> None:
        self.burst, self.period = burst, period
        self._window_start, self._count = -period, 0
        self.suppressed = 0  # held back since the last event let through

    def allow(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if now - self._window_start >= self.period:
            self._window_start, self._count = now, 0
        self._count += 1
        if self._count > self.burst:
            self.suppressed += 1
            return False
        return True

    def take_suppressed(self) -> int:
        n, self.suppressed = self.suppressed, 0
        return n


class RateLimitedLog:
    """`warning(...)` logs at most `burst` lines per `period` seconds on `logger`; the first line let
    through after a quiet spell says how many were held back."""

    def __init__(self, logger: logging.Logger, burst: int = 5, period: float = 10.0) -> None:
        self.log = logger
        self.throttle = Throttle(burst, period)

    def warning(self, text: str, *args: object) -> None:
        if self._allow():
            self.log.warning(text, *args)

    def exception(self, text: str, *args: object) -> None:
        """An error with the traceback of the exception being handled (a bug a peer's input found), as limited."""
        if self._allow():
            self.log.exception(text, *args)

    def _allow(self) -> bool:
        if not self.throttle.allow():
            return False
        held = self.throttle.take_suppressed()
        if held:
            self.log.warning("(%d similar warning(s) were not logged)", held)
        return True
