"""Prometheus exporter: a custom collector on its own registry, and the /metrics HTTP server.

The exporter is a pipeline sink: `export()` folds each drained batch into cumulative state
(`agent.exporters.promstate`), and `collect()` builds every metric family from one snapshot of
that state plus the recorder's live gauges and counters. Only catalogued names are exposed
(`agent.schema.ENGINE_METRICS` + `TELEMETRY_METRICS`), with the catalogue's buckets.
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
from agent.schema import ENGINE_METRICS, SCHEMA_VERSION, TABLES, TELEMETRY_METRICS, MetricSpec

log = logging.getLogger(__name__)

#: What this exporter may expose: the engine and telemetry parts of the catalogue.
EXPOSED: tuple[MetricSpec, ...] = ENGINE_METRICS + TELEMETRY_METRICS
_BY_NAME = {m.name: m for m in EXPOSED}
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


class PrometheusExporter:
    """Engine metrics for Prometheus, fed by the telemetry pipeline.

    Live values: `recorder.gauges` and `recorder.counters` map (catalogued name, label values
    in catalogue order) to a number; the leading `model` label may be left out (this exporter's
    `model` fills it). Keys with an uncatalogued name, the wrong metric type or the wrong label
    count are skipped and counted once each as export errors.

    Args:
        recorder: the `agent.telemetry.Recorder` (live gauges/counters and its stats).
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
        self._bad_keys: set[tuple[str, Any]] = set()
        #: Failures inside this exporter that did not raise (bad live keys).
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
        gauges, counters = self._live_values()
        live_counters = self._live(counters, "counter")
        live_gauges = self._live(gauges, "gauge")
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
                            (live_counters if spec.type == "counter" else live_gauges)
                            .get(spec.name)):
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

    def _live_values(self) -> tuple[dict[Any, Any], dict[Any, Any]]:
        """Copies of the recorder's live (gauges, counters); the engine inserts meanwhile."""
        snap = getattr(self.recorder, "metrics_snapshot", None)
        if snap is not None:
            return snap()
        # dict(d) copies in one C call, so no insert can interleave with the iteration.
        return (dict(getattr(self.recorder, "gauges", {})),
                dict(getattr(self.recorder, "counters", {})))

    def _live(self, values: dict[Any, Any], type_: str) -> dict[str, dict[Labels, float]]:
        """Valid live entries by family; invalid keys counted once and logged once."""
        out: dict[str, dict[Labels, float]] = {}
        for key, v in values.items():
            try:
                name, labels = key
                spec = _BY_NAME.get(name)
                labels = tuple(str(x) for x in labels)
                if spec is not None and spec.type == type_:
                    if len(labels) == len(spec.labels) - 1 and spec.labels[:1] == ("model",):
                        labels = (self.model, *labels)
                    if len(labels) == len(spec.labels):
                        series = out.setdefault(name, {})
                        series[labels] = series.get(labels, 0) + float(v)
                        continue
            except (TypeError, ValueError):
                pass
            self._bad_key(key, type_)
        return out

    def _bad_key(self, key: Any, type_: str) -> None:
        try:
            marker = (type_, key)
            if marker in self._bad_keys:
                return
            self._bad_keys.add(marker)
        except TypeError:  # unhashable: count it every time rather than fail the scrape
            pass
        self.errors += 1
        log.warning("kvscope prometheus: skipping live %s %r (not a catalogued %s with the "
                    "catalogue's labels)", type_, key, type_)

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
