"""What every collector shares: the records it returns and the counter arithmetic.

A collector's `collect()` returns one `Collection`:

- `readings`: what Prometheus and OTLP expose, named by the catalogue (`agent.schema`) with label
  values in catalogue order. Counters carry a *monotonic* total: raw kernel/driver counters are
  extended across 32/64-bit wraps and resets, so a scrape never sees a counter go backwards
  because of the hardware (before any wrap the total equals the raw value).
- `samples`: rows for the run store's `samples` table (gauges as read; counters as per-second
  rates from deltas, because a raw counter means nothing without its neighbour).
- `events`: rows for the `events` table (a GPU lost, an interface that vanished, an XID).

Times are `agent.clock.now_ns()` (monotonic); exporters convert to epoch ns with the process
anchor.
"""

from __future__ import annotations

import fnmatch
import operator
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, cast

from agent.schema import METRICS_BY_NAME, MetricSpec

_PREFIX = "kvscope_"


class Reading(NamedTuple):
    """One exposed series: a catalogued metric name, its label values in order, the value."""

    name: str
    labels: tuple[str, ...]
    value: float


class Sample(NamedTuple):
    """One row of the run store's `samples` table (ts_ns monotonic until exported)."""

    ts_ns: int
    source: str
    entity: str | None
    metric: str
    value: float
    unit: str | None


class Event(NamedTuple):
    """One row of the run store's `events` table; `detail` becomes JSON text."""

    ts_ns: int
    source: str
    name: str
    detail: dict[str, Any] | None


#: `Reading((name, labels, value))` and `Sample((ts, ...))`, built as the NamedTuple
#: constructors build them (`tuple.__new__` of the class) without their Python-level
#: `__new__`: collectors make dozens a second.
new_reading = cast("Callable[[tuple[str, tuple[str, ...], float]], Reading]",
                   partial(tuple.__new__, Reading))
new_sample = cast("Callable[[tuple[int, str, str | None, str, float, str | None]], Sample]",
                  partial(tuple.__new__, Sample))


@dataclass(slots=True)
class Collection:
    """What one run of one collector produced."""

    ts_ns: int
    readings: list[Reading] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


def sample_metric(name: str) -> str:
    """The `samples.metric` value for a catalogued metric: no prefix; counters become rates."""
    short = name.removeprefix(_PREFIX)
    if short.endswith("_total"):
        return short[: -len("_total")] + "_per_second"
    return short


def sample_unit(s: MetricSpec) -> str | None:
    """The `samples.unit` value: the catalogue unit, `<unit>_per_second` for counter rates."""
    if s.type == "counter":
        return f"{s.unit}_per_second" if s.unit else "per_second"
    return s.unit or None


def _sample_naming() -> dict[str, tuple[str, str | None]]:
    return {m.name: (sample_metric(m.name), sample_unit(m)) for m in METRICS_BY_NAME.values()}


#: Catalogued name → (samples.metric, samples.unit), computed once (collectors run every second).
SAMPLE_NAMING: dict[str, tuple[str, str | None]] = _sample_naming()


