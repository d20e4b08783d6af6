"""Prometheus exporter: a custom collector on its own registry, and the /metrics HTTP server.

The exporter is a pipeline sink: `export()` folds each drained batch into cumulative state
(`agent.exporters.promstate`), and `collect()` builds every metric family from one snapshot of
that state plus the engine's latest `EngineStatus`. Only catalogued names are exposed
(`agent.schema.ENGINE_METRICS` + `TELEMETRY_METRICS`), with the catalogue's buckets; no other
part of kvscope spells an engine metric's name or labels.
"""

from __future__ import annotations

import logging
import platform
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.samples import Exemplar, Timestamp
from prometheus_client.utils import floatToGoString

from agent.exporters.assembly import RequestAssembler
from agent.exporters.ids import default_run_id
from agent.exporters.promstate import TTFT, Labels, MetricState, Snapshot
from agent.schema import (
    BLOCK_STATES,
    ENGINE_METRICS,
    READ_ONLY_OUTCOMES,
    REMOTE_OP_OUTCOMES,
    REMOTE_OPS,
    SCHEMA_VERSION,
    TABLES,
    TELEMETRY_METRICS,
    MetricSpec,
)
from agent.telemetry.status import EngineStatus

log = logging.getLogger(__name__)

#: What this exporter may expose: the engine and telemetry parts of the catalogue.
EXPOSED: tuple[MetricSpec, ...] = ENGINE_METRICS + TELEMETRY_METRICS
_INF = floatToGoString(float("inf"))


def _family(spec: MetricSpec) -> Metric:
    """An empty metric family for `spec` (the unit only where the name already ends in it;
    prometheus-client would otherwise append it to the name)."""
    unit = spec.unit if spec.unit and spec.family.endswith("_" + spec.unit) else ""
    if spec.type == "counter":
        return CounterMetricFamily(spec.family, spec.help, labels=spec.labels, unit=unit)
    if spec.type == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels, unit=unit)
    if spec.type == "histogram":
        return HistogramMetricFamily(spec.name, spec.help, labels=spec.labels, unit=unit)
    return InfoMetricFamily(spec.family, spec.help, labels=())


#: (op, outcome) series of kvscope_remote_operations_total: only reads check objects, so only
#: they can end in `checksum` or `mismatch`.
REMOTE_OP_SERIES: tuple[tuple[str, str], ...] = tuple(
    (op, o) for op in REMOTE_OPS for o in REMOTE_OP_OUTCOMES
    if o not in READ_ONLY_OUTCOMES or op == "read")


def status_series(status: EngineStatus | None, model: str, *, row_preemptions: int
                  ) -> dict[str, dict[Labels, float]]:
    """The live series of an engine's self-report, by catalogued name.

    Args:
        status: the engine's latest `EngineStatus` (None: no engine publishes one).
        model: the `model` label.
        row_preemptions: preemptions counted from finished requests' rows, exported only when
            there is no status (the engine's own count is live; the two are never added).
    """
    m = (model,)
    if status is None:
        return {"kvscope_preemptions_total": {m: row_preemptions}}
    out: dict[str, dict[Labels, float]] = {
        "kvscope_requests_running": {m: status.running},
        "kvscope_requests_waiting": {m: status.waiting},
        "kvscope_preemptions_total": {m: status.preemptions},
        "kvscope_block_pool_blocks": {
            (model, p.tier, state): getattr(p, state) for p in status.pools
            for state in BLOCK_STATES},
    }
    remote = status.remote
    if remote is not None:
        ops = remote.operations
        out["kvscope_remote_operations_total"] = {
            (model, op, outcome): ops.get((op, outcome), 0) for op, outcome in REMOTE_OP_SERIES}
        out["kvscope_remote_breaker_open"] = {
            (model, op): 1 if remote.breakers.get(op) == "open" else 0 for op in REMOTE_OPS}
    return out


