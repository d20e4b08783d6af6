"""Optional OTLP metric export of the same readings /metrics serves.

One observable instrument per catalogued collector metric; its callback reads the runner's
latest snapshot, so OTLP and Prometheus always agree. Counters drop `_total` from their name
(an OTLP→Prometheus translation adds it back); units are UCUM. The SDK exports on its own
thread; a failing endpoint is logged by the SDK and never stops the agent.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from agent.schema import COLLECTOR_METRICS, MetricSpec

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider

    from collectors.runner import CollectorRunner

#: Catalogue unit → UCUM unit (OpenTelemetry's convention).
UCUM: dict[str, str] = {
    "": "1", "ratio": "1", "bytes": "By", "bytes_per_second": "By/s", "seconds": "s",
    "hertz": "Hz", "watts": "W", "joules": "J", "celsius": "Cel",
}


def otel_name(spec: MetricSpec) -> str:
    """The OTLP instrument name of a catalogued metric."""
    return spec.family if spec.type == "counter" else spec.name


def build_meter_provider(runner: CollectorRunner, reader: Any,
                         specs: Iterable[MetricSpec] = COLLECTOR_METRICS) -> MeterProvider:
    """A MeterProvider whose observable instruments read `runner.readings()`.

    Args:
        runner: the source of readings.
        reader: a MetricReader (PeriodicExportingMetricReader for OTLP, InMemoryMetricReader in
            tests).
        specs: the metrics to export.

    Returns:
        The provider; call `shutdown()` on it to flush and stop.
    """
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    from agent import __version__

    resource = Resource.create({"service.name": "kvscope-agent", "service.version": __version__,
                                "host.name": socket.gethostname()})
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    meter = provider.get_meter("kvscope.agent", __version__)

    def make_callback(spec: MetricSpec):
        def callback(_options: CallbackOptions) -> list[Observation]:
            rows = runner.readings().get(spec.name, ())
            return [Observation(r.value, dict(zip(spec.labels, r.labels, strict=True)))
                    for r in rows]
        return callback

    for spec in specs:
        kwargs = {"callbacks": [make_callback(spec)], "unit": UCUM.get(spec.unit, spec.unit),
                  "description": spec.help}
        if spec.type == "counter":
            meter.create_observable_counter(otel_name(spec), **kwargs)
        else:
            meter.create_observable_gauge(otel_name(spec), **kwargs)
    return provider


def start_otlp(runner: CollectorRunner, endpoint: str, interval_s: float) -> MeterProvider:
    """Export the runner's readings to an OTLP/HTTP metrics endpoint every `interval_s`."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, timeout=5),
                                           export_interval_millis=interval_s * 1000)
    return build_meter_provider(runner, reader)