class CounterTracker:
    """Turns raw counters into monotonic totals and per-second rates.

    A raw value below the previous one is either a wrap or a reset. The counter's width is
    inferred from the previous value (below 2**32: a 32-bit counter, else 64-bit): when the
    wrapped delta is under half the range it is a wrap, otherwise a reset, and the increase is
    the new raw value (Prometheus' reset rule). A reset from high in a 32-bit range is
    indistinguishable from a wrap; both are rare and the error is bounded by the wrapped delta.

    Keys not updated during a cycle are forgotten by `end_cycle()`, so an entity that vanishes
    and comes back starts a new baseline instead of producing a bogus delta.
    """

    __slots__ = ("_gen", "_state")

    def __init__(self) -> None:
        # key -> [last raw, total, last ts_ns, generation]
        self._state: dict[Hashable, list[Any]] = {}
        self._gen = 0

    def update(self, key: Hashable, raw: float, ts_ns: int) -> tuple[float, float | None]:
        """Record `raw` at `ts_ns`.

        Args:
            key: identifies the counter (metric and entity).
            raw: the value as the kernel or driver reports it.
            ts_ns: monotonic time of the read.

        Returns:
            (monotonic total, per-second rate or None on the first read / a zero interval).
        """
        st = self._state.get(key)
        if st is None:
            self._state[key] = [raw, raw, ts_ns, self._gen]
            return raw, None
        last, total, last_ts, _ = st
        delta = raw - last
        if delta < 0:
            delta = _wrapped_delta(last, raw)
        total += delta
        dt = ts_ns - last_ts
        st[0] = raw
        st[1] = total
        st[2] = ts_ns
        st[3] = self._gen
        return total, (delta * 1e9 / dt if dt > 0 else None)

    def update_row(self, key: Hashable, raws: list[int], ts_ns: int
                   ) -> tuple[list[float], list[float] | None]:
        """`update` of several counters read together (one entity's), kept under one key:
        element i follows the same rules as `update` of a counter of its own.

        Returns:
            (monotonic totals, per-second rates or None on the first read / a zero interval).
        """
        st, deltas, dt = self._advance_row(key, raws, ts_ns)
        rates = [d * 1e9 / dt for d in deltas] if deltas is not None and dt > 0 else None
        return list(st[1]), rates

    def _advance_row(self, key: Hashable, raws: list[int], ts_ns: int
                     ) -> tuple[list[Any], list[Any] | None, int]:
        """The row's state [raws, totals, ts, generation, last readings] after `raws`, its
        deltas (None on the first read) and the interval in ns."""
        st = self._state.get(key)
        if st is None or len(st[0]) != len(raws):
            st = self._state[key] = [list(raws), list(raws), ts_ns, self._gen, None]
            return st, None, 0
        last = st[0]
        # Element-wise in C (the lengths are equal: checked above, and totals are as long).
        deltas = list(map(operator.sub, raws, last))
        if min(deltas, default=0) < 0:
            for i, d in enumerate(deltas):
                if d < 0:
                    deltas[i] = _wrapped_delta(last[i], raws[i])
        st[1] = list(map(operator.add, st[1], deltas))
        dt = ts_ns - st[2]
        st[0] = list(raws)
        st[2] = ts_ns
        st[3] = self._gen
        return st, deltas, dt

    def end_cycle(self) -> list[Hashable]:
        """Forget counters not updated since the previous call; returns their keys."""
        gen = self._gen
        gone = [k for k, st in self._state.items() if st[3] != gen]
        for k in gone:
            del self._state[k]
        self._gen = gen + 1
        return gone

    def __len__(self) -> int:
        return len(self._state)


def _wrapped_delta(last: float, raw: float) -> float:
    if isinstance(last, float) or isinstance(raw, float):
        return raw  # float counters (CPU seconds) do not wrap: a decrease is a reset
    bits = 32 if last < (1 << 32) else 64
    wrapped = raw + (1 << bits) - last
    return wrapped if wrapped < (1 << (bits - 1)) else raw


