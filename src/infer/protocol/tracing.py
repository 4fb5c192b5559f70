"""OpenTelemetry traces of a request's hops (front -> coordinator -> worker), as data first.

Each process that traces a request records its hop as a `HopSpan`: plain data, made and ended where the
process's I/O-free core decides (time passed in, as everywhere), the child of the W3C `traceparent` it was
given (the HTTP header at the front; `Submit.traceparent` at the coordinator; `Dispatch.traceparent` at the
worker). The hop's own traceparent (same trace id, its span id) is what it passes on. The shell of the process
hands ended hops to a `SpanSink`, which exports them with the OpenTelemetry SDK (OTLP to
`--otlp-traces-endpoint`, vLLM's flag; `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` picks `grpc`, the default, or
`http/protobuf`, as in vLLM; the SDK's own `OTEL_BSP_*` variables tune its batching).

The SDK is an optional extra (`pip install infer[otel]`): this module imports it only in `SpanSink`, so without
it everything else works; asking for traces without it is a clear error at start-up (ValueError). Tracing is off
unless the flag is given; a process that does not trace records nothing and passes the traceparent it was given
on unchanged (so the hops that do trace still join the caller's trace).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# W3C Trace Context, version 00: 00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_SAMPLED = "01"
MISSING_SDK = (
    "--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter, which are not installed: "
    "pip install 'infer[otel]'"
)

Attribute = str | int | float | bool


def require_sdk() -> None:
    """ValueError (MISSING_SDK) unless the extra is installed; looks, imports nothing (options call it)."""
    import importlib.util

    try:
        found = all(
            importlib.util.find_spec(name) is not None for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp")
        )
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ValueError(MISSING_SDK)


def parse_traceparent(value: str) -> tuple[str, str] | None:
    """(trace id, span id) of a W3C traceparent header, or None when it is not a valid version-00 one (the
    all-zero ids are invalid too). The spec says an invalid header is ignored (a new trace starts), not refused."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None or match.group(1) == "0" * 32 or match.group(2) == "0" * 16:
        return None
    return match.group(1), match.group(2)


def check_traceparent(value: str | None) -> None:
    """ValueError unless `value` is None or a valid W3C traceparent (the wire's check: our own processes only
    send valid ones)."""
    if value is not None and parse_traceparent(value) is None:
        raise ValueError(
            f"field 'traceparent' must be a W3C traceparent '00-<32 hex>-<16 hex>-<2 hex>' with "
            f"non-zero ids, got {value[:80]!r}"
        )


@dataclass
class HopSpan:
    """One hop of a traced request: its ids, its wall-clock start and end (seconds since the epoch), the
    attributes it reports and its events ((name, wall time)). `parent_span_id` None: the hop started the trace."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    start: float
    end: float | None = None
    attributes: dict[str, Attribute] = field(default_factory=dict)
    events: list[tuple[str, float]] = field(default_factory=list)

    @classmethod
    def child_of(cls, name: str, traceparent: str | None, start: float, **attributes: Attribute) -> HopSpan:
        """A hop under the span `traceparent` names; a new trace when it is None or invalid."""
        ids = parse_traceparent(traceparent) if traceparent is not None else None
        trace_id, parent = ids if ids is not None else (secrets.token_hex(16), None)
        return cls(name, trace_id, secrets.token_hex(8), parent, start, attributes=dict(attributes))

    @property
    def traceparent(self) -> str:
        """This hop as the parent of the next one."""
        return f"00-{self.trace_id}-{self.span_id}-{_SAMPLED}"

    def event(self, name: str, at: float) -> None:
        self.events.append((name, at))

    def finish(self, at: float | None, **attributes: Attribute) -> HopSpan:
        """Ended at `at` (None: the caller stamps it later) with these attributes added."""
        self.end = at
        self.attributes.update(attributes)
        return self


class SpanSink:
    """Exports ended hops of one process (`service`: infer-front, infer-coordinator, infer-worker) through the
    OpenTelemetry SDK's batch processor, off the caller's thread. `exporter`: any SDK SpanExporter (the tests'
    InMemorySpanExporter); by default OTLP to `endpoint`. ValueError (MISSING_SDK) without the SDK.

    Hops are timed on the process's monotonic clock (its cores' `now`); `wall_offset` turns that into the epoch
    time spans carry (default: this process's time.time() - time.monotonic())."""

    def __init__(
        self,
        service: str,
        endpoint: str | None = None,
        exporter: Any = None,
        batch: bool = True,
        wall_offset: float | None = None,
    ) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            raise ValueError(MISSING_SDK) from None
        if exporter is None:
            if endpoint is None:
                raise ValueError("a SpanSink needs an endpoint or an exporter")
            exporter = otlp_exporter(endpoint)
        self.resource = Resource.create({"service.name": service})
        self.wall_offset = time.time() - time.monotonic() if wall_offset is None else wall_offset
        self.processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)

    def export(self, spans: Iterable[HopSpan]) -> None:
        for span in spans:
            self.processor.on_end(self._readable(span))

    def close(self) -> None:
        """Export what is queued, then stop (bounded by the SDK's export timeout)."""
        self.processor.shutdown()

    def _readable(self, span: HopSpan) -> Any:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        def context(span_id: str, remote: bool) -> SpanContext:
            return SpanContext(
                int(span.trace_id, 16), int(span_id, 16), is_remote=remote, trace_flags=TraceFlags(TraceFlags.SAMPLED)
            )

        parent = context(span.parent_span_id, True) if span.parent_span_id is not None else None

        def ns(at: float) -> int:
            return int((at + self.wall_offset) * 1e9)

        end = span.end if span.end is not None else span.start
        return ReadableSpan(
            span.name,
            context(span.span_id, False),
            parent=parent,
            resource=self.resource,
            attributes=span.attributes,
            kind=SpanKind.SERVER,
            events=[Event(name, timestamp=ns(at)) for name, at in span.events],
            start_time=ns(span.start),
            end_time=ns(end),
        )


def otlp_exporter(endpoint: str) -> Any:
    """vLLM's choice of OTLP exporter: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL `grpc` (default) or `http/protobuf`."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        else:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be 'grpc' or 'http/protobuf', got {protocol!r}")
    except ImportError:
        raise ValueError(MISSING_SDK) from None
    return OTLPSpanExporter(endpoint=endpoint)


def open_sink(service: str, endpoint: str | None) -> SpanSink | None:
    """The process's sink when `endpoint` is given (tracing on), else None."""
    return None if endpoint is None else SpanSink(service, endpoint)
