"""Merging a Kineto (PyTorch profiler) Chrome trace onto the run's clock.

Reading the file is the importer's (`analyzers.importers.kineto.read_trace`, the one reader of
the format); this module only moves its events onto the kvscope trace's clock.
"""

from __future__ import annotations

import math
import os
from typing import Any

from agent.errors import InputError
from analyzers.importers.kineto import read_trace
from dashboard.timeline.base import Clock, Event


def load_kineto(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """The events of a Kineto (PyTorch profiler) Chrome trace and its clock base in epoch ns.

    Returns:
        (traceEvents, base_ns): an event's epoch ns is `base_ns + ts * 1000`; `base_ns` is
        `baseTimeNanoseconds` when the trace has it, else 0 (its `ts` are epoch µs).

    Raises:
        InputError: as `analyzers.importers.kineto.read_trace`, and for JSON nested too deeply
            to parse.
    """
    try:
        trace = read_trace(path)
    except RecursionError:  # the standard library's parser, when orjson is not installed
        raise InputError(f"{path}: invalid JSON (nested too deeply)") from None
    return trace.events, trace.base_ns or 0


def _us_to_ns(ts: float) -> int:
    # Epoch µs do not fit a float64 at ns precision; split off the integer part first.
    whole = int(ts)
    return whole * 1000 + round((ts - whole) * 1000)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def placeable(ev: Any) -> bool:
    """Whether a trace entry can be placed on the timeline: an object that is metadata
    (`ph` M) or has a finite numeric `ts`."""
    if not isinstance(ev, dict):
        return False
    return ev.get("ph") == "M" or _number(ev.get("ts"))


def _end_ns(ev: dict[str, Any], start: int) -> int:
    dur = ev.get("dur")
    return start + (_us_to_ns(float(dur)) if _number(dur) else 0)  # no usable dur: an instant


def time_range_ns(events: list[Any], base_ns: int) -> tuple[int, int] | None:
    """[first start, last end] of the placeable timed events, in epoch ns (None: none)."""
    lo: int | None = None
    hi: int | None = None
    for ev in events:
        if not placeable(ev) or ev.get("ph") == "M":
            continue
        start = base_ns + _us_to_ns(float(ev["ts"]))
        end = _end_ns(ev, start)
        lo = start if lo is None else min(lo, start)
        hi = end if hi is None else max(hi, end)
    return None if lo is None or hi is None else (lo, hi)


def merge_events(events: list[dict[str, Any]], base_ns: int, clock: Clock) -> list[Event]:
    """`events` moved onto the kvscope trace clock and clipped to the clock's window.

    Metadata events are kept; an event is kept when its span [ts, ts + dur] meets the window.
    Entries that cannot be placed (not objects, no finite numeric `ts`; see `placeable`) are
    left out: `dashboard.timeline.trace` counts them and says so.
    """
    out = []
    for ev in events:
        if not placeable(ev):
            continue
        if ev.get("ph") == "M":
            out.append({k: v for k, v in ev.items() if k != "ts"})
            continue
        start = base_ns + _us_to_ns(float(ev["ts"]))
        end = _end_ns(ev, start)
        if end < clock.lo_ns or start > clock.hi_ns:
            continue
        out.append({**ev, "ts": (start - clock.origin_ns) / 1000.0})
    return out
