"""A run store as a Chrome / Perfetto trace (JSON Trace Event Format) for postmortems.

Layout (open the file in https://ui.perfetto.dev or chrome://tracing):

- process "kvscope requests": one thread per request (thread name = request id, ordered by
  arrival); its state spans (the TTFT stages, then decode) are complete `X` events, which never
  overlap on one thread because the states partition the request's life. A `first_token`
  instant marks the end of TTFT.
- process "kvscope engine": thread "steps" holds the step phases (`X`), thread "events" the
  discrete events (eviction, preemption, fault, ...) as instants.
- process "kvscope transfers": activity spans (KV transfers, stores, tier lookups) as async
  `b`/`e` pairs, since transfers overlap freely; one thread per tier. Each pair has its own id;
  `args.transfer_id` is the run store's transfer id.
- flows (`s` -> `f`, category `kvscope.waits_on`) from a transfer to every request state span
  that lists the transfer in `waits_on`; the `s` sits at the transfer's start on its tier thread,
  the `f` (binding point "enclosing slice") in the middle of the waiting state span.
  NOTE: viewers bind a v1 flow's `s` to a *thread* slice; async transfer slices are not one, so
  a viewer may draw the arrow from the tier thread's track or drop it. Not checked in a real
  viewer yet; if arrows are missing, lay transfers out as `X` slices on non-overlapping lanes.
- process "kvscope counters": every collector series (NVML, NIC, RDMA, host, block pool, agent)
  as `C` counter events, one counter per (source, metric), one series per entity.

Clock: `ts` is in microseconds (floats with ns precision) since `otherData.origin_epoch_ns`,
the run's start (run.json `start_ns`, or the earliest recorded time when that is earlier).
Relative times keep ns precision that absolute epoch microseconds would lose in a float64.
Merged traces (`merge=`) are moved onto the same clock: a Kineto trace's `ts` is µs relative
to `baseTimeNanoseconds` when present, else µs since the Unix epoch.

kvscope's processes use pids above Linux's pid_max (2**22) so that the pids of merged traces
(real process ids, GPU device ordinals) never collide with them.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from agent.errors import InputError

if TYPE_CHECKING:
    from agent.runstore import RunStore

PID_REQUESTS = 10_000_001
PID_ENGINE = 10_000_002
PID_TRANSFERS = 10_000_003
PID_COUNTERS = 10_000_004
TID_STEPS = 1
TID_EVENTS = 2
#: Transfer threads by tier; activity spans without a tier go on the last one.
TRANSFER_TIDS: dict[str, int] = {"device": 1, "host": 2, "remote": 3, "": 4}

_PROCESSES: tuple[tuple[int, str], ...] = (
    (PID_REQUESTS, "kvscope requests"),
    (PID_ENGINE, "kvscope engine"),
    (PID_TRANSFERS, "kvscope transfers"),
    (PID_COUNTERS, "kvscope counters"),
)


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


def run_origin_ns(run: RunStore) -> int:
    """The trace's time origin: the run's start, or the earliest recorded time if earlier."""
    candidates: list[int] = []
    start = run.meta.get("start_ns")
    if isinstance(start, int):
        candidates.append(start)
    for table, col in (("requests", "arrival_ns"), ("spans", "start_ns"),
                       ("samples", "ts_ns"), ("events", "ts_ns")):
        t = run.tables[table]
        if t.num_rows:
            candidates.append(int(np.min(t[col].to_numpy())))
    if not candidates:
        raise InputError(f"{run.path}: run.json has no start_ns and the run holds no rows")
    return min(candidates)


def _us(ns: np.ndarray, origin_ns: int) -> np.ndarray:
    """Epoch ns → µs since origin (float64; exact to the ns for runs under ~100 days)."""
    return (ns.astype(np.int64) - np.int64(origin_ns)) / 1000.0


def _overlaps(start: np.ndarray, end: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return (end >= lo) & (start <= hi)


def _metadata(tracks: Iterable[tuple[int, int, str, int]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, (pid, name) in enumerate(_PROCESSES):
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


def _request_tids(run: RunStore) -> dict[str, int]:
    """A thread id per request, in arrival order (requests still open at the end included)."""
    req = run.requests[["request_id", "arrival_ns"]]
    st = run.spans[run.spans["kind"] == "state"]
    first = st.groupby("request_id", sort=False)["start_ns"].min().rename("arrival_ns")
    both = pd.concat([req, first.reset_index()], ignore_index=True)
    both["arrival_ns"] = both["arrival_ns"].astype("int64")
    order = (both.groupby("request_id")["arrival_ns"].min().reset_index()
             .sort_values(["arrival_ns", "request_id"], kind="stable"))
    return {rid: i + 1 for i, rid in enumerate(order["request_id"])}


def _present(v: Any) -> bool:
    """Not null: None, pandas' NA and NaN all mean "not applicable" in the run store."""
    return v is not None and v is not pd.NA and v == v


