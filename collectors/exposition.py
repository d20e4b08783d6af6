"""Prometheus exposition of a `CollectorRunner`'s latest readings.

Two ways, same bytes:

- `CollectorExposition`: a prometheus-client custom collector, for any registry (e.g. the
  engine's exporter in `kvscope run`)::

      registry = CollectorRegistry(auto_describe=False)
      registry.register(CollectorExposition(runner))

- `TextRenderer`: what the node agent's /metrics serves. prometheus-client's `generate_latest`
  validates and escapes every name and label on every scrape (~7 µs a series); the catalogue
  fixes the names and the series set changes only when hardware appears or vanishes, so the
  renderer keeps each series' `name{labels} ` prefix, and its last line with the value it
  formatted, so a scrape is one join of lines and formats only the values that moved. Its
  output is byte-for-byte `generate_latest`'s (tested).

Rendering reads no hardware: it formats the runner's latest snapshot. Whoever serves it
decides how fresh that must be: the node agent without a run store has stale collectors run
first (`CollectorRunner.refresh`, collection timed to the scrape, at most once per half
interval however many Prometheus servers poll; a slow device delays /metrics by a bounded
wait at worst). Series of an entity that vanished disappear with its next run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

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
        self._plan = [(s.name, self._header[s.name], s) for s in specs]
        # series → [prefix, last value, last line]: a counter that did not move (most error
        # and drop counters) or a constant gauge is not formatted again.
        self._prefix: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
        # family → (its rows last time, its text): a family none of whose series moved
        # (error and drop counters, memory total, most health series) is one comparison.
        self._block: dict[str, tuple[list[Reading], str]] = {}

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
            self._block.clear()
        prefix = self._prefix
        blocks = self._block
        get = readings.get
        out: list[str] = []
        for name, header, s in self._plan:
            rows = get(name)
            if not rows:
                continue
            last = blocks.get(name)
            if last is not None and last[0] == rows:
                out.append(last[1])
                continue
            lines = [header]
            for r in rows:
                key = (name, r.labels)
                c = prefix.get(key)
                value = r.value
                if c is None:
                    p = self._make_prefix(s, r.labels)
                    c = prefix[key] = [p, value, f"{p}{floatToGoString(value)}\n"]
                elif c[1] != value or value != value:  # moved (or NaN)
                    c[1] = value
                    c[2] = f"{c[0]}{floatToGoString(value)}\n"
                lines.append(c[2])
            text = "".join(lines)
            blocks[name] = (rows, text)
            out.append(text)
        return "".join(out).encode()
