"""A Mooncake Store master's metrics endpoint (`mooncake_master --metrics_port`), scraped beside
the engine: object counts, segment usage and evictions of the remote tier in the run store.

The master already speaks the Prometheus text format, so a fleet Prometheus scrapes it as a job
of its own (`http://HOST:METRICS_PORT/metrics`, next to the engine's and the agent's); this
collector puts the same figures into the run store's `samples` and `events`, on the run's clock,
so a diagnosis can line an eviction burst or a master restart up with the requests that missed.
It exposes no Prometheus series itself: the master's names are not kvscope's catalogue, and
re-exporting them would publish every series twice.

Samples (source `agent`, entity `mooncake-master <host:port>`, or the segment's name for
per-segment gauges): every gauge as read as `mooncake_<name>` (e.g. `mooncake_master_key_count`,
`mooncake_segment_allocated_bytes`), every counter (`*_total`) as a per-second rate
`mooncake_<name>_per_second`. Histograms are left out (their buckets are the master's business).

Events: `mooncake_eviction` when the master evicted keys since the previous scrape (detail:
keys, bytes), `mooncake_master_reset` when its request counters went backwards (a restarted
master: every object is gone), `mooncake_master_unreachable` / `mooncake_master_reachable` on
each change of reachability; `mooncake_up` (1 or 0) is sampled every scrape, as Prometheus'
`up` would be.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

from agent.clock import now_ns
from collectors.base import BaseCollector, Collection, CounterTracker, Emitter, Sample

SOURCE = "agent"
_RESET_PROBE = "master_put_start_requests_total"


def parse_metrics(text: str) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float],
                                      dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """Prometheus text → (gauges, counters), each keyed by (sample name, sorted labels)."""
    gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type not in ("gauge", "counter", "untyped"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            k = (s.name, tuple(sorted(s.labels.items())))
            (counters if fam.type == "counter" else gauges)[k] = float(s.value)
    return gauges, counters


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


class MooncakeMasterCollector(BaseCollector):
    """Scrapes one master's metrics endpoint.

    Args:
        url: the endpoint, `http://HOST:PORT/metrics` (`?metrics=` of a `mooncake://` URL).
        timeout_s: HTTP timeout of one scrape.
        clock: monotonic ns clock.
        fetch: (url, timeout_s) → text (injectable for tests).
    """

    name = "mooncake"
    source = SOURCE

    def __init__(self, url: str, *, timeout_s: float = 1.0, clock: Callable[[], int] = now_ns,
                 fetch: Callable[[str, float], str] = _fetch) -> None:
        super().__init__()
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"mooncake metrics URL must be http://HOST:PORT/metrics, "
                             f"got {url!r}")
        self.url = url
        self.entity = f"mooncake-master {u.netloc}"
        self.timeout_s = timeout_s
        self.clock = clock
        self.fetch = fetch
        self.counters = CounterTracker()
        self._reachable: bool | None = None
        self._last_probe: float | None = None
        self._last_evicted: tuple[float, float] | None = None

    def collect(self) -> Collection:
        em = Emitter(self.source, self.clock(), self.counters)
        try:
            text = self.fetch(self.url, self.timeout_s)
        except OSError as e:
            if self._reachable is not False:
                self._reachable = False
                em.event("mooncake_master_unreachable", {"url": self.url, "error": str(e)})
            em.out.samples.append(Sample(em.ts, SOURCE, self.entity, "mooncake_up", 0.0, None))
            return em.out
        if self._reachable is False:
            em.event("mooncake_master_reachable", {"url": self.url})
        self._reachable = True
        em.out.samples.append(Sample(em.ts, SOURCE, self.entity, "mooncake_up", 1.0, None))
        gauges, counters = parse_metrics(text)
        for (name, labels), value in gauges.items():
            entity = dict(labels).get("segment", self.entity)
            em.out.samples.append(Sample(em.ts, SOURCE, entity, f"mooncake_{name}", value,
                                         "bytes" if name.endswith("_bytes") else None))
        for (name, labels), value in counters.items():
            entity = dict(labels).get("segment", self.entity)
            short = name.removesuffix("_total")
            em.rate((name, labels), value, entity, f"mooncake_{short}_per_second", "per_second")
        probe = counters.get((_RESET_PROBE, ()))
        if probe is not None:
            if self._last_probe is not None and probe < self._last_probe:
                em.event("mooncake_master_reset", {"url": self.url})
                self._last_evicted = None
            self._last_probe = probe
        # Typed counter by the master (no _total suffix: the parser adds one).
        either = {**gauges, **counters}
        keys = either.get(("master_evicted_key_count_total", ()),
                          either.get(("master_evicted_key_count", ())))
        size = either.get(("master_evicted_size_bytes_total", ()),
                          either.get(("master_evicted_size_bytes", ()), 0.0))
        if keys is not None:
            last = self._last_evicted
            if last is not None and keys > last[0]:
                em.event("mooncake_eviction", {"keys": int(keys - last[0]),
                                               "bytes": int(size - last[1])})
            self._last_evicted = (keys, size)
        self.counters.end_cycle()
        return em.out

