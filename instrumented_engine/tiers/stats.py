"""Plain counters kept by every tier component (no metrics library: exporters read these)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from agent.schema import TRANSFER_BUCKETS_S

#: Upper bounds (ns) of the latency histogram buckets: the catalogue's transfer buckets.
LATENCY_BUCKETS_NS: tuple[int, ...] = tuple(int(b * 1e9) for b in TRANSFER_BUCKETS_S)


@dataclass(slots=True)
class LatencyHistogram:
    """A running histogram of op latencies (Prometheus-style cumulative on export).

    `counts[i]` holds observations <= `LATENCY_BUCKETS_NS[i]` and above the previous bound;
    the last entry holds everything above the largest bound (+Inf).
    """

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_NS) + 1))
    sum_ns: int = 0
    count: int = 0

    def observe(self, ns: int) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_NS, ns)] += 1
        self.sum_ns += ns
        self.count += 1


class OpStats:
    """Counters of one component: ops, bytes, failures by reason, latencies by op. Any thread.

    Attributes:
        ops: completed operations by op name (lookup, read, write, ...).
        failures: failed operations by reason (agent.schema.LOAD_FAIL_REASONS where it applies).
        counters: everything else by name (bytes_read, bytes_written, late_completions, ...).
        latency: a histogram per op name.
        outcomes: operations by (op, outcome), one per caller-visible operation whatever its
            retries (`ok` or the failure reason); cumulative, so a reader may publish them as
            absolute counter values.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        self.latency: dict[str, LatencyHistogram] = {}
        self.outcomes: dict[tuple[str, str], int] = {}

    def op(self, name: str, ns: int) -> None:
        with self._lock:
            self.ops[name] = self.ops.get(name, 0) + 1
            h = self.latency.get(name)
            if h is None:
                h = self.latency[name] = LatencyHistogram()
            h.observe(ns)

    def fail(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + n

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def outcome(self, op: str, outcome: str) -> None:
        """Count one finished operation `op` by its outcome."""
        with self._lock:
            key = (op, outcome)
            self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def outcome_counts(self) -> dict[tuple[str, str], int]:
        """A copy of the operations by (op, outcome)."""
        with self._lock:
            return dict(self.outcomes)

    def get(self, name: str) -> int:
        return self.counters.get(name, 0)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Copies of ops, failures and counters."""
        with self._lock:
            return {"ops": dict(self.ops), "failures": dict(self.failures),
                    "counters": dict(self.counters)}
