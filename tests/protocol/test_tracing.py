"""protocol/tracing.py: W3C traceparent parsing, hops as data, their export through the OpenTelemetry SDK (its
InMemorySpanExporter), the wire field's check, and a process without the SDK: everything imports, and asking for
traces is a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from infer.protocol.messages import Dispatch, ProtocolError, RequestSpec, Submit, TokenIds, decode, encode
from infer.protocol.sampling import SamplingParams
from infer.protocol.tracing import MISSING_SDK, HopSpan, SpanSink, check_traceparent, parse_traceparent

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CALLER = f"00-{TRACE}-{SPAN}-01"


@pytest.mark.parametrize(
    "header",
    [
        f"00-{TRACE}-{SPAN}",  # no flags
        f"01-{TRACE}-{SPAN}-01",  # another version
        f"00-{TRACE.upper()}-{SPAN}-01",  # upper-case hex
        f"00-{'0' * 32}-{SPAN}-01",  # the all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # the all-zero span id
        f"00-{TRACE[:-1]}-{SPAN}-01",  # a short id
        f" {CALLER}",
        f"{CALLER}\n",
        "",
    ],
)
def test_invalid_traceparents_are_recognised(header):
    assert parse_traceparent(header) is None
    with pytest.raises(ValueError, match="traceparent"):
        check_traceparent(header)


def test_a_hop_is_the_child_of_its_traceparent_and_passes_on_its_own():
    assert parse_traceparent(CALLER) == (TRACE, SPAN)
    hop = HopSpan.child_of("front", CALLER, 5.0, **{"gen_ai.request.id": "r1"})
    assert (hop.trace_id, hop.parent_span_id) == (TRACE, SPAN)
    assert hop.span_id != SPAN and len(hop.span_id) == 16
    assert parse_traceparent(hop.traceparent) == (TRACE, hop.span_id)
    next_hop = HopSpan.child_of("coordinator", hop.traceparent, 5.1)
    assert (next_hop.trace_id, next_hop.parent_span_id) == (TRACE, hop.span_id)


@pytest.mark.parametrize("given", [None, "junk", f"00-{'0' * 32}-{SPAN}-01"])
def test_without_a_valid_traceparent_a_hop_starts_a_trace(given):
    one, two = HopSpan.child_of("front", given, 0.0), HopSpan.child_of("front", given, 0.0)
    assert one.parent_span_id is None and parse_traceparent(one.traceparent) is not None
    assert one.trace_id != two.trace_id


def test_the_sink_exports_hops_through_the_sdk_with_their_ids_times_and_events():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    sink = SpanSink("infer-test", exporter=exporter, batch=False, wall_offset=1000.0)
    hop = HopSpan.child_of("worker", CALLER, 2.0, **{"gen_ai.usage.prompt_tokens": 3})
    hop.event("first token", 2.25)
    sink.export([hop.finish(3.5, **{"gen_ai.usage.completion_tokens": 4})])
    sink.close()
    [span] = exporter.get_finished_spans()
    assert span.name == "worker"
    assert (span.context.trace_id, span.context.span_id) == (int(TRACE, 16), int(hop.span_id, 16))
    assert span.parent is not None and span.parent.span_id == int(SPAN, 16) and span.parent.is_remote
    assert (span.start_time, span.end_time) == (1_002_000_000_000, 1_003_500_000_000)
    assert [(e.name, e.timestamp) for e in span.events] == [("first token", 1_002_250_000_000)]
    assert dict(span.attributes) == {"gen_ai.usage.prompt_tokens": 3, "gen_ai.usage.completion_tokens": 4}
    assert span.resource.attributes["service.name"] == "infer-test"


@pytest.mark.parametrize("kind", [Submit, Dispatch])
def test_the_wire_carries_a_valid_traceparent_and_refuses_another(kind):
    spec = RequestSpec(prompt_token_ids=TokenIds([1, 2]), sampling=SamplingParams(max_tokens=2))
    fields = dict(request_id="r1", spec=spec)
    assert decode(encode(kind(**fields))).traceparent is None
    assert decode(encode(kind(**fields, traceparent=CALLER))).traceparent == CALLER
    with pytest.raises(ProtocolError, match="field 'traceparent' must be a W3C traceparent"):
        encode(kind(**fields, traceparent="00-nothex-01"))


WITHOUT_SDK = """
import sys
for name in ("opentelemetry.sdk", "opentelemetry.exporter"):   # as if the extra were not installed (the API
    sys.modules[name] = None                                    # alone comes with fastapi): their imports fail
import infer, infer.client.api.app, infer.client.serve, infer.coordinator.daemon, infer.worker.service.daemon
from infer.coordinator.daemon import main
sys.exit(main(["--port", "0", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]))
"""


def test_without_the_sdk_everything_imports_and_asking_for_traces_says_what_to_install():
    done = subprocess.run([sys.executable, "-c", WITHOUT_SDK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"infer-coordinator: {MISSING_SDK}" in done.stderr
