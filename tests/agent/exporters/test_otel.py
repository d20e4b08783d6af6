"""The OpenTelemetry exporter: spans captured with the SDK's in-memory exporter, and a real
OTLP/HTTP export to a local receiver."""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from agent.exporters.ids import span_id_for, trace_id_for
from agent.exporters.otel import OtelExporter
from agent.schema import ACCOUNTING_COLUMNS, STATE_CODE
from agent.telemetry import RequestAccounting
from tests.agent.exporters.common import (
    MODEL,
    MS,
    RUN_ID,
    WALL,
    make_recorder,
    record_workload,
    split_batch,
)

_OTEL_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED")


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _OTEL_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    return provider, mem


def traces(spans: tuple[ReadableSpan, ...]) -> dict[str, tuple[ReadableSpan, list[ReadableSpan]]]:
    """request_id -> (root, children in start order)."""
    roots = {s.context.span_id: s for s in spans if s.name == "kvscope.request"}
    out: dict[str, tuple[ReadableSpan, list[ReadableSpan]]] = {
        r.attributes["kvscope.request_id"]: (r, []) for r in roots.values()}
    for s in spans:
        if s.name != "kvscope.request":
            root = roots[s.parent.span_id]
            out[root.attributes["kvscope.request_id"]][1].append(s)
    for _, children in out.values():
        children.sort(key=lambda c: c.start_time)
    return out


def test_request_traces_have_exact_links_times_and_attributes(memory: Any) -> None:
    provider, mem = memory
    rec = make_recorder()
    exp = record_workload(rec)
    otel = OtelExporter(model=MODEL, tracer_provider=provider, run_id=RUN_ID)
    otel.export(rec.drain())
    got = traces(mem.get_finished_spans())
    assert set(got) == set(exp.states)
    for rid, (root, children) in got.items():
        assert root.parent is None and root.kind == SpanKind.SERVER
        assert root.context.trace_id == trace_id_for(rid, RUN_ID)
        assert root.context.span_id == span_id_for(rid, RUN_ID)
        assert (root.start_time, root.end_time) == (exp.arrival_ns[rid], exp.finish_ns[rid])
        assert [(c.name, c.start_time, c.end_time) for c in children] == [
            (f"kvscope.{s}", a, b) for s, a, b in exp.states[rid]]
        for c in children:
            assert c.context.trace_id == root.context.trace_id
            assert c.parent.span_id == root.context.span_id and not c.parent.is_remote
        attrs = root.attributes
        acc = exp.accounting[rid]
        for col in ACCOUNTING_COLUMNS:
            assert attrs[f"kvscope.{col}"] == getattr(acc, col), col
        assert attrs["kvscope.request_id"] == rid and attrs["kvscope.run_id"] == RUN_ID
        assert attrs["kvscope.status"] == exp.status[rid]
        assert attrs["kvscope.spans_complete"] is True
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["gen_ai.usage.input_tokens"] == acc.prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == acc.output_tokens
        assert attrs["gen_ai.usage.cache_read.input_tokens"] == (
            acc.device_hit_tokens + acc.host_loaded_tokens + acc.remote_loaded_tokens)
        assert attrs["kvscope.e2e_ns"] == exp.e2e_ns[rid]
        assert attrs.get("kvscope.ttft_ns") == exp.ttft_ns.get(rid)
    a = got["req-a"][0].attributes
    assert a["gen_ai.usage.cache_read.input_tokens"] == 896
    assert a["kvscope.tenant"] == "t1"
    assert (a["kvscope.stage.remote_read_ns"], a["kvscope.stage.decode_ns"]) == (30 * MS, 100 * MS)
    assert got["req-b"][0].attributes["kvscope.stage.queue_ns"] == 10 * MS  # two visits
    remote = next(c for c in got["req-a"][1] if c.name == "kvscope.remote_read")
    assert list(remote.attributes["kvscope.waits_on"]) == exp.waits_on[("req-a", "remote_read")]
    assert got["req-c"][0].status.status_code == StatusCode.ERROR
    assert "kvscope.ttft_ns" not in got["req-c"][0].attributes
    assert got["req-a"][0].status.status_code == StatusCode.UNSET
    assert otel.exported_requests == 4


def test_spans_drained_before_their_request_row_are_still_exported(memory: Any) -> None:
    provider, mem = memory
    rec = make_recorder()
    otel = OtelExporter(model=MODEL, tracer_provider=provider, run_id=RUN_ID)
    rn = rec.request_begin("early", 5 * MS)
    rec.stage(rn, STATE_CODE["queue"], 6 * MS)
    rec.stage(rn, STATE_CODE["prefill"], 9 * MS)
    otel.export(rec.drain())  # lookup and queue spans, no request row yet
    assert mem.get_finished_spans() == ()
    rec.first_token(rn, 20 * MS)
    otel.export(rec.drain())  # the prefill span; the request is still decoding
    assert mem.get_finished_spans() == ()
    rec.request_end(rn, RequestAccounting(prompt_tokens=4, output_tokens=2,
                                          recomputed_tokens=4), t=25 * MS)
    otel.export(rec.drain())
    root, children = traces(mem.get_finished_spans())["early"]
    assert [(c.name, c.start_time - WALL, c.end_time - WALL) for c in children] == [
        ("kvscope.lookup", 5 * MS, 6 * MS), ("kvscope.queue", 6 * MS, 9 * MS),
        ("kvscope.prefill", 9 * MS, 20 * MS), ("kvscope.decode", 20 * MS, 25 * MS)]
    assert root.attributes["kvscope.ttft_ns"] == 15 * MS