def _requests(run: RunStore, tids: dict[str, int], origin: int, lo: int, hi: int,
              ) -> tuple[list[dict[str, Any]], list[tuple[int, int, str, int]], pd.DataFrame]:
    """Stage `X` events, first-token instants, thread metadata; and the kept state spans."""
    spans = run.spans
    st = spans[(spans["kind"] == "state") & spans["request_id"].notna()]
    s = st["start_ns"].to_numpy(np.int64)
    e = st["end_ns"].to_numpy(np.int64)
    keep = _overlaps(s, e, lo, hi)
    st = st[keep]
    s, e = s[keep], e[keep]
    ts, dur = _us(s, origin), (e - s) / 1000.0
    rids = st["request_id"].tolist()
    events: list[dict[str, Any]] = []
    # NOTE: columns go through tolist() first: iterating Arrow-backed Series is ~10x slower.
    for name, t, d, rid, waits in zip(st["name"].tolist(), ts.tolist(), dur.tolist(), rids,
                                      st["waits_on"].tolist(), strict=True):
        args: dict[str, Any] = {"request_id": rid}
        if waits is not None and len(waits):
            args["waits_on"] = [int(w) for w in waits]
        events.append({"ph": "X", "cat": "kvscope.stage", "name": name, "pid": PID_REQUESTS,
                       "tid": tids[rid], "ts": t, "dur": d, "args": args})
    req = run.requests
    ft = req[req["first_token_ns"].notna()]
    ftn = ft["first_token_ns"].to_numpy(np.int64)
    inw = (ftn >= lo) & (ftn <= hi)
    ft = ft[inw]
    ttft_ms = (ftn[inw] - ft["arrival_ns"].to_numpy(np.int64)) / 1e6
    for rid, t, ttft in zip(ft["request_id"].tolist(), _us(ftn[inw], origin).tolist(),
                            ttft_ms.tolist(), strict=True):
        events.append({"ph": "i", "s": "t", "cat": "kvscope.request", "name": "first_token",
                       "pid": PID_REQUESTS, "tid": tids[rid], "ts": t,
                       "args": {"request_id": rid, "ttft_ms": ttft}})
    shown = set(rids) | set(ft["request_id"].tolist())
    tracks = [(PID_REQUESTS, tids[r], r, tids[r]) for r in sorted(shown, key=tids.__getitem__)]
    return events, tracks, st


def _steps(run: RunStore, origin: int, lo: int, hi: int) -> list[dict[str, Any]]:
    sp = run.spans[run.spans["kind"] == "step"]
    s, e = sp["start_ns"].to_numpy(np.int64), sp["end_ns"].to_numpy(np.int64)
    keep = _overlaps(s, e, lo, hi)
    sp, s, e = sp[keep], s[keep], e[keep]
    out = []
    for name, t, d, step, batch, tok in zip(
            sp["name"].tolist(), _us(s, origin).tolist(), ((e - s) / 1000.0).tolist(),
            sp["step_id"].tolist(), sp["batch_requests"].tolist(), sp["tokens"].tolist(),
            strict=True):
        args = {k: int(v) for k, v in (("step_id", step), ("batch_requests", batch),
                                       ("tokens", tok)) if _present(v)}
        out.append({"ph": "X", "cat": "kvscope.step", "name": name, "pid": PID_ENGINE,
                    "tid": TID_STEPS, "ts": t, "dur": d, "args": args})
    return out


