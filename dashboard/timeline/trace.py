"""Assembling the trace: the run's tracks, merged foreign traces, metadata; and writing it."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow.compute as pc

from agent.errors import InputError
from dashboard.timeline import run_tracks
from dashboard.timeline.base import (
    PID_ENGINE,
    PID_MERGE_BASE,
    PID_MERGE_STRIDE,
    PROCESSES,
    TID_EVENTS,
    TID_STEPS,
    Clock,
    Event,
    Track,
    Window,
    metadata,
    run_origin_ns,
)
from dashboard.timeline.kineto import load_kineto, merge_events, placeable, time_range_ns
from dashboard.timeline.nsys import is_sqlite, nsys_events, nsys_time_range

if TYPE_CHECKING:
    from agent.runstore.reader import RunStore

GZIP_MAGIC = b"\x1f\x8b"


def merge_format(path: str | os.PathLike[str]) -> str:
    """What a `--merge` file holds, judged by its first bytes rather than its name.

    Returns:
        "nsys" (SQLite magic) or "kineto" (gzip magic, or text opening with `{` / `[`, which
        `load_kineto` then checks for `traceEvents`).

    Raises:
        InputError: missing or unreadable file, or neither format.
    """
    p = Path(path)
    try:
        with p.open("rb") as fh:
            head = fh.read(64)
    except FileNotFoundError:
        raise InputError(f"{p}: no such trace file") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if is_sqlite(head):
        return "nsys"
    if head.startswith(GZIP_MAGIC) or head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] in (b"{", b"["):
        return "kineto"
    raise InputError(f"{p}: not a Kineto JSON trace (.json/.json.gz) nor an Nsight Systems "
                     "SQLite export")


@dataclass(slots=True)
class _Merged:
    events: list[Event] = field(default_factory=list)
    processes: list[tuple[int, str]] = field(default_factory=list)
    tracks: list[Track] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def _shifted(clock: Clock, shift_ns: int) -> Clock:
    """The clock that places a file's times `shift_ns` later on `clock` (same window)."""
    def clamp(v: int) -> int:
        return min(max(v, _I64_MIN), _I64_MAX)

    return Clock(clock.origin_ns - shift_ns, clamp(clock.lo_ns - shift_ns),
                 clamp(clock.hi_ns - shift_ns))


