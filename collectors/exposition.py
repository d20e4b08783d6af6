"""Prometheus exposition of a `CollectorRunner`'s latest readings.

Two ways, same bytes:

- `CollectorExposition`: a prometheus-client custom collector, for any registry (e.g. the
  engine's exporter in `kvscope run`)::

      registry = CollectorRegistry(auto_describe=False)
      registry.register(CollectorExposition(runner))

- `TextRenderer`: what the node agent's /metrics serves. prometheus-client's `generate_latest`
  validates and escapes every name and label on every scrape (~7 µs a series); the catalogue
  fixes the names and the series set changes only when hardware appears or vanishes, so the
  renderer keeps each series' `name{labels} ` prefix and a scrape is one join of prefixes and
  formatted values. Its output is byte-for-byte `generate_latest`'s (tested).

A scrape reads no hardware: it formats the snapshot the collector threads left behind, so
scrapes cost the same however many Prometheus servers poll, and a slow device never stalls
/metrics. Series of an entity that vanished disappear with its next run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from agent.schema import COLLECTOR_METRICS, MetricSpec
from collectors.base import Reading

if TYPE_CHECKING:
    from collectors.runner import CollectorRunner

#: Text format 0.0.4, what Prometheus and every scraper accept.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class CollectorExposition:
    """Builds one metric family per catalogued collector metric that has series now.

    Args:
        runner: the runner whose `readings()` are exposed.
        specs: the catalogue entries to expose (default: every collector and agent metric).
    """

    def __init__(self, runner: CollectorRunner,
                 specs: tuple[MetricSpec, ...] = COLLECTOR_METRICS) -> None:
        self.runner = runner
        self.specs = specs

    def describe(self) -> list[Metric]:
        # Registering must not run collect(): the runner may not have started yet.
        return []

    def collect(self) -> Iterator[Metric]:
        readings = self.runner.readings()
        for s in self.specs:
            rows = readings.get(s.name)
            if not rows:
                continue
            if s.type == "counter":
                fam: Metric = CounterMetricFamily(s.family, s.help, labels=s.labels)
            else:
                fam = GaugeMetricFamily(s.name, s.help, labels=s.labels)
            for r in rows:
                fam.add_metric(r.labels, r.value)
            yield fam


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class TextRenderer:
    """Renders readings in the Prometheus text format with cached series prefixes.

    Args:
        specs: the catalogue entries to render, in output order.
        max_cached: prefixes kept before the cache is rebuilt (interface churn — veth pairs
            coming and going — must not grow it without bound).
    """

    def __init__(self, specs: tuple[MetricSpec, ...] = COLLECTOR_METRICS,
                 max_cached: int = 65536) -> None:
        self.specs = specs
        self.max_cached = max_cached
        self._header = {s.name: f"# HELP {s.name} {_escape_help(s.help)}\n"
                                f"# TYPE {s.name} {s.type}\n" for s in specs}
        # Label names sorted like generate_latest; `order` maps sorted position → value index.
        self._order = {s.name: sorted(range(len(s.labels)), key=lambda i, s=s: s.labels[i])
                       for s in specs}
        self._prefix: dict[tuple[str, tuple[str, ...]], str] = {}

    def _make_prefix(self, s: MetricSpec, labels: tuple[str, ...]) -> str:
        if not s.labels:
            return f"{s.name} "
        pairs = ",".join(f'{s.labels[i]}="{_escape_label(labels[i])}"'
                         for i in self._order[s.name])
        return f"{s.name}{{{pairs}}} "

    def render(self, readings: dict[str, list[Reading]]) -> bytes:
        """The exposition of `readings` (as `CollectorRunner.readings()` returns them)."""
        if len(self._prefix) > self.max_cached:
            self._prefix.clear()
        prefix = self._prefix
        out: list[str] = []
        for s in self.specs:
            rows = readings.get(s.name)
            if not rows:
                continue
            out.append(self._header[s.name])
            for r in rows:
                key = (s.name, r.labels)
                p = prefix.get(key)
                if p is None:
                    p = prefix[key] = self._make_prefix(s, r.labels)
                out.append(f"{p}{floatToGoString(r.value)}\n")
        return "".join(out).encode()
