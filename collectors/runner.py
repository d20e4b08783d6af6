"""Runs collectors on their own schedules and hands their output to a sink.

One thread per collector: a slow collector (NVML on a busy driver, a hung sysfs read) delays
only itself. Each thread keeps a fixed cadence (run k starts at start + k·interval); when a run
overruns, the missed starts are skipped and counted, never queued.

In-process use, e.g. beside the engine in `kvscope run` so one run store holds both::

    from collectors.runner import CollectorRunner, default_collectors, recorder_sink
    runner = CollectorRunner(default_collectors(watch={"engine": os.getpid()}),
                             interval_s=1.0, on_samples=recorder_sink(recorder))
    runner.start()          # threads named kvscope-collector-<name>
    ...
    runner.stop()           # joins the threads, closes NVML

`on_samples(collector_name, collection)` runs on the collector's thread and returns how many
samples it dropped (or None); `readings()` is the latest snapshot for Prometheus/OTLP exporters
(`collectors.exposition.CollectorExposition(runner)` registers it with prometheus-client).

Collection timed to the scrape (`on_demand=True`, what the node agent uses when nothing but
/metrics consumes its output): a collector runs when `refresh()` asks for a snapshot younger
than it has, plus once every `idle_interval_s` on its thread so that counters are followed
(wraps, resets, vanished entities) and NVML's XID queue is drained while nobody scrapes. The
run store needs its samples (rates from deltas) at the configured interval, so an agent with
`--out` (or OTLP, which reads the snapshot on its own period) keeps the fixed cadence. A
collector whose last run was quick (`inline_max_s`) runs on the scrape's thread, sparing two
thread hand-offs; a slow one (a busy NVML driver) runs on its own thread and the scrape waits
at most `refresh()`'s `timeout_s`, then formats whatever snapshot there is. One collector
never runs twice at once. Gauges computed between two runs (host CPU utilization, NVLink
throughput) then cover the time since the previous run, at least `max_age_s`.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from agent.clock import ClockAnchor, now_ns, process_anchor
from collectors.base import BaseCollector, Collection, Event, Reading, new_reading

log = logging.getLogger(__name__)

OnSamples = Callable[[str, Collection], "int | None"]


@dataclass(slots=True)
class CollectorHealth:
    """The runner's account of one collector (exported as kvscope_collector_*)."""

    runs: int = 0
    errors: int = 0
    dropped: int = 0
    missed: int = 0  # scheduled starts skipped because a run overran its interval
    last_duration_s: float | None = None
    last_success_ns: int | None = None  # monotonic


