"""Merging a Kineto (PyTorch profiler) Chrome trace onto the run's clock.

Reading the file is the importer's (`analyzers.importers.kineto.read_trace`, the one reader of
the format); this module only moves its events onto the kvscope trace's clock.
"""

from __future__ import annotations

import os
from typing import Any

from analyzers.importers.kineto import read_trace
from dashboard.timeline.base import Clock, Event


def load_kineto(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """The events of a Kineto (PyTorch profiler) Chrome trace and its clock base in epoch ns.

    Returns:
        (traceEvents, base_ns): an event's epoch ns is `base_ns + ts * 1000`; `base_ns` is
        `baseTimeNanoseconds` when the trace has it, else 0 (its `ts` are epoch µs).

    Raises:
        InputError: as `analyzers.importers.kineto.read_trace`.
    """
    trace = read_trace(path)
    return trace.events, trace.base_ns or 0


def _us_to_ns(ts: float) -> int:
    # Epoch µs do not fit a float64 at ns precision; split off the integer part first.
    whole = int(ts)
    return whole * 1000 + round((ts - whole) * 1000)


def merge_events(events: list[dict[str, Any]], base_ns: int, clock: Clock) -> list[Event]:
    """`events` moved onto the kvscope trace clock and clipped to the clock's window.

    Metadata events are kept; an event is kept when its span [ts, ts + dur] meets the window.
    """
    out = []
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ts = ev.get("ts")
        if ev.get("ph") == "M" or not isinstance(ts, (int, float)):
            if ev.get("ph") == "M":
                out.append({k: v for k, v in ev.items() if k != "ts"})
            continue
        start = base_ns + _us_to_ns(float(ts))
        dur = ev.get("dur", 0)
        end = start + (_us_to_ns(float(dur)) if isinstance(dur, (int, float)) else 0)
        if end < clock.lo_ns or start > clock.hi_ns:
            continue
        out.append({**ev, "ts": (start - clock.origin_ns) / 1000.0})
    return out