class Emitter:
    """Builds one `Collection` so collectors only say what they read.

    Args:
        source: the `samples.source` value (nvml, nic, rdma, host).
        ts_ns: monotonic time of this run.
        counters: the collector's `CounterTracker` (state across runs).
        samples: build `samples` rows (False when no sink takes them: the counters are still
            followed, so totals stay monotonic and the first rates after a change are right).
    """

    __slots__ = ("counters", "keep", "out", "source", "ts")

    def __init__(self, source: str, ts_ns: int, counters: CounterTracker,
                 samples: bool = True) -> None:
        self.source = source
        self.ts = ts_ns
        self.counters = counters
        self.keep = samples  # False: readings only (nothing downstream stores samples)
        self.out = Collection(ts_ns)

    def gauge(self, name: str, labels: tuple[str, ...], value: float, entity: str | None,
              metric: str | None = None) -> None:
        """A catalogued gauge; `metric` overrides the sample's metric name."""
        value = float(value)
        self.out.readings.append(new_reading((name, labels, value)))
        if self.keep:
            short, unit = SAMPLE_NAMING[name]
            self.out.samples.append(new_sample((self.ts, self.source, entity, metric or short,
                                               value, unit)))

    def counter(self, name: str, labels: tuple[str, ...], raw: float, entity: str | None,
                scale: float = 1.0) -> None:
        """A catalogued counter from a raw reading; `scale` converts to base units (RDMA x4)."""
        total, rate = self.counters.update((name, labels), raw, self.ts)
        self.out.readings.append(new_reading((name, labels, total * scale)))
        if rate is not None and self.keep:
            short, unit = SAMPLE_NAMING[name]
            self.out.samples.append(new_sample((self.ts, self.source, entity, short,
                                               rate * scale, unit)))

    def counter_row(self, names: tuple[str, ...], labels: tuple[str, ...], raws: list[int],
                    entity: str | None) -> None:
        """`counter` of each catalogued counter in `names` from its raw reading in `raws`
        (one entity's, e.g. an interface's eight): the same readings and samples, in order.
        A counter that did not move keeps its last `Reading` object (the renderer's
        unchanged-family check is then an identity test); a row none of whose counters
        moved (an idle interface) keeps its state and readings as they are."""
        counters = self.counters
        key = (names, labels)
        st = counters._state.get(key)
        ts = self.ts
        if st is not None and st[4] is not None and st[0] == raws:
            # Nothing moved: every delta is 0 (what `_advance_row` would compute), so the
            # totals and readings stand; only the time and generation advance.
            dt = ts - st[2]
            st[2] = ts
            st[3] = counters._gen
            rows = st[4]
            self.out.readings.extend(rows)
            if dt > 0 and self.keep:
                source, add = self.source, self.out.samples.append
                for name in names:
                    short, unit = SAMPLE_NAMING[name]
                    add(new_sample((ts, source, entity, short, 0.0, unit)))
            return
        st, deltas, dt = counters._advance_row(key, raws, ts)
        totals = st[1]
        prev = st[4]
        if prev is None or deltas is None:
            rows = [new_reading((n, labels, float(t)))
                    for n, t in zip(names, totals, strict=True)]
        else:
            rows = [p if d == 0 else new_reading((n, labels, float(t)))
                    for p, d, n, t in zip(prev, deltas, names, totals, strict=True)]
        st[4] = rows
        self.out.readings.extend(rows)
        if deltas is not None and dt > 0 and self.keep:
            source, add = self.source, self.out.samples.append
            for name, d in zip(names, deltas, strict=True):
                short, unit = SAMPLE_NAMING[name]
                add(new_sample((ts, source, entity, short, d * 1e9 / dt * 1.0, unit)))

    def rate(self, key: Hashable, raw: float, entity: str | None, metric: str,
             unit: str | None, scale: float = 1.0) -> float | None:
        """A rate sample from a raw counter without an exposed series; returns the rate."""
        _, r = self.counters.update(key, raw, self.ts)
        if r is not None:
            if self.keep:
                self.out.samples.append(new_sample((self.ts, self.source, entity, metric,
                                                    r * scale, unit)))
            return r * scale
        return None

    def reading(self, name: str, labels: tuple[str, ...], value: float) -> None:
        """An exposed series with no sample (e.g. XID counts, already recorded as events)."""
        self.out.readings.append(new_reading((name, labels, float(value))))

    def event(self, name: str, detail: dict[str, Any] | None = None) -> None:
        self.out.events.append(Event(self.ts, self.source, name, detail))


class BaseCollector(ABC):
    """The interface the runner drives.

    Attributes:
        name: the collector's name in health metrics and logs.
        source: the `samples.source` value.
        available: False when the collector cannot run on this host (no NVIDIA driver, no RDMA
            devices); the runner then records `unavailable_reason` once and never schedules it.
    """

    name: str = "base"
    source: str = "agent"
    #: Build `samples` rows (a runner with no sink turns this off for its collectors).
    keep_samples: bool = True

    def __init__(self) -> None:
        self.available = True
        self.unavailable_reason: str | None = None

    @abstractmethod
    def collect(self) -> Collection:
        """Read the hardware once. May raise; the runner counts the failure and carries on."""

    def close(self) -> None:  # noqa: B027 - optional hook: most collectors hold no handles
        """Release handles (NVML, event sets)."""


@dataclass(slots=True, frozen=True)
class NameFilter:
    """Glob include/exclude patterns (`eth*`, `mlx5_?`); exclude wins; no includes = all."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __call__(self, name: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    def filter(self, names: Iterable[str]) -> list[str]:
        return sorted(n for n in names if self(n))


def read_text(path: str) -> str:
    """A sysfs/procfs file through raw syscalls (much cheaper than `open()`), read to EOF:
    procfs may return a file in pieces (/proc/net/dev on a node with hundreds of veths)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(fd)


def read_int(path: str) -> int:
    return int(read_text(path))