@dataclass(slots=True)
class _Demand:
    """One collector's on-demand state: runs asked for, started and finished (counts)."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    requested: int = 0
    started: int = 0
    completed: int = 0
    last_start_ns: int = -(1 << 62)
    last_start_mono: float = 0.0  # time.monotonic() of the same start (the idle floor's clock)
    #: Threads waiting on `cond` for a run to complete (a finished run notifies only then:
    #: the collector's own thread, waiting out its idle floor, need not wake at every scrape).
    waiters: int = 0


class CollectorRunner:
    """Schedules collectors and keeps their latest output.

    Args:
        collectors: the collectors; unavailable ones are reported once and never scheduled.
        interval_s: default seconds between runs of each collector.
        on_samples: called with (collector name, Collection) after each run; returns the
            number of samples it dropped (counted in kvscope_collector_dropped_samples_total).
        intervals: per-collector overrides, name → seconds.
        clock: monotonic ns clock.
        anchor: converts monotonic to epoch time for the last-success timestamp.
        on_demand: run collectors when `refresh()` asks (and every `idle_interval_s`) instead
            of every interval.
        idle_interval_s: with `on_demand`, the longest time between two runs of a collector.
        inline_max_s: with `on_demand`, a collector whose last run took at most this long
            runs on the thread that calls `refresh()`; a slower one on its own thread.
    """

    def __init__(
        self,
        collectors: Iterable[BaseCollector],
        interval_s: float = 1.0,
        *,
        on_samples: OnSamples | None = None,
        intervals: dict[str, float] | None = None,
        clock: Callable[[], int] = now_ns,
        anchor: ClockAnchor | None = None,
        on_demand: bool = False,
        idle_interval_s: float = 60.0,
        inline_max_s: float = 0.05,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0 seconds, got {interval_s}")
        if not idle_interval_s > 0:
            raise ValueError(f"idle_interval_s: must be > 0 seconds, got {idle_interval_s}")
        all_c = list(collectors)
        names = [c.name for c in all_c]
        if len(set(names)) != len(names):
            raise ValueError(f"collectors: duplicate names in {names}")
        self.intervals: dict[str, float] = {c.name: interval_s for c in all_c}
        for name, s in (intervals or {}).items():
            if name not in self.intervals:
                raise ValueError(f"intervals: unknown collector {name!r}; expected one of "
                                 f"{sorted(self.intervals)}")
            if not s > 0:
                raise ValueError(f"intervals[{name!r}]: must be > 0 seconds, got {s}")
            self.intervals[name] = s
        self.collectors = [c for c in all_c if c.available]
        if on_samples is None:  # nothing takes samples: collectors build readings only
            for c in self.collectors:
                c.keep_samples = False
        self.unavailable = [c for c in all_c if not c.available]
        self.on_samples = on_samples
        self.clock = clock
        self.anchor = anchor or process_anchor()
        self.health: dict[str, CollectorHealth] = {c.name: CollectorHealth()
                                                   for c in self.collectors}
        self._latest: dict[str, Collection] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._announced = False
        self._sink_failed_logged = False
        self._fail_logged: set[str] = set()
        self.on_demand = on_demand
        self.idle_interval_s = idle_interval_s
        self.inline_max_s = inline_max_s
        self._demand: dict[str, _Demand] = {c.name: _Demand() for c in self.collectors}
        #: collector → (the reading names of its last collection, how to group them)
        self._layouts: dict[str, tuple[tuple[str, ...], list[Any]]] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start one daemon thread per available collector (the first run is immediate)."""
        if self._threads:
            raise RuntimeError("CollectorRunner already started")
        self.announce_unavailable()
        self._stop.clear()
        loop = self._demand_loop if self.on_demand else self._loop
        for c in self.collectors:
            t = threading.Thread(target=loop, args=(c,), name=f"kvscope-collector-{c.name}",
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the threads (a run in progress finishes first) and close the collectors."""
        self._stop.set()
        for d in self._demand.values():
            with d.cond:
                d.cond.notify_all()
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():
                log.warning("kvscope collectors: %s did not stop within %.1f s", t.name, timeout_s)
        self._threads = []
        for c in self.collectors:
            try:
                c.close()
            except Exception:
                log.warning("kvscope collectors: closing collector %s failed", c.name,
                            exc_info=True)

    @property
    def running(self) -> bool:
        return bool(self._threads) and not self._stop.is_set()

    def announce_unavailable(self) -> None:
        """Hand the sink one `collector_unavailable` event per unavailable collector (once)."""
        if self._announced:
            return
        self._announced = True
        for c in self.unavailable:
            ts = self.clock()
            col = Collection(ts, events=[Event(ts, c.source, "collector_unavailable",
                                               {"collector": c.name,
                                                "reason": c.unavailable_reason})])
            self._deliver(c.name, col)

    def _loop(self, c: BaseCollector) -> None:
        interval_ns = int(self.intervals[c.name] * 1e9)
        h = self.health[c.name]
        deadline = self.clock()
        while not self._stop.is_set():
            self.run_once(c)
            deadline += interval_ns
            now = self.clock()
            if now >= deadline:
                skipped = (now - deadline) // interval_ns + 1
                h.missed += skipped
                deadline += skipped * interval_ns
            self._stop.wait((deadline - now) / 1e9)

    def _demand_loop(self, c: BaseCollector) -> None:
        d = self._demand[c.name]
        idle_s = self.idle_interval_s
        first = True  # the first run is immediate, as on the fixed cadence
        while not self._stop.is_set():
            with d.cond:
                while not self._stop.is_set():
                    busy = d.started > d.completed  # a scrape is running it inline
                    # The floor counts from the last run by anyone: scrapes every 15 s
                    # leave it nothing to do.
                    left = d.last_start_mono + idle_s - time.monotonic()
                    if not busy and (first or d.requested > d.started or left <= 0):
                        break
                    if busy:
                        d.waiters += 1
                        try:
                            d.cond.wait()
                        finally:
                            d.waiters -= 1
                    else:
                        # A scrape's run moves the floor later: this wait then ends early
                        # (once) and the loop waits again for the rest.
                        d.cond.wait(left)
                if self._stop.is_set():
                    return
                first = False
                d.started += 1
            self._run_counted(c, d)

    def _run_counted(self, c: BaseCollector, d: _Demand) -> None:
        try:
            self.run_once(c)
        finally:
            with d.cond:
                d.completed += 1
                if d.waiters:
                    d.cond.notify_all()

    def refresh(self, max_age_s: float, timeout_s: float = 1.0) -> None:
        """With `on_demand`: have every collector whose last run started more than
        `max_age_s` ago run now, and return once they have (a run in progress counts), or
        after `timeout_s`. A collector whose last run took at most `inline_max_s` runs on the
        calling thread (no thread hand-off); a slower one on its own thread, waited for at
        most `timeout_s` in all. Without `on_demand`, or before `start()`, it does nothing."""
        if not self.on_demand or not self._threads or self._stop.is_set():
            return
        now = self.clock()
        max_age_ns = int(max_age_s * 1e9)
        inline: list[BaseCollector] = []
        waiting: list[tuple[_Demand, int]] = []
        for c in self.collectors:
            d = self._demand[c.name]
            with d.cond:
                if d.started > d.completed:  # in progress: its reading is at most that old
                    waiting.append((d, d.started))
                elif now - d.last_start_ns > max_age_ns:
                    last = self.health[c.name].last_duration_s
                    if last is not None and last <= self.inline_max_s:
                        d.started += 1  # ours: its thread waits until we are done
                        inline.append(c)
                    else:
                        want = d.started + 1
                        d.requested = max(d.requested, want)
                        d.cond.notify_all()
                        waiting.append((d, want))
        for c in inline:
            self._run_counted(c, self._demand[c.name])
        end = time.monotonic() + timeout_s
        for d, want in waiting:
            with d.cond:
                while d.completed < want and not self._stop.is_set():
                    left = end - time.monotonic()
                    if left <= 0:
                        return
                    d.waiters += 1
                    try:
                        d.cond.wait(left)
                    finally:
                        d.waiters -= 1

    # ------------------------------------------------------------------ one run
    def run_once(self, c: BaseCollector) -> Collection | None:
        """Run `c` once on the calling thread: time it, keep its output, hand it to the sink."""
        h = self.health[c.name]
        t0 = self.clock()
        d = self._demand.get(c.name)
        if d is not None:
            d.last_start_ns = t0
            d.last_start_mono = time.monotonic()
        try:
            col = c.collect()
        except Exception as exc:
            h.errors += 1
            h.last_duration_s = (self.clock() - t0) / 1e9
            if c.name not in self._fail_logged:
                # One line per collector until it recovers, not one per cycle. A file that
                # cannot be read or parsed is the host's doing: its message says it all; any
                # other exception is a bug and keeps its traceback (once).
                self._fail_logged.add(c.name)
                expected = isinstance(exc, OSError | ValueError)
                log.warning("kvscope collectors: collector %s failed: %s (further failures are "
                            "counted in kvscope_collector_errors_total)", c.name,
                            _describe(exc), exc_info=not expected)
            ts = self.clock()
            self._deliver(c.name, Collection(ts, events=[Event(
                ts, c.source, "collector_error", {"collector": c.name, "error": repr(exc)})]))
            return None
        t1 = self.clock()
        if c.name in self._fail_logged:
            self._fail_logged.discard(c.name)
            log.warning("kvscope collectors: collector %s recovered after %d failure(s)",
                        c.name, h.errors)
        h.runs += 1
        h.last_duration_s = (t1 - t0) / 1e9
        h.last_success_ns = t1
        self._latest[c.name] = col
        self._deliver(c.name, col)
        return col

    def collect_once(self) -> dict[str, Collection]:
        """Run every available collector once, in turn, on the calling thread (tests and
        benchmarks drive cycles back to back this way; do not mix with `start()`)."""
        self.announce_unavailable()
        out: dict[str, Collection] = {}
        for c in self.collectors:
            col = self.run_once(c)
            if col is not None:
                out[c.name] = col
        return out

    def _deliver(self, name: str, col: Collection) -> None:
        if self.on_samples is None:
            return
        try:
            dropped = self.on_samples(name, col)
        except Exception:
            dropped = len(col.samples)
            if not self._sink_failed_logged:
                self._sink_failed_logged = True
                log.warning("kvscope collectors: the sample sink failed; its samples are "
                            "counted as dropped", exc_info=True)
        if dropped and name in self.health:
            self.health[name].dropped += dropped

    def count_dropped(self, name: str, n: int) -> None:
        """Count `n` samples of collector `name` lost downstream (e.g. a failed write)."""
        h = self.health.get(name)
        if h is not None:
            h.dropped += n

    # ------------------------------------------------------------------ snapshot
    def latest(self) -> dict[str, Collection]:
        """The last successful Collection of each collector."""
        return dict(self._latest)

    def readings(self) -> dict[str, list[Reading]]:
        """Every exposed series now, grouped by metric name (collector output + health), each
        name's readings in collector order, then in the order its collector gave them."""
        out: dict[str, list[Reading]] = {}
        layouts = self._layouts
        for cname, col in list(self._latest.items()):
            rs = col.readings
            names = tuple(map(_NAME, rs))
            layout = layouts.get(cname)
            if layout is None or layout[0] != names:
                # A collector gives the same series run after run: group by positions
                # worked out once per layout, not name by name.
                layout = layouts[cname] = (names, _group_positions(names))
            for name, pick in layout[1]:
                rows = pick(rs)
                lst = out.get(name)
                if lst is None:
                    out[name] = rows
                else:
                    lst.extend(rows)
        for r in self.health_readings():
            out.setdefault(r.name, []).append(r)
        return out

    def health_readings(self) -> list[Reading]:
        """kvscope_collector_* series for every scheduled collector."""
        out: list[Reading] = []
        off = self.anchor.offset_ns
        for name, h in self.health.items():
            lab = (name,)
            if h.last_duration_s is not None:
                out.append(new_reading(("kvscope_collector_duration_seconds", lab,
                                        h.last_duration_s)))
            out.append(new_reading(("kvscope_collector_errors_total", lab, float(h.errors))))
            out.append(new_reading(("kvscope_collector_dropped_samples_total", lab,
                                        float(h.dropped))))
            if h.last_success_ns is not None:
                out.append(new_reading(("kvscope_collector_last_success_timestamp_seconds", lab,
                                        (h.last_success_ns + off) / 1e9)))
        return out


_NAME = operator.itemgetter(0)  # Reading.name


def _group_positions(names: tuple[str, ...]
                     ) -> list[tuple[str, Callable[[list[Reading]], list[Reading]]]]:
    """For readings named `names` (in order): each distinct name, first seen first, with a
    function returning that name's readings (a new list, in order) from such a list."""
    where: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        where.setdefault(n, []).append(i)
    out: list[tuple[str, Callable[[list[Reading]], list[Reading]]]] = []
    for n, idx in where.items():
        if len(idx) == 1:
            i = idx[0]
            out.append((n, lambda rs, i=i: [rs[i]]))
        elif idx == list(range(idx[0], idx[-1] + 1)):
            sl = slice(idx[0], idx[-1] + 1)
            out.append((n, lambda rs, sl=sl: rs[sl]))
        else:
            get = operator.itemgetter(*idx)
            out.append((n, lambda rs, get=get: list(get(rs))))
    return out


def _describe(exc: BaseException) -> str:
    """An exception in one line: an OSError as `PATH: reason`."""
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    return " ".join(str(exc).split()) or type(exc).__name__


def default_collectors(
    *,
    sys_root: str = "/sys",
    proc_root: str = "/proc",
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    watch: dict[str, int] | None = None,
    nvml: Any = None,
    disable: tuple[str, ...] = (),
) -> list[BaseCollector]:
    """The standard set: nvml, nic, rdma, host (minus `disable`).

    Args:
        sys_root, proc_root: where sysfs and procfs are mounted.
        include, exclude: glob patterns for network interfaces.
        watch: process label → pid for the host collector.
        nvml: the NVML binding (pynvml by default).
        disable: collector names to leave out.
    """
    from collectors.host import HostCollector
    from collectors.nic import NicCollector
    from collectors.nvml import NvmlCollector
    from collectors.rdma import RdmaCollector

    known = ("nvml", "nic", "rdma", "host")
    for d in disable:
        if d not in known:
            raise ValueError(f"disable: unknown collector {d!r}; expected one of {list(known)}")
    out: list[BaseCollector] = []
    if "nvml" not in disable:
        out.append(NvmlCollector(nvml=nvml))
    if "nic" not in disable:
        out.append(NicCollector(sys_root=sys_root, proc_root=proc_root, include=include,
                                exclude=exclude))
    if "rdma" not in disable:
        out.append(RdmaCollector(sys_root=sys_root))
    if "host" not in disable:
        out.append(HostCollector(proc_root=proc_root, watch=watch))
    return out


def recorder_sink(recorder: Any) -> OnSamples:
    """An `on_samples` that writes into an `agent.telemetry.Recorder` (its samples and events
    tables), so `kvscope run` stores hardware context in the same run store as the engine."""

    def on_samples(name: str, col: Collection) -> int:
        before = recorder.stats.dropped.get("samples", 0)
        for s in col.samples:
            recorder.sample(s.source, s.metric, s.value, entity=s.entity, unit=s.unit, t=s.ts_ns)
        for e in col.events:
            recorder.event(e.name, t=e.ts_ns, source=e.source, detail=e.detail)
        return recorder.stats.dropped.get("samples", 0) - before

    return on_samples
