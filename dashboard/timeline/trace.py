"""Assembling the trace: the run's tracks, merged foreign traces, metadata; and writing it."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

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
from dashboard.timeline.kineto import load_kineto, merge_events
from dashboard.timeline.nsys import is_sqlite, nsys_events

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


def _merge(paths: Sequence[str | os.PathLike[str]], clock: Clock) -> _Merged:
    out = _Merged()
    for i, path in enumerate(paths):
        if merge_format(path) == "nsys":
            evs, procs, tracks, notes = nsys_events(
                path, clock, PID_MERGE_BASE + i * PID_MERGE_STRIDE)
            out.events += evs
            out.processes += procs
            out.tracks += tracks
            out.notes += notes
        else:
            evs, base = load_kineto(path)
            out.events += merge_events(evs, base, clock)
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
                requests: Sequence[str] | None = None) -> dict[str, Any]:
    """The Chrome/Perfetto trace of a run (see the package docstring for the layout).

    Args:
        run: an opened run store.
        window: keep only what overlaps this window (seconds since the run's start).
        merge: Kineto traces (.json, .json.gz) and Nsight Systems SQLite exports to place on
            the same clock; the format is detected from the content.
        requests: show only these requests (their tracks, the transfers they waited on and
            their events; steps and counters stay); InputError for an id the run lacks.

    Returns:
        `{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}`;
        `otherData.merge_notes` says what could not be aligned.
    """
    origin = run_origin_ns(run)
    if requests is not None:
        run = cast("RunStore", _Selected(run, requests))
    clock = Clock(origin, *(window or Window()).bounds_ns(origin))
    tids = run_tracks.request_tids(run)
    req_events, req_tracks, states = run_tracks.requests(run, tids, clock)
    transfer_events, transfer_tracks = run_tracks.transfers(run, clock, states, tids)
    body = req_events + run_tracks.steps(run, clock) + transfer_events
    body += run_tracks.counters(run, clock) + run_tracks.events(run, tids, clock)
    merged = _merge(merge, clock)
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
            "merge_notes": merged.notes,
            "gaps": list(run.gaps),
        },
    }


@dataclass(slots=True, frozen=True)
class TraceSummary:
    """What `write_trace` wrote: event counts by phase (`X`, `C`, ...) and merge notes."""

    counts: dict[str, int]
    notes: list[str]


def write_trace(run_path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                window: Window | None = None,
                merge: Sequence[str | os.PathLike[str]] = (),
                requests: Sequence[str] | None = None) -> TraceSummary:
    """Read a run directory and write its trace JSON (gzip when `out` ends in .gz).

    Returns:
        Event counts and merge notes, for the command's summary line.
    """
    from agent.runstore.reader import open_run

    trace = build_trace(open_run(run_path), window=window, merge=merge, requests=requests)
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
