"""The worker's hop of a traced request (worker/service/core.py's WorkerTrace), driven frame by frame on the benchmark
engine: the child of the Dispatch's traceparent, from the Dispatch to the final delta, with queue, prefill and
decode times and the token counts under vLLM's attribute names; nothing recorded without --otlp-traces-endpoint."""

from __future__ import annotations

from worker_harness import WorkerHarness, dispatch

from infer.protocol.messages import Abort
from infer.protocol.tracing import parse_traceparent

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_a_traced_request_is_one_span_from_dispatch_to_its_last_token():
    h = WorkerHarness(otlp_traces_endpoint="http://127.0.0.1:4317")
    h.welcome()
    h.now = 100.0
    h.send(dispatch("r1", prompt=[1, 2, 3], max_tokens=3, traceparent=f"00-{TRACE}-{PARENT}-01"))
    h.send(dispatch("r2", prompt=[4, 5], max_tokens=1))  # untraced by its caller: a trace of its own
    times = []
    while h.engine.has_unfinished():
        h.now += 0.25
        times.append(h.now)
        h.step()
    spans = {span.attributes["gen_ai.request.id"]: span for span in h.core.take_spans()}
    assert h.core.take_spans() == []
    span = spans["r1"]
    assert (span.name, span.trace_id, span.parent_span_id) == ("worker", TRACE, PARENT)
    assert parse_traceparent(span.traceparent) == (TRACE, span.span_id)
    assert (span.start, span.end) == (100.0, times[2])  # one token a step: the third step ends it
    assert [name for name, _ in span.events] == ["first token"]  # the benchmark engine reports no queue time
    assert span.events[0][1] == times[0]
    assert span.attributes == {
        "gen_ai.request.id": "r1",
        "gen_ai.usage.prompt_tokens": 3,
        "gen_ai.request.max_tokens": 3,
        "infer.resumed_tokens": 0,
        "gen_ai.response.finish_reasons": "length",
        "gen_ai.usage.completion_tokens": 3,
        "gen_ai.latency.time_to_first_token": times[0] - 100.0,
        "gen_ai.latency.e2e": times[2] - 100.0,
        "gen_ai.latency.time_in_model_prefill": times[0] - 100.0,
        "gen_ai.latency.time_in_model_decode": times[2] - times[0],
    }
    other = spans["r2"]
    assert other.parent_span_id is None and other.trace_id != TRACE
    assert other.attributes["gen_ai.usage.completion_tokens"] == 1


def test_a_resumed_request_counts_only_the_tokens_made_here():
    h = WorkerHarness(otlp_traces_endpoint="http://127.0.0.1:4317")
    h.welcome()
    h.send(dispatch("r1", prompt=[1, 2, 3], max_tokens=4, resumed=[4, 5], traceparent=f"00-{TRACE}-{PARENT}-01"))
    h.run_until_finished()
    [span] = h.core.take_spans()
    assert span.attributes["infer.resumed_tokens"] == 2 and span.attributes["gen_ai.usage.completion_tokens"] == 2


def test_a_request_the_coordinator_aborts_ends_its_span_there():
    h = WorkerHarness(otlp_traces_endpoint="http://127.0.0.1:4317")
    h.welcome()
    h.send(dispatch("r1", prompt=[1, 2, 3], max_tokens=8, traceparent=f"00-{TRACE}-{PARENT}-01"))
    h.now = 1.0
    h.step()
    h.now = 2.0
    h.send(Abort(request_ids=["r1"]))
    [span] = h.core.take_spans()
    assert span.end == 2.0 and span.attributes["gen_ai.response.finish_reasons"] == "abort (by the coordinator)"
    assert span.attributes["gen_ai.usage.completion_tokens"] == 1
    assert span.attributes["gen_ai.latency.time_in_model_decode"] == 1.0
    assert h.run_until_finished() == [] and h.core.take_spans() == []  # its final delta is silenced


def test_without_tracing_nothing_is_recorded():
    h = WorkerHarness()
    h.welcome()
    h.send(dispatch("r1", traceparent=f"00-{TRACE}-{PARENT}-01"))
    assert len(h.run_until_finished()) >= 1
    assert h.core.take_spans() == []