def _transfers(run: RunStore, origin: int, lo: int, hi: int, waiting: pd.DataFrame,
               tids: dict[str, int]) -> list[dict[str, Any]]:
    """Async transfer pairs, plus a flow from each transfer to each state that waited on it."""
    sp = run.spans
    act = sp[sp["kind"] == "activity"]
    s, e = act["start_ns"].to_numpy(np.int64), act["end_ns"].to_numpy(np.int64)
    keep = _overlaps(s, e, lo, hi)
    act, s, e = act[keep], s[keep], e[keep]
    ts_b, ts_e = _us(s, origin), _us(e, origin)
    tiers = [TRANSFER_TIDS.get(t, TRANSFER_TIDS[""]) for t in act["tier"].fillna("").tolist()]
    out: list[dict[str, Any]] = []
    # transfer_id → (tid, start µs) of the activity spans carrying it, for the flows.
    by_transfer: dict[int, list[tuple[int, float]]] = {}
    cols = ("request_id", "tier", "layer", "tokens", "bytes", "transfer_id", "clock")
    for i, (name, tb, te, tid, *vals) in enumerate(zip(
            act["name"].tolist(), ts_b.tolist(), ts_e.tolist(), tiers,
            *(act[c].tolist() for c in cols), strict=True)):
        args: dict[str, Any] = {c: v if isinstance(v, str) else int(v)
                                for c, v in zip(cols, vals, strict=True) if _present(v)}
        aid = f"0x{i + 1:x}"
        common = {"cat": "kvscope.transfer", "name": name, "pid": PID_TRANSFERS,
                  "tid": tid, "id": aid}
        out.append({**common, "ph": "b", "ts": tb, "args": args})
        out.append({**common, "ph": "e", "ts": te})
        if "transfer_id" in args:
            by_transfer.setdefault(args["transfer_id"], []).append((tid, tb))
    flow = 0
    w = waiting[waiting["waits_on"].notna()]
    for rid, st, en, waits in zip(w["request_id"].tolist(), w["start_ns"].tolist(),
                                  w["end_ns"].tolist(), w["waits_on"].tolist(), strict=True):
        if not len(waits):
            continue
        mid = ((st + en) // 2 - origin) / 1000.0
        for w in waits:
            for tid, tb in by_transfer.get(int(w), ()):
                flow += 1
                common = {"cat": "kvscope.waits_on", "name": "waits_on", "id": flow,
                          "args": {"transfer_id": int(w), "request_id": rid}}
                out.append({**common, "ph": "s", "pid": PID_TRANSFERS, "tid": tid, "ts": tb})
                out.append({**common, "ph": "f", "bp": "e", "pid": PID_REQUESTS,
                            "tid": tids[rid], "ts": mid})
    return out


def _counters(run: RunStore, origin: int, lo: int, hi: int) -> list[dict[str, Any]]:
    sm = run.samples
    ts = sm["ts_ns"].to_numpy(np.int64)
    sm = sm[(ts >= lo) & (ts <= hi)].copy()
    if sm.empty:
        return []
    sm["entity"] = sm["entity"].fillna(sm["metric"])
    unit = sm["unit"].fillna("")
    sm["counter"] = sm["source"] + "/" + sm["metric"] + np.where(unit != "", " (" + unit + ")",
                                                                 "")
    # One C event per (counter, timestamp); each entity (GPU, NIC, pool tier) is a series.
    wide = sm.pivot_table(index=["counter", "ts_ns"], columns="entity", values="value",
                          aggfunc="last", sort=True)
    out = []
    cols = [str(c) for c in wide.columns]
    for (name, t), row in zip(wide.index.tolist(), wide.to_numpy().tolist(), strict=True):
        args = {c: v for c, v in zip(cols, row, strict=True) if v == v}
        out.append({"ph": "C", "cat": "kvscope.sample", "name": name, "pid": PID_COUNTERS,
                    "tid": 0, "ts": (int(t) - origin) / 1000.0, "args": args})
    return out


def _events(run: RunStore, tids: dict[str, int], origin: int, lo: int, hi: int,
            ) -> list[dict[str, Any]]:
    ev = run.events
    ts = ev["ts_ns"].to_numpy(np.int64)
    keep = (ts >= lo) & (ts <= hi)
    ev = ev[keep]
    out = []
    for name, src, rid, detail, t in zip(ev["name"].tolist(), ev["source"].tolist(),
                                         ev["request_id"].tolist(), ev["detail"].tolist(),
                                         _us(ts[keep], origin).tolist(), strict=True):
        args: dict[str, Any] = {"source": src}
        if _present(detail):
            args["detail"] = detail
        if _present(rid) and rid in tids:
            pid, tid = PID_REQUESTS, tids[rid]
            args["request_id"] = rid
        else:
            pid, tid = PID_ENGINE, TID_EVENTS
        out.append({"ph": "i", "s": "t", "cat": "kvscope.event", "name": name, "pid": pid,
                    "tid": tid, "ts": t, "args": args})
    return out


# ------------------------------------------------------------------------------ merging


def load_kineto(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """The events of a Kineto (PyTorch profiler) Chrome trace and its clock base in epoch ns.

    Returns:
        (traceEvents, base_ns): an event's epoch ns is `base_ns + ts * 1000`; `base_ns` is
        `baseTimeNanoseconds` when the trace has it, else 0 (its `ts` are epoch µs).
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
        raise InputError(f"{p}: not a JSON trace ({exc})") from None
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


def merge_events(events: list[dict[str, Any]], base_ns: int, origin_ns: int, lo: int, hi: int,
                 ) -> list[dict[str, Any]]:
    """`events` moved onto the kvscope trace clock and clipped to [lo, hi] epoch ns.

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
        if end < lo or start > hi:
            continue
        out.append({**ev, "ts": (start - origin_ns) / 1000.0})
    return out


# ------------------------------------------------------------------------------ the trace


def build_trace(run: RunStore, *, window: Window | None = None,
                merge: Sequence[str | os.PathLike[str]] = ()) -> dict[str, Any]:
    """The Chrome/Perfetto trace of a run (see the module docstring for the layout).

    Args:
        run: an opened run store.
        window: keep only what overlaps this window (seconds since the run's start).
        merge: Kineto traces (.json or .json.gz) to place on the same clock.

    Returns:
        `{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}`.
    """
    origin = run_origin_ns(run)
    lo, hi = (window or Window()).bounds_ns(origin)
    tids = _request_tids(run)
    req_events, tracks, states = _requests(run, tids, origin, lo, hi)
    body = req_events + _steps(run, origin, lo, hi)
    body += _transfers(run, origin, lo, hi, states, tids)
    body += _counters(run, origin, lo, hi)
    body += _events(run, tids, origin, lo, hi)
    tracks = [(PID_ENGINE, TID_STEPS, "steps", 0), (PID_ENGINE, TID_EVENTS, "events", 1),
              *((PID_TRANSFERS, tid, tier or "untiered", tid)
                for tier, tid in TRANSFER_TIDS.items()), *tracks]
    merged: list[str] = []
    for path in merge:
        evs, base = load_kineto(path)
        body += merge_events(evs, base, origin, lo, hi)
        merged.append(str(path))
    meta = [e for e in body if e["ph"] == "M"]
    timed = sorted((e for e in body if e["ph"] != "M"), key=lambda e: e["ts"])
    return {
        "traceEvents": _metadata(tracks) + meta + timed,
        "displayTimeUnit": "ns",
        "otherData": {
            "kvscope_run_id": run.meta.get("run_id"),
            "origin_epoch_ns": origin,
            "ts": "microseconds since origin_epoch_ns",
            "window_s": None if window is None else [window.start_s, window.end_s],
            "merged": merged,
            "gaps": list(run.gaps),
        },
    }


def write_trace(run_path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                window: Window | None = None,
                merge: Sequence[str | os.PathLike[str]] = ()) -> dict[str, int]:
    """Read a run directory and write its trace JSON (gzip when `out` ends in .gz).

    Returns:
        Event counts by phase (`X`, `b`, `C`, ...), for the command's summary line.
    """
    from agent.runstore import open_run

    trace = build_trace(open_run(run_path), window=window, merge=merge)
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
    return counts
