"""OpenTelemetry traces through a real cluster: `infer-serve --otlp-traces-endpoint URL` (its HTTP front,
coordinator and workers, each a process of its own, each exporting with the SDK's OTLP exporter) and a collector
here that receives what they export (OTLP over gRPC, the default, and over HTTP). One request with a W3C
`traceparent` header comes back as three spans of the caller's trace, each the child of the hop before it."""

from __future__ import annotations

import gzip
import json
import threading
import time
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from serve_harness import Served

pytest.importorskip("opentelemetry.sdk", reason="the otel extra (pip install 'infer[otel]') is not installed")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.slow

TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Collector:
    """An OTLP trace receiver on a free loopback port: `protocol` "grpc" or "http/protobuf"; `spans` as dicts."""

    def __init__(self, protocol: str) -> None:
        self.spans: list[dict[str, Any]] = []
        self.received = threading.Condition()
        if protocol == "grpc":
            import grpc

            self._grpc = grpc.server(futures.ThreadPoolExecutor(2))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._grpc)
            port = self._grpc.add_insecure_port("127.0.0.1:0")
            self._grpc.start()
            self.endpoint = f"http://127.0.0.1:{port}"
        else:
            self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
            threading.Thread(target=self._http.serve_forever, daemon=True).start()
            self.endpoint = f"http://127.0.0.1:{self._http.server_address[1]}/v1/traces"

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.received:
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
                for scope in resource_spans.scope_spans:
                    self.spans.extend(_span(service, span) for span in scope.spans)
            self.received.notify_all()

    def wait_for(self, count: int, trace_id: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self.received:
            while len(found := [s for s in self.spans if s["trace_id"] == trace_id]) < count:
                if not self.received.wait(deadline - time.monotonic()):
                    raise AssertionError(f"{len(found)} of {count} spans of trace {trace_id} arrived: {self.spans}")
            return found

    def close(self) -> None:
        if hasattr(self, "_grpc"):
            self._grpc.stop(0)
        else:
            self._http.shutdown()


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def Export(self, request, context):  # noqa: N802 (the service's method name)
        self.collector.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def _handler(collector: Collector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            collector.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def _span(service: str, span: Any) -> dict[str, Any]:
    def value(v: Any) -> Any:
        return getattr(v, v.WhichOneof("value"))

    return {
        "service": service,
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex() or None,
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
        "events": [e.name for e in span.events],
        "attributes": {a.key: value(a.value) for a in span.attributes},
    }


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_request_is_one_trace_of_front_coordinator_and_worker_under_the_callers_span(
    protocol, tiny_model_dir, tmp_path, monkeypatch
):
    collector = Collector(protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)  # the children inherit it
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms between the SDK's batch exports
    served = Served(
        tiny_model_dir("llama"),
        tmp_path / "serve.log",
        "tiny",
        ["--dtype", "float32", "--threads", "1", "--otlp-traces-endpoint", collector.endpoint],
    )
    try:
        body = json.dumps(
            {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        ).encode()
        request = urllib.request.Request(
            f"{served.url}/v1/completions",
            body,
            {"Content-Type": "application/json", "traceparent": f"00-{TRACE}-{CALLER_SPAN}-01"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            usage = json.load(response)["usage"]
        spans = {s["service"]: s for s in collector.wait_for(3, TRACE)}
    finally:
        served.stop()
        collector.close()
    assert sorted(spans) == ["infer-coordinator", "infer-front", "infer-worker"]
    front, coordinator, worker = spans["infer-front"], spans["infer-coordinator"], spans["infer-worker"]
    assert (front["name"], coordinator["name"], worker["name"]) == ("front", "coordinator", "worker")
    assert front["parent"] == CALLER_SPAN
    assert coordinator["parent"] == front["span_id"]
    assert worker["parent"] == coordinator["span_id"]
    request_id = front["attributes"]["gen_ai.request.id"]
    assert coordinator["attributes"]["gen_ai.request.id"] == worker["attributes"]["gen_ai.request.id"] == request_id
    for span in (front, coordinator, worker):
        assert span["attributes"]["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 3
        assert span["attributes"]["gen_ai.response.finish_reasons"] == "length"
    assert worker["attributes"]["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert (
        worker["events"] == ["scheduled", "first token"] and worker["attributes"]["gen_ai.latency.time_in_queue"] >= 0
    )
    assert coordinator["events"] == ["dispatch"] and front["events"] == ["first token"]
    slack = 50_000_000  # ns: each process turns its monotonic clock into wall time on its own
    assert front["start"] <= coordinator["start"] + slack and coordinator["start"] <= worker["start"] + slack
    # the coordinator hears the end from the worker's progress report while the front reads the last delta
    # straight from the worker (direct streams): both end after the worker, in either order between them
    assert worker["end"] <= coordinator["end"] + slack and worker["end"] <= front["end"] + slack
