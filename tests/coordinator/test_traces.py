"""The coordinator's hop of a traced request (protocol/tracing.py), driven frame by frame: with
--otlp-traces-endpoint its span is the child of the Submit's traceparent and the parent of the Dispatch's, from
Submit to the final delta; without it the caller's traceparent goes on to the worker unchanged."""

from __future__ import annotations

from core_harness import Harness, delta

from infer.protocol.messages import Dispatch, RequestSpec, Submit, TokenIds
from infer.protocol.sampling import SamplingParams
from infer.protocol.tracing import SpanSink, parse_traceparent

TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CALLER = f"00-{TRACE}-{CALLER_SPAN}-01"
CLIENT = b"client-1"


def _submit(h: Harness, rid: str, traceparent: str | None) -> Dispatch:
    out = h.send(
        CLIENT,
        Submit(
            request_id=rid,
            spec=RequestSpec(
                prompt_token_ids=TokenIds([1, 2, 3]), sampling=SamplingParams(temperature=0.0, max_tokens=2)
            ),
            traceparent=traceparent,
        ),
    )
    [dispatch] = [m for _, m in out if isinstance(m, Dispatch)]
    return dispatch


def test_a_traced_request_is_one_span_between_its_caller_and_its_worker():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    h = Harness(otlp_traces_endpoint="http://127.0.0.1:4317")
    h.worker("w0", 0)
    h.now = 10.0
    dispatch = _submit(h, "r1", CALLER)
    trace_id, parent = parse_traceparent(dispatch.traceparent)
    assert trace_id == TRACE and parent != CALLER_SPAN
    h.now = 10.5
    h.step("w0", delta("r1", 7))
    assert h.core.take_spans(h.now) == []  # still running
    h.now = 11.0
    h.step("w0", delta("r1", 8, finish="length"))
    exporter = InMemorySpanExporter()
    sink = SpanSink("infer-coordinator", exporter=exporter, batch=False, wall_offset=0.0)
    sink.export(h.core.take_spans(h.now))
    sink.close()
    [span] = exporter.get_finished_spans()
    assert (span.name, span.context.trace_id, span.context.span_id) == ("coordinator", int(TRACE, 16), int(parent, 16))
    assert span.parent.span_id == int(CALLER_SPAN, 16)
    assert (span.start_time, span.end_time) == (10_000_000_000, 11_000_000_000)
    assert [(e.name, e.timestamp) for e in span.events] == [("dispatch", 10_000_000_000)]
    assert dict(span.attributes) == {
        "gen_ai.request.id": "r1",
        "infer.worker_id": "w0",
        "gen_ai.response.finish_reasons": "length",
        "gen_ai.usage.completion_tokens": 2,
        "infer.redispatches": 0,
    }


def test_a_request_failed_over_shows_each_dispatch_and_ends_once():
    h = Harness(otlp_traces_endpoint="http://127.0.0.1:4317", client_timeout=5.0)
    h.worker("w0", 0)
    first = _submit(h, "r1", None)  # no caller: the coordinator starts the trace
    h.step("w0", delta("r1", 7, prompt=[1, 2, 3]))
    h.now = 0.9
    h.worker("w1", 1)
    out = h.advance(0.6)  # w0 silent past worker_timeout: r1 goes to w1 with its token
    [again] = [m for _, m in out if isinstance(m, Dispatch)]
    assert again.traceparent == first.traceparent  # the same hop, dispatched twice
    h.step("w1", delta("r1", 8, finish="length"))
    [span] = h.core.take_spans(h.now)
    assert span.parent_span_id is None and span.traceparent == first.traceparent
    assert [name for name, _ in span.events] == ["dispatch", "dispatch"]
    assert span.attributes["infer.worker_id"] == "w1" and span.attributes["infer.redispatches"] == 1
    assert span.attributes["gen_ai.usage.completion_tokens"] == 2
    assert h.core.take_spans(h.now) == []


def test_without_tracing_the_callers_traceparent_goes_on_to_the_worker_and_nothing_is_recorded():
    h = Harness()
    h.worker("w0", 0)
    assert _submit(h, "r1", CALLER).traceparent == CALLER
    assert _submit(h, "r2", None).traceparent is None
    h.step("w0", delta("r1", 7, finish="length"), delta("r2", 7, finish="length"))
    assert h.core.take_spans(h.now) == []