def _utc(ns: int) -> str:
    try:
        t = datetime.fromtimestamp(ns // 1_000_000_000, tz=UTC)
    except (OverflowError, OSError, ValueError):  # beyond what datetime represents
        return f"{ns} ns since the epoch"
    return f"{t:%Y-%m-%d %H:%M:%S}.{ns % 1_000_000_000 // 1_000_000:03d} UTC"


def _duration(ns: int) -> str:
    s = abs(ns) / 1e9
    for unit, size in (("years", 365.25 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.1f} {unit}"
    return f"{s:.3g} s"


def run_span_ns(run: RunStore, origin_ns: int) -> tuple[int, int]:
    """The run's time window in epoch ns: from its start (`origin_ns`) to the latest of
    run.json's `end_ns` and every time it recorded."""
    end = origin_ns
    meta_end = run.meta.get("end_ns")
    if isinstance(meta_end, int) and not isinstance(meta_end, bool):
        end = max(end, meta_end)
    for table, col in (("requests", "finish_ns"), ("requests", "arrival_ns"),
                       ("spans", "end_ns"), ("samples", "ts_ns"), ("events", "ts_ns")):
        t = run.tables.get(table)
        if t is not None and t.num_rows and col in t.column_names:
            v = pc.max(t[col]).as_py()
            if isinstance(v, int):
                end = max(end, v)
    return origin_ns, end


def _kineto_notes(path: str | os.PathLike[str], events: list[Any]) -> list[str]:
    """What a Kineto file's entries leave out; InputError when none of them can be placed."""
    if not events:
        return [f"{path}: no events to merge (its traceEvents list is empty)"]
    bad = sum(not placeable(e) for e in events)
    if bad == len(events):
        raise InputError(f"{path}: traceEvents: none of its {len(events):,} entries is a trace "
                         "event (an object with a finite numeric 'ts', or metadata 'ph': 'M'); "
                         "not a Chrome/Kineto trace")
    if bad:
        return [f"{path}: {bad:,} of {len(events):,} traceEvents entries left out (not an "
                "object with a finite numeric 'ts')"]
    return []


def _placement(path: str | os.PathLike[str], span: tuple[int, int] | None,
               run_span: tuple[int, int], align: bool) -> tuple[int, list[str]]:
    """(shift in ns, notes) for a merged file whose own times cover `span` (epoch ns)."""
    if span is None:
        return 0, []
    lo, hi = span
    r_lo, r_hi = run_span
    if align:
        shift = r_lo - lo
        way = "later" if shift >= 0 else "earlier"
        return shift, [f"{path}: --align placed it {_duration(shift)} {way} than recorded, so "
                       f"that it starts at the run's start ({_utc(r_lo)})"]
    if hi >= r_lo and lo <= r_hi:
        return 0, []
    where = (f"{_duration(r_lo - hi)} before the run's start" if hi < r_lo
             else f"{_duration(lo - r_hi)} after the run's end")
    return 0, [f"{path}: does not overlap the run: recorded {_utc(lo)} to {_utc(hi)}, "
               f"{where} (the run: {_utc(r_lo)} to {_utc(r_hi)}); was it recorded with "
               "another run? --align places its first event at the run's start"]


def _merge(paths: Sequence[str | os.PathLike[str]], clock: Clock,
           run_span: tuple[int, int] | None = None, align: bool = False) -> _Merged:
    """The merged files' events on the run's clock, with notes on what could not be placed
    and on files that do not overlap the run (`run_span`); `align` moves each file so that it
    starts at the run's start."""
    out = _Merged()
    for i, path in enumerate(paths):
        nsys = merge_format(path) == "nsys"
        if nsys:
            span = nsys_time_range(path)
        else:
            evs, base = load_kineto(path)
            out.notes += _kineto_notes(path, evs)
            span = time_range_ns(evs, base)
        shift = 0
        if run_span is not None:
            shift, notes = _placement(path, span, run_span, align)
            out.notes += notes
        on = _shifted(clock, shift) if shift else clock
        if nsys:
            evs_n, procs, tracks, notes = nsys_events(
                path, on, PID_MERGE_BASE + i * PID_MERGE_STRIDE)
            out.events += evs_n
            out.processes += procs
            out.tracks += tracks
            out.notes += notes
        else:
            out.events += merge_events(evs, base, on)
    return out


class _Selected:
    """A run store narrowed to some requests: their rows, their spans, the transfers they
    waited on and their events; the engine's own tracks (steps, counters) are kept whole."""

    def __init__(self, run: RunStore, ids: Sequence[str]) -> None:
        self._run = run
        want = list(dict.fromkeys(ids))
        req = run.requests
        known = set(req["request_id"].astype(object).tolist())
        missing = [i for i in want if i not in known]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                              if len(missing) > 5 else "")
            raise InputError(f"--requests: {run.path} has no request {shown} "
                             f"({len(known):,} requests in the run)")
        sel = set(want)
        self.requests = req[req["request_id"].isin(sel)]
        sp = run.spans
        mine = sp["request_id"].isin(sel).to_numpy(bool)
        waited: set[int] = set()
        states = sp[mine & (sp["kind"] == "state").to_numpy(bool)]
        for w in states["waits_on"].tolist():
            if w is not None and len(w):
                waited.update(int(x) for x in w)
        tid = sp["transfer_id"]
        shared = ((sp["kind"] == "activity") & tid.notna()
                  & tid.isin(list(waited))).to_numpy(bool) if waited else \
            np.zeros(len(sp), bool)
        engine = (sp["kind"] == "step").to_numpy(bool)
        self.spans = sp[mine | shared | engine]
        ev = run.events
        self.events = ev[ev["request_id"].isna() | ev["request_id"].isin(sel)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)


def build_trace(run: RunStore, *, window: Window | None = None,
                merge: Sequence[str | os.PathLike[str]] = (),
                requests: Sequence[str] | None = None, align: bool = False) -> dict[str, Any]:
    """The Chrome/Perfetto trace of a run (see the package docstring for the layout).

    Args:
        run: an opened run store.
        window: keep only what overlaps this window (seconds since the run's start).
        merge: Kineto traces (.json, .json.gz) and Nsight Systems SQLite exports to place on
            the same clock; the format is detected from the content.
        requests: show only these requests (their tracks, the transfers they waited on and
            their events; steps and counters stay); InputError for an id the run lacks.
        align: move each merged file so that its first event (an nsys file: its session
            start) is at the run's start, for a profile recorded at another time.

    Returns:
        `{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}`;
        `otherData.merge_notes` says what could not be placed or aligned: entries left out,
        files that do not overlap the run's time window, files `align` moved.

    Raises:
        InputError: a merge file that cannot be read or holds no trace events.
    """
    origin = run_origin_ns(run)
    run_span = run_span_ns(run, origin)
    if requests is not None:
        run = cast("RunStore", _Selected(run, requests))
    clock = Clock(origin, *(window or Window()).bounds_ns(origin))
    tids = run_tracks.request_tids(run)
    req_events, req_tracks, states = run_tracks.requests(run, tids, clock)
    transfer_events, transfer_tracks = run_tracks.transfers(run, clock, states, tids)
    body = req_events + run_tracks.steps(run, clock) + transfer_events
    body += run_tracks.counters(run, clock) + run_tracks.events(run, tids, clock)
    merged = _merge(merge, clock, run_span, align)
    body += merged.events
    tracks = [(PID_ENGINE, TID_STEPS, "steps", 0), (PID_ENGINE, TID_EVENTS, "events", 1),
              *transfer_tracks, *req_tracks, *merged.tracks]
    meta = [e for e in body if e["ph"] == "M"]
    timed = sorted((e for e in body if e["ph"] != "M"), key=lambda e: e["ts"])
    return {
        "traceEvents": metadata([*PROCESSES, *merged.processes], tracks) + meta + timed,
        "displayTimeUnit": "ns",
        "otherData": {
            "kvscope_run_id": run.meta.get("run_id"),
            "origin_epoch_ns": origin,
            "ts": "microseconds since origin_epoch_ns",
            "window_s": None if window is None else [window.start_s, window.end_s],
            "requests": None if requests is None else list(dict.fromkeys(requests)),
            "merged": [str(p) for p in merge],
            "aligned": align,
            "merge_notes": merged.notes,
            "gaps": list(run.gaps),
        },
    }


@dataclass(slots=True, frozen=True)
class TraceSummary:
    """What `write_trace` wrote: event counts by phase (`X`, `C`, ...) and merge notes."""

    counts: dict[str, int]
    notes: list[str]


def write_trace(run_path: str | os.PathLike[str] | RunStore, out: str | os.PathLike[str], *,
                window: Window | None = None,
                merge: Sequence[str | os.PathLike[str]] = (),
                requests: Sequence[str] | None = None, align: bool = False) -> TraceSummary:
    """Read a run directory (or take an opened one) and write its trace JSON (gzip when
    `out` ends in .gz).

    Returns:
        Event counts and merge notes, for the command's summary line.
    """
    from agent.runstore.reader import RunStore, open_run

    run = run_path if isinstance(run_path, RunStore) else open_run(run_path)
    trace = build_trace(run, window=window, merge=merge, requests=requests, align=align)
    # NaN is not JSON: a null that slipped through must fail here, not in the viewer.
    text = json.dumps(trace, separators=(",", ":"), allow_nan=False)
    p = Path(out)
    if str(p).endswith(".gz"):
        with gzip.open(p, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        p.write_text(text)
    counts: dict[str, int] = {}
    for ev in trace["traceEvents"]:
        counts[ev["ph"]] = counts.get(ev["ph"], 0) + 1
    return TraceSummary(counts, list(trace["otherData"]["merge_notes"]))
