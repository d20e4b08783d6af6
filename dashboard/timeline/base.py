"""The trace clock, the time window and the process ids every part of the trace shares."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from agent.errors import InputError
from analyzers import timebase

if TYPE_CHECKING:
    from agent.runstore.reader import RunStore

# kvscope's pids sit above Linux's pid_max (2**22) so that merged traces' pids (real process
# ids, GPU ordinals) never collide with them.
PID_REQUESTS = 10_000_001
PID_ENGINE = 10_000_002
PID_TRANSFERS = 10_000_003
PID_COUNTERS = 10_000_004
#: Merged Nsight Systems files get pids from here on, a block of `PID_MERGE_STRIDE` each.
PID_MERGE_BASE = 10_000_100
PID_MERGE_STRIDE = 10
TID_STEPS = 1
TID_EVENTS = 2

#: The run's own processes: (pid, name), in display order.
PROCESSES: tuple[tuple[int, str], ...] = (
    (PID_REQUESTS, "kvscope requests"),
    (PID_ENGINE, "kvscope engine"),
    (PID_TRANSFERS, "kvscope transfers"),
    (PID_COUNTERS, "kvscope counters"),
)

#: A thread's metadata: (pid, tid, name, sort index).
Track = tuple[int, int, str, int]
Event = dict[str, Any]


@dataclass(slots=True, frozen=True)
class Window:
    """A time window in seconds relative to the run's start; None is open-ended."""

    start_s: float | None = None
    end_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("start_s", "end_s"):
            v = getattr(self, name)
            if v is not None and (not np.isfinite(v) or v < 0):
                raise InputError(f"--window {name}: must be a finite number >= 0, got {v}")
        if self.start_s is not None and self.end_s is not None and self.end_s <= self.start_s:
            raise InputError(f"--window: end {self.end_s} must be after start {self.start_s}")

    @classmethod
    def parse(cls, text: str) -> Window:
        """`START:END` in seconds; either side may be empty (`:5`, `2.5:`)."""
        if text.count(":") != 1:
            raise InputError(f"--window {text!r}: expected START:END in seconds, e.g. 1.5:4")
        lo, hi = text.split(":")
        try:
            start = float(lo) if lo.strip() else None
            end = float(hi) if hi.strip() else None
        except ValueError:
            raise InputError(f"--window {text!r}: START and END must be numbers of seconds"
                             ) from None
        return cls(start, end)

    def bounds_ns(self, origin_ns: int) -> tuple[int, int]:
        """The window as [lo, hi] epoch ns (open ends become the int64 extremes)."""
        lo = origin_ns + round(self.start_s * 1e9) if self.start_s is not None else -(2**63)
        hi = origin_ns + round(self.end_s * 1e9) if self.end_s is not None else 2**63 - 1
        return lo, hi


@dataclass(slots=True, frozen=True)
class Clock:
    """The trace clock: `ts` = µs since `origin_ns`; only what meets [lo_ns, hi_ns] is kept."""

    origin_ns: int
    lo_ns: int
    hi_ns: int

    def us(self, ns: np.ndarray) -> np.ndarray:
        """Epoch ns → µs since the origin (float64; exact to the ns for runs under ~100 days).

        Relative times keep the ns precision that absolute epoch µs would lose in a float64.
        """
        return (np.asarray(ns).astype(np.int64) - np.int64(self.origin_ns)) / 1000.0

    def overlaps(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Mask of the spans [start, end] (epoch ns) that meet the window."""
        return (end >= self.lo_ns) & (start <= self.hi_ns)


def run_origin_ns(run: RunStore) -> int:
    """The trace's time origin: the run's start (`analyzers.timebase`, the one time base)."""
    return timebase.run_origin_ns(run.meta, run)


def present(v: Any) -> bool:
    """Not null: None, pandas' NA and NaN all mean "not applicable" in the run store."""
    return v is not None and v is not pd.NA and v == v


def metadata(processes: Iterable[tuple[int, str]], tracks: Iterable[Track]) -> list[Event]:
    """`process_name`/`thread_name` and sort-index `M` events; processes sort in given order."""
    out: list[Event] = []
    for i, (pid, name) in enumerate(processes):
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": i}})
    for pid, tid, name, sort in tracks:
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": name}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": sort}})
    return out
