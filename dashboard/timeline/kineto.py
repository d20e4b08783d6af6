"""Merging a Kineto (PyTorch profiler) Chrome trace onto the run's clock."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

from agent.errors import InputError
from dashboard.timeline.base import Clock, Event


def load_kineto(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """The events of a Kineto (PyTorch profiler) Chrome trace and its clock base in epoch ns.

    Args:
        path: a `.json` or gzip-compressed trace (detected by content, not by name).

    Returns:
        (traceEvents, base_ns): an event's epoch ns is `base_ns + ts * 1000`; `base_ns` is
        `baseTimeNanoseconds` when the trace has it, else 0 (its `ts` are epoch µs).

    Raises:
        InputError: missing file, not JSON, or no `traceEvents` list.
    """
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(2)
        opener = gzip.open if head == b"\x1f\x8b" else open
        with opener(p, "rt", encoding="utf-8") as fh:  # type: ignore[operator]
            doc = json.load(fh)
    except FileNotFoundError:
        raise InputError(f"{p}: no such trace file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{p}: not a JSON trace ({msg})") from None
    if isinstance(doc, list):  # the JSON Array Format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise InputError(f"{p}: no 'traceEvents' list (not a Chrome/Kineto trace)")
    base = doc.get("baseTimeNanoseconds", 0)
    if not isinstance(base, int):
        try:
            base = int(base)
        except (TypeError, ValueError):
            raise InputError(f"{p}: baseTimeNanoseconds must be an integer, got {base!r}"
                             ) from None
    return doc["traceEvents"], base


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
