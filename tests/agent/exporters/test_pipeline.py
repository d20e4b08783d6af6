"""The telemetry pipeline: run store round trip, failure isolation, bounded queue, close."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)

from agent.exporters.ids import trace_id_hex
from agent.exporters.otel import OtelExporter
from agent.exporters.pipeline import RateLimitedLog, TelemetryPipeline
from agent.exporters.prometheus import PrometheusExporter
from agent.exporters.runstore import RunStoreSink
from agent.runstore import RunStoreWriter, open_run
from agent.schema import TABLES
from agent.telemetry import RequestAccounting
from tests.agent.exporters.common import MODEL, MS, WALL, make_recorder, record_workload
from tests.agent.exporters.test_prometheus import get, samples

_SORT = {
    "requests": ["request_num"],
    "spans": ["kind", "request_num", "step_id", "start_ns", "name"],
    "events": ["ts_ns", "name"],
}


class ListSink:
    def __init__(self, name: str = "list") -> None:
        self.name = name
        self.batches: list[dict[str, pa.Table]] = []
        self.flushed = self.shut = 0

    def export(self, batch: dict[str, pa.Table]) -> None:
        self.batches.append(batch)

    def flush(self) -> None:
        self.flushed += 1

    def shutdown(self) -> None:
        self.shut += 1

    def rows(self, table: str) -> int:
        return sum(b[table].num_rows for b in self.batches if table in b)


class BrokenSink(ListSink):
    def export(self, batch: dict[str, pa.Table]) -> None:
        raise RuntimeError("disk on fire")

    def shutdown(self) -> None:
        raise OSError("still on fire")


class BlockingSink(ListSink):
    """Blocks in export until released; `entered` is set once it is inside."""

    def __init__(self) -> None:
        super().__init__("blocking")
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, batch: dict[str, pa.Table]) -> None:
        self.entered.set()
        self.release.wait(timeout=30)
        super().export(batch)


def _sorted(tbl: pa.Table, name: str) -> pa.Table:
    return tbl.sort_by([(c, "ascending") for c in _SORT.get(name, [])]) if name in _SORT else tbl


def test_close_writes_every_recorded_row_to_the_run_store(tmp_path: Path) -> None:
    rec = make_recorder()
    writer = RunStoreWriter(tmp_path / "run", config={"model": MODEL})
    sink = RunStoreSink(writer)
    pipe = TelemetryPipeline(rec, [sink], interval_s=0.05, queue_size=8).start()
    record_workload(rec)
    pipe.close()
    pipe.close()  # idempotent

    twin = make_recorder()  # the same workload drained directly: what the store must hold
    record_workload(twin)
    direct = twin.drain()
    store = open_run(tmp_path / "run")
    assert store.complete and store.gaps == []
    for name in TABLES:
        want = direct.get(name, TABLES[name].empty_table())
        assert _sorted(store.tables[name], name).equals(_sorted(want, name)), name
    assert store.requests["request_id"].tolist() == ["req-a", "req-b", "req-c", "req-d"]
    assert store.meta["telemetry"] == {"failed_batches": 0, "pipeline_dropped_rows": {},
                                       "recorder_dropped_rows": {}, "recording_errors": 0}
    assert pipe.stats.rows == {n: t.num_rows for n, t in direct.items()}
    assert pipe.stats.dropped_batches == 0


def test_exemplar_and_otel_trace_agree_for_a_request(tmp_path: Path) -> None:
    rec = make_recorder()
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    prom = PrometheusExporter(rec, model=MODEL, run_id="shared")
    otel = OtelExporter(model=MODEL, tracer_provider=provider, run_id="shared")
    with TelemetryPipeline(rec, [prom, otel], interval_s=0.05):
        record_workload(rec)
    roots = {s.attributes["kvscope.request_id"]: s for s in mem.get_finished_spans()
             if s.name == "kvscope.request"}
    exemplars = [s.exemplar for fam in parse_openmetrics(
        generate_openmetrics(prom.registry).decode()) for s in fam.samples if s.exemplar]
    assert len(exemplars) == 3
    by_value = {round(roots[r].attributes["kvscope.ttft_ns"] / 1e9, 9): r
                for r in roots if "kvscope.ttft_ns" in roots[r].attributes}
    for ex in exemplars:
        rid = by_value[ex.value]
        assert ex.labels["trace_id"] == trace_id_hex(roots[rid].context.trace_id)


def test_a_failing_sink_is_counted_and_nothing_else_notices(caplog: Any) -> None:
    rec = make_recorder()
    good = ListSink("good")
    broken = BrokenSink("broken")
    prom = PrometheusExporter(rec, model=MODEL)
    pipe = TelemetryPipeline(rec, [broken, good, prom], interval_s=3600)
    pipe.start()
    with caplog.at_level(logging.ERROR, logger="agent.exporters.pipeline"):
        record_workload(rec)
        assert pipe.drain_now()
        rn = rec.request_begin("after", 5000 * MS)  # the recorder keeps working
        rec.request_end(rn, RequestAccounting(), t=5001 * MS)
        assert pipe.drain_now()
        pipe.close()  # broken.shutdown raises too: close must not
    assert pipe.stats.export_errors == {"broken": 3, "good": 0, "prometheus": 0}
    assert good.rows("requests") == 5 and good.flushed == 1 and good.shut == 1
    assert rec.stats.recording_errors == 0
    smp = samples(prom.registry)
    assert get(smp, "kvscope_telemetry_export_errors_total", exporter="broken") == 3
    assert get(smp, "kvscope_telemetry_export_errors_total", exporter="good") == 0
    assert get(smp, "kvscope_requests_total", model=MODEL, status="ok") == 3
    assert get(smp, "kvscope_telemetry_records_total", table="requests") == 5
    # Rate limited: one log line for the broken sink within the period.
    logged = [r for r in caplog.records if "'broken'" in r.getMessage()]
    assert len(logged) == 1 and "disk on fire" in logged[0].exc_text


def test_full_queue_drops_whole_batches_and_counts_their_rows() -> None:
    rec = make_recorder()
    blocking = BlockingSink()
    prom = PrometheusExporter(rec, model=MODEL)
    pipe = TelemetryPipeline(rec, [blocking, prom], interval_s=3600, queue_size=1).start()
    try:
        rec.event("eviction", t=1)
        assert pipe.drain_now()  # taken by the worker, which blocks in the sink
        assert blocking.entered.wait(timeout=10)
        rec.event("eviction", t=2)
        assert pipe.drain_now()  # waits in the queue
        for t in (3, 4, 5):
            rec.event("eviction", t=t)
        rec.sample("host", "cpu", 0.5, t=6)
        assert not pipe.drain_now()  # queue full: dropped
        assert pipe.stats.dropped_batches == 1
        assert pipe.stats.dropped_rows == {"events": 3, "samples": 1}
        smp = samples(prom.registry)
        assert get(smp, "kvscope_telemetry_dropped_records_total", table="events") == 3
        assert get(smp, "kvscope_telemetry_dropped_records_total", table="samples") == 1
    finally:
        blocking.release.set()
        pipe.close()
    assert blocking.rows("events") == 2 and pipe.stats.exported_batches == 2


def test_close_abandons_a_stuck_sink_but_finishes_the_others() -> None:
    rec = make_recorder()
    blocking = BlockingSink()
    good = ListSink("good")
    pipe = TelemetryPipeline(rec, [blocking, good], interval_s=3600, close_timeout_s=0.2)
    pipe.start()
    try:
        rec.event("eviction", t=1)
        pipe.drain_now()
        assert blocking.entered.wait(timeout=10)
        rec.event("eviction", t=2)
        pipe.close()
        assert pipe.stats.export_errors["blocking"] == 1
        assert (good.flushed, good.shut, blocking.flushed, blocking.shut) == (1, 1, 0, 0)
        assert pipe.stats.dropped_rows == {"events": 1}  # the final drain, queued behind it
    finally:
        blocking.release.set()
    pipe._worker.join(timeout=10)  # the sink returns late: nothing reaches the closed sinks
    assert not pipe._worker.is_alive() and good.batches == []


def test_the_drain_thread_runs_on_its_own() -> None:
    rec = make_recorder()
    sink = ListSink()
    pipe = TelemetryPipeline(rec, [sink], interval_s=0.02).start()
    try:
        rec.event("eviction", t=1)
        deadline = time.monotonic() + 10
        while sink.rows("events") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.rows("events") == 1 and pipe.running
    finally:
        pipe.close()
    assert not pipe.running
    with pytest.raises(RuntimeError, match="after close"):
        pipe.start()


def test_close_without_start_exports_on_the_calling_thread() -> None:
    rec = make_recorder()
    sink = ListSink()
    pipe = TelemetryPipeline(rec, [sink], queue_size=1)
    rec.event("eviction", t=1)
    assert pipe.drain_now()
    rec.event("eviction", t=2)
    pipe.close()
    assert sink.rows("events") == 2 and (sink.flushed, sink.shut) == (1, 1)
    assert pipe.stats.dropped_batches == 0


def test_configuration_is_validated() -> None:
    rec = make_recorder()
    with pytest.raises(ValueError, match="interval_s"):
        TelemetryPipeline(rec, [], interval_s=0)
    with pytest.raises(ValueError, match="queue_size"):
        TelemetryPipeline(rec, [], queue_size=0)
    with pytest.raises(ValueError, match="close_timeout_s"):
        TelemetryPipeline(rec, [], close_timeout_s=0)
    with pytest.raises(ValueError, match="unique"):
        TelemetryPipeline(rec, [ListSink("x"), ListSink("x")])


def test_rate_limited_log_reports_what_it_suppressed(caplog: Any) -> None:
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("t.rl"), period_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="t.rl"):
        assert rl.error("k", "boom %s", 1, exc_info=False)
        now[0] = 30
        assert not rl.error("k", "boom %s", 2, exc_info=False)
        assert rl.error("other", "bang", exc_info=False)
        now[0] = 61
        assert rl.error("k", "boom %s", 3, exc_info=False)
    assert [r.getMessage() for r in caplog.records] == [
        "boom 1", "bang", "boom 3 (1 similar message(s) suppressed)"]


def test_run_store_sink_records_losses_and_status(tmp_path: Path) -> None:
    rec = make_recorder()
    sink = RunStoreSink(RunStoreWriter(tmp_path / "run"), status="aborted")
    blocking = BlockingSink()
    pipe = TelemetryPipeline(rec, [blocking, sink], interval_s=3600, queue_size=1).start()
    try:
        for t in (1, 2, 3):
            rec.event("eviction", t=t)
            pipe.drain_now()
            if t == 1:
                assert blocking.entered.wait(timeout=10)
    finally:
        blocking.release.set()
        pipe.close()
    store = open_run(tmp_path / "run")
    assert store.meta["status"] == "aborted" and not store.complete
    assert store.meta["telemetry"]["pipeline_dropped_rows"] == {"events": 1}
    assert store.events["ts_ns"].tolist() == [WALL + 1, WALL + 2]  # the third was dropped