def test_a_span_drained_after_its_request_row_waits_for_it(memory: Any) -> None:
    provider, mem = memory
    rec = make_recorder()
    exp = record_workload(rec)
    first, late = split_batch(rec.drain(), "req-a", "decode")
    otel = OtelExporter(model=MODEL, tracer_provider=provider, run_id=RUN_ID)
    otel.export(first)
    assert "req-a" not in traces(mem.get_finished_spans())
    otel.export(late)
    root, children = traces(mem.get_finished_spans())["req-a"]
    assert len(children) == len(exp.states["req-a"]) == 7
    assert root.attributes["kvscope.spans_complete"] is True


def test_flush_exports_a_request_whose_span_was_lost_and_says_so(memory: Any) -> None:
    provider, mem = memory
    rec = make_recorder()
    record_workload(rec)
    first, _lost = split_batch(rec.drain(), "req-a", "decode")
    otel = OtelExporter(model=MODEL, tracer_provider=provider, run_id=RUN_ID)
    otel.export(first)
    otel.flush()
    root, children = traces(mem.get_finished_spans())["req-a"]
    assert root.attributes["kvscope.spans_complete"] is False
    assert len(children) == 6 and otel.incomplete_requests == 1


def test_shutdown_leaves_a_provider_it_did_not_build_running(memory: Any) -> None:
    provider, mem = memory
    otel = OtelExporter(model=MODEL, tracer_provider=provider)
    otel.shutdown()
    otel.shutdown()
    provider.get_tracer("other").start_span("still-works").end()
    assert [s.name for s in mem.get_finished_spans()] == ["still-works"]


def test_sampled_out_requests_cost_no_children() -> None:
    mem = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(mem))
    rec = make_recorder()
    record_workload(rec)
    otel = OtelExporter(model=MODEL, tracer_provider=provider)
    otel.export(rec.drain())
    assert mem.get_finished_spans() == () and otel.exported_requests == 4


def test_sdk_disabled_by_environment_wins_over_an_endpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not OtelExporter(model=MODEL).enabled


def test_without_an_endpoint_the_exporter_is_inert() -> None:
    rec = make_recorder()
    record_workload(rec)
    otel = OtelExporter(model=MODEL)
    assert not otel.enabled and otel.provider is None
    otel.export(rec.drain())
    otel.flush()
    otel.shutdown()
    assert otel.exported_requests == 0
    with pytest.raises(ValueError, match="model"):
        OtelExporter(model="")


class _Receiver(http.server.BaseHTTPRequestHandler):
    """A minimal OTLP/HTTP traces receiver: keeps each decoded request."""

    received: list[tuple[str, ExportTraceServiceRequest]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        self.server.received.append((self.path, msg))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_otlp_http_export_honours_the_standard_environment(
        receiver: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    port = receiver.server_address[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "engine-7")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    rec = make_recorder()
    exp = record_workload(rec)
    otel = OtelExporter(model=MODEL, run_id=RUN_ID)
    assert otel.enabled
    otel.export(rec.drain())
    otel.shutdown()  # flushes the batch processor and shuts the provider down
    assert {path for path, _ in receiver.received} == {"/v1/traces"}
    spans, resources = [], []
    for _, msg in receiver.received:
        for rs in msg.resource_spans:
            resources.append({a.key: a.value.string_value for a in rs.resource.attributes})
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
    assert all(r["service.name"] == "engine-7" for r in resources)
    assert all(r["deployment.environment"] == "test" for r in resources)
    assert len(spans) == len(exp.states) + sum(len(v) for v in exp.states.values())
    roots = {s.trace_id: s for s in spans if s.name == "kvscope.request"}
    want = trace_id_for("req-a", RUN_ID).to_bytes(16, "big")
    assert roots[want].start_time_unix_nano == exp.arrival_ns["req-a"]
    assert roots[want].end_time_unix_nano == exp.finish_ns["req-a"]


def test_explicit_endpoint_and_default_service_name(receiver: Any) -> None:
    port = receiver.server_address[1]
    rec = make_recorder()
    record_workload(rec)
    otel = OtelExporter(model=MODEL, otlp_endpoint=f"http://127.0.0.1:{port}/custom/traces")
    otel.export(rec.drain())
    otel.shutdown()
    paths = {path for path, _ in receiver.received}
    assert paths == {"/custom/traces"}
    res = receiver.received[0][1].resource_spans[0].resource
    assert {a.key: a.value.string_value for a in res.attributes}["service.name"] == "kvscope"