class PrometheusExporter:
    """Engine metrics for Prometheus, fed by the telemetry pipeline.

    Every name and label is this exporter's: finished requests and spans (drained batches)
    become counters and histograms, and the engine's `EngineStatus` (`recorder.status`, read
    at scrape time) becomes the live gauges and counters (`status_series`).

    Args:
        recorder: the `agent.telemetry.Recorder` (its status and stats).
        model: the `model` label of every engine metric.
        registry: where to register the collector (default: a new `CollectorRegistry`).
        run_id: seeds the TTFT exemplars' trace ids; use the one given to `OtelExporter`.
    """

    name = "prometheus"

    def __init__(self, recorder: Any, *, model: str, registry: CollectorRegistry | None = None,
                 run_id: str | None = None) -> None:
        if not model:
            raise ValueError("model: must be a non-empty string")
        self.recorder = recorder
        self.model = model
        self.run_id = run_id or default_run_id()
        self._state = MetricState(model, self.run_id)
        self._assembler = RequestAssembler()
        self._lock = threading.Lock()
        self._pipeline: Any = None
        #: Failures inside this exporter that did not raise.
        self.errors = 0
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)

    def bind_pipeline(self, pipeline: Any) -> None:
        """Expose `pipeline.stats` (drops, export errors) as telemetry self-metrics."""
        self._pipeline = pipeline

    # ------------------------------------------------------------------ sink protocol
    def export(self, batch: dict[str, pa.Table]) -> None:
        """Fold one drained batch into the cumulative state."""
        with self._lock:
            self._state.add_finished(self._assembler.feed(batch))
            spans = batch.get("spans")
            if spans is not None and spans.num_rows:
                self._state.add_spans(spans)
            events = batch.get("events")
            if events is not None and events.num_rows:
                self._state.add_events(events)

    def flush(self) -> None:
        """Count requests still waiting for late spans (their stage times are left out)."""
        with self._lock:
            self._state.add_finished(self._assembler.flush())

    def shutdown(self) -> None:
        """Nothing to release: the registry keeps serving the final values."""

    # ------------------------------------------------------------------ collector
    def describe(self) -> list[Metric]:
        """The families this collector exposes (lets the registry detect duplicates)."""
        return [_family(s) for s in EXPOSED]

    def collect(self) -> Iterator[Metric]:
        """Every exposed family from one snapshot of the state."""
        with self._lock:
            snap = self._state.snapshot()
        live = status_series(getattr(self.recorder, "status", None), self.model,
                             row_preemptions=snap.row_preemptions)
        telemetry = self._telemetry()
        for spec in EXPOSED:
            fam = _family(spec)
            if spec.type == "info":
                fam.add_metric([], {"version": _version(), "schema_version": str(SCHEMA_VERSION),
                                    "python": platform.python_version()})
            elif spec.type == "histogram":
                self._add_histogram(fam, spec, snap)
            else:
                series: dict[Labels, float] = {}
                for src in (snap.counters.get(spec.name), telemetry.get(spec.name),
                            live.get(spec.name)):
                    for labels, v in (src or {}).items():
                        series[labels] = series.get(labels, 0) + v
                for labels, v in sorted(series.items()):
                    fam.add_metric(list(labels), float(v))
            yield fam

    def _add_histogram(self, fam: Metric, spec: MetricSpec, snap: Snapshot) -> None:
        bounds = [floatToGoString(b) for b in spec.buckets] + [_INF]
        for labels, cum, total in snap.histograms.get(spec.name, ()):
            buckets: list[Any] = []
            for i, (le, count) in enumerate(zip(bounds, cum, strict=True)):
                ex = snap.ttft_exemplars.get(i) if spec.name == TTFT else None
                if ex is None:
                    buckets.append((le, count))
                else:
                    buckets.append((le, count, Exemplar(
                        {"trace_id": ex.trace_id, "span_id": ex.span_id}, ex.value_s,
                        Timestamp(*divmod(ex.timestamp_ns, 10**9)))))
            fam.add_metric(list(labels), buckets, total)  # type: ignore[attr-defined]

    def _telemetry(self) -> dict[str, dict[Labels, float]]:
        """Self-metrics: recorder stats plus pipeline stats, each table/sink shown from 0."""
        stats = getattr(self.recorder, "stats", None)
        pipe = getattr(self._pipeline, "stats", None)
        dropped: dict[Labels, float] = {(t,): 0 for t in TABLES}
        rows: dict[Labels, float] = {(t,): 0 for t in TABLES}
        errors: dict[Labels, float] = {(self.name,): self.errors}
        rec_errors = 0
        if stats is not None:
            for t, n in dict(stats.dropped).items():
                dropped[(t,)] = dropped.get((t,), 0) + n
            for t, n in dict(stats.rows).items():
                rows[(t,)] = rows.get((t,), 0) + n
            rec_errors = stats.recording_errors
        if pipe is not None:
            for t, n in dict(pipe.dropped_rows).items():
                dropped[(t,)] = dropped.get((t,), 0) + n
            for sink, n in dict(pipe.export_errors).items():
                errors[(sink,)] = errors.get((sink,), 0) + n
        return {
            "kvscope_telemetry_dropped_records_total": dropped,
            "kvscope_telemetry_records_total": rows,
            "kvscope_telemetry_export_errors_total": errors,
            "kvscope_telemetry_recording_errors_total": {(): rec_errors},
        }


def _version() -> str:
    from agent import __version__

    return __version__


@dataclass
class MetricsServer:
    """A running /metrics endpoint (prometheus-client's threaded WSGI server)."""

    httpd: Any
    thread: threading.Thread
    address: str

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def shutdown(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.thread.join(timeout=5)
        self.httpd.server_close()


def serve_metrics(registry: CollectorRegistry, port: int = 0,
                  address: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` over HTTP on a daemon thread.

    Plain text or OpenMetrics (with exemplars) is chosen from the request's Accept header.

    Args:
        registry: the registry to expose (e.g. `PrometheusExporter(...).registry`).
        port: TCP port; 0 picks a free one (read it back from `.port`).
        address: bind address; the default keeps it local, `0.0.0.0` or `::` opens it so a
            fleet Prometheus can scrape it (`--listen-address`).

    Returns:
        The server (`.port`, `.url`, `.shutdown()`).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port: must be in 0..65535, got {port}")
    httpd, thread = start_http_server(port, addr=address, registry=registry)
    return MetricsServer(httpd, thread, address)
