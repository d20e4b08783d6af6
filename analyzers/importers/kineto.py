"""PyTorch profiler (Kineto) Chrome-trace JSON, `.json` or `.json.gz` → stages, H2D copies, totals.

- `user_annotation` ranges named ``kvscope.<stage>#<request_num>`` (what `kvscope run --profile`
  emits, see `agent.telemetry.annotate.TorchProfilerAnnotator`) become state spans of that
  request; ``kvscope.<phase>#<step_id>`` for a step phase becomes a step span with its step id.
  The suffix is ``#`` and a decimal integer, and optional: for a bare ``kvscope.<stage>`` the
  request comes from the event's args (``request_num``/``request_id``, or a numeric first
  ``Concrete Inputs``) when the trace carries it; otherwise all such ranges belong to one
  synthetic request ``kineto-0``.
- Request ids: a trace in a run directory (`kvscope run --profile` writes
  ``<run>/profile/torch_trace.json``; ``run.json`` in the trace's folder or the one above)
  maps request_num → request_id through that run store's requests; elsewhere the id is the
  request_num as a string.
- `gpu_memcpy` events named ``Memcpy HtoD …`` become activity spans ``h2d`` with their bytes.
- Kernels, syncs, copies by direction and flows are summarised, not imported row by row.

Times: ``ts``/``dur`` are µs floats; epoch ns = ``baseTimeNanoseconds`` + ts·1000 when the trace
has a base, else ts is already epoch µs. Parsing is the cost that matters: orjson when installed,
then one pass collecting a few columns into numpy arrays, vectorised from there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.errors import InputError
from agent.schema import STATES, STEP_PHASES
from analyzers.importers.base import (
    ImportedRun,
    concat_spans,
    parse_json,
    read_bytes,
    requests_from_stage_ranges,
    spans_frame,
    us_to_ns,
)

PREFIX = "kvscope."
#: traces older than this many µs since the epoch cannot be epoch timestamps (1 day after 1970)
_EPOCH_FLOOR_US = 86_400 * 1_000_000
_REQ_KEYS = ("request_num", "request_id", "kvscope.request_num")


@dataclass(slots=True)
class KinetoTrace:
    """A Kineto / Chrome trace as read from disk.

    Attributes:
        events: the `traceEvents` list, as parsed.
        base_ns: `baseTimeNanoseconds` when the trace has one (an event's epoch ns is then
            `base_ns + ts * 1000`), else None (its `ts` are epoch µs, or relative).
    """

    events: list[Any]
    base_ns: int | None


def read_trace(path: str | os.PathLike[str]) -> KinetoTrace:
    """Read a Kineto (PyTorch profiler) or Chrome trace: the one reader of the format, used by
    the importer and by `kvscope timeline --merge`.

    Accepts the JSON Object form (``{"traceEvents": [...]}``) and Chrome's JSON Array form
    (a bare list of events), plain or gzip-compressed (detected by content, not by name).

    Raises:
        InputError: missing or unreadable file, cut or invalid JSON, no `traceEvents` list, or
            a `baseTimeNanoseconds` that is not an integer.
    """
    p = Path(path)
    doc = parse_json(read_bytes(p), p)
    if isinstance(doc, list):  # the JSON Array Format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise InputError(f"{p}: no 'traceEvents' list (not a Chrome/Kineto trace)")
    base = doc.get("baseTimeNanoseconds")
    if base is not None:
        if isinstance(base, bool) or not isinstance(base, int | float | str):
            raise InputError(f"{p}: baseTimeNanoseconds must be an integer, got {base!r}")
        try:
            base = int(base)
        except (TypeError, ValueError, OverflowError):
            raise InputError(f"{p}: baseTimeNanoseconds must be an integer, got {base!r}"
                             ) from None
    return KinetoTrace(doc["traceEvents"], base)


def load_kineto(path: Path) -> ImportedRun:
    """Import a Kineto trace.

    Args:
        path: a Chrome-trace JSON written by the PyTorch profiler, optionally gzipped.
    Returns:
        An ImportedRun with state/step spans from ``kvscope.*`` annotations, ``h2d`` activity
        spans and a `summary` of kernels, syncs, copies and flows.
    Raises:
        InputError: as `read_trace`.
    """
    trace = read_trace(path)
    events: list[Any] = trace.events
    base = trace.base_ns
    run = ImportedRun.empty("kineto", path)

    # One pass over the events for the category; everything after works on index arrays.
    cats = np.array([e.get("cat") if isinstance(e, dict) else None for e in events], dtype=object)
    phs = np.array([e.get("ph") if isinstance(e, dict) else None for e in events], dtype=object)
    complete = phs == "X"

    def pick(cat: str) -> list[dict[str, Any]]:
        return [events[i] for i in np.flatnonzero(complete & (cats == cat))]

    def times(evs: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        ts = np.array([e.get("ts", 0) for e in evs], dtype=np.float64)
        dur = np.array([e.get("dur", 0) for e in evs], dtype=np.float64)
        start = us_to_ns(ts)
        if isinstance(base, int | float):
            start = start + int(base)
        return start, start + us_to_ns(dur)

    any_ts = next((e.get("ts") for e in events
                   if isinstance(e, dict) and e.get("ph") == "X"), None)
    if base is None and any_ts is not None and float(any_ts) < _EPOCH_FLOOR_US:
        run.cannot.append("epoch times: no baseTimeNanoseconds and ts is not epoch µs; "
                          "times are relative to the trace start")

    kernels = pick("kernel")
    k_start, k_end = times(kernels)
    syncs = pick("cuda_sync")
    s_start, s_end = times(syncs)
    copies = pick("gpu_memcpy")
    run.summary = {
        "events": len(events),
        "kernels": {"count": len(kernels), "total_ns": int((k_end - k_start).sum())},
        "cuda_sync": {"count": len(syncs), "total_ns": int((s_end - s_start).sum())},
        "memcpy": _copies(copies, times),
        "flows": _flows(events, phs),
        "base_time_ns": base,
    }
    _h2d(run, copies, times)
    _annotations(run, pick("user_annotation"), times, _run_ids(path))
    run.cannot.append("token sources (hits, loads, recompute): accounting columns left <NA>")
    if run.summary["kernels"]["count"]:
        run.can.append(f"kernel summary: {len(kernels)} kernels, "
                       f"{run.summary['kernels']['total_ns']} ns")
    return run


def _copies(copies: list[dict[str, Any]], times: Any) -> dict[str, dict[str, int]]:
    if not copies:
        return {}
    start, end = times(copies)
    # "Memcpy HtoD (Pinned -> Device)" → "HtoD"
    kinds = np.array([[*str(e.get("name", "")).split(), "?", "?"][1] for e in copies],
                     dtype=object)
    nbytes = np.array([_int((e.get("args") or {}).get("bytes")) for e in copies], dtype=np.int64)
    out = {}
    for k in sorted(set(kinds)):
        m = kinds == k
        out[k] = {"count": int(m.sum()), "bytes": int(nbytes[m].clip(min=0).sum()),
                  "total_ns": int((end[m] - start[m]).sum())}
    return out


def _flows(events: list[Any], phs: np.ndarray) -> dict[str, int]:
    idx_s, idx_f = np.flatnonzero(phs == "s"), np.flatnonzero(phs == "f")
    starts = {(events[i].get("cat"), events[i].get("id")) for i in idx_s}
    ends = [(events[i].get("cat"), events[i].get("id")) for i in idx_f]
    return {"starts": len(idx_s), "finishes": len(idx_f),
            "finishes_without_start": sum(1 for k in ends if k not in starts)}


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def _h2d(run: ImportedRun, copies: list[dict[str, Any]], times: Any) -> None:
    h2d = [e for e in copies if str(e.get("name", "")).startswith("Memcpy HtoD")]
    if not h2d:
        run.cannot.append("h2d activity: no `Memcpy HtoD` events in this trace")
        return
    start, end = times(h2d)
    args = [e.get("args") or {} for e in h2d]
    nbytes = [b if (b := _int(a.get("bytes"))) >= 0 else None for a in args]
    corr = [c if (c := _int(a.get("correlation"))) >= 0 else None for a in args]
    n = len(h2d)
    run.spans = concat_spans([run.spans, spans_frame({
        "kind": ["activity"] * n, "name": ["h2d"] * n, "start_ns": start, "end_ns": end,
        "tier": ["host"] * n, "bytes": nbytes, "transfer_id": corr,
        "clock": ["cuda_event"] * n}, n)])
    run.can.append(f"h2d activity: {n} `Memcpy HtoD` copies with bytes (not linked to requests)")


def _run_ids(path: Path) -> dict[int, str]:
    """request_num → request_id from the run store the trace sits in ({} when none)."""
    for d in (path.parent, path.parent.parent):
        if (d / "run.json").is_file():
            from agent.runstore.reader import open_run

            try:
                req = open_run(d, tables=("requests",)).requests
            except (InputError, OSError):
                return {}  # not a readable run store: fall back to request_num as the id
            nums = req["request_num"].to_numpy(dtype=np.int64, na_value=-1)
            return dict(zip(nums.tolist(), req["request_id"].astype(str).tolist(), strict=True))
    return {}


def _request_of(args: dict[str, Any]) -> str | None:
    for k in _REQ_KEYS:
        if args.get(k) not in (None, ""):
            return str(args[k])
    ci = args.get("Concrete Inputs")
    if isinstance(ci, list) and ci and str(ci[0]).lstrip("-").isdigit():
        return str(ci[0])
    return None


def split_name(name: str) -> tuple[str, int | None]:
    """``kvscope.queue#12`` → ("queue", 12); ``kvscope.queue`` → ("queue", None).

    Args:
        name: a range name starting with ``kvscope.``.
    Returns:
        The stage or phase name and the integer payload (request_num or step id), None when
        the name has no ``#<integer>`` suffix.
    """
    base, sep, tail = name[len(PREFIX):].rpartition("#")
    if sep and tail.lstrip("-").isdigit():
        return base, int(tail)
    return name[len(PREFIX):], None


def _annotations(run: ImportedRun, ann: list[dict[str, Any]], times: Any,
                 ids: dict[int, str]) -> None:
    ours = [e for e in ann if str(e.get("name", "")).startswith(PREFIX)]
    if not ours:
        run.cannot.append(f"TTFT stages: no `{PREFIX}<stage>` user annotations (trace not "
                          "recorded by `kvscope run --profile`)")
        return
    parsed = [split_name(e["name"]) for e in ours]
    names = np.array([n for n, _ in parsed], dtype=object)
    payload = [p for _, p in parsed]
    start, end = times(ours)
    is_state = np.isin(names, np.array(STATES, dtype=object))
    is_step = np.isin(names, np.array(STEP_PHASES, dtype=object))
    frames = [run.spans]

    if is_step.any():
        m = np.flatnonzero(is_step)
        frames.append(spans_frame({
            "kind": ["step"] * len(m), "name": names[m], "start_ns": start[m], "end_ns": end[m],
            "step_id": [payload[i] for i in m], "clock": ["cpu"] * len(m)}, len(m)))
    other = np.flatnonzero(~is_state & ~is_step)
    if len(other):
        frames.append(spans_frame({
            "kind": ["activity"] * len(other), "name": names[other], "start_ns": start[other],
            "end_ns": end[other], "clock": ["cpu"] * len(other)}, len(other)))

    st = np.flatnonzero(is_state)
    if len(st):
        keys = [str(payload[i]) if payload[i] is not None
                else _request_of(ours[i].get("args") or {}) for i in st]
        synthetic = all(k is None for k in keys)
        keys = ["kineto-0" if k is None else k for k in keys]
        uniq, req = np.unique(np.array(keys, dtype=object), return_inverse=True)
        nums = _nums(uniq)
        rid = np.array([ids.get(int(n), u) for n, u in zip(nums, uniq, strict=True)],
                       dtype=object) if ids else uniq
        frames.append(requests_from_stage_ranges(
            run, req, names[st], start[st], end[st], rid, nums, f"`{PREFIX}<stage>` ranges"))
        if ids:
            run.derived.append("request ids: request_num → request_id from the run store "
                               "beside the trace")
        if synthetic:
            run.cannot.append("per-request split: the annotations carry no request, so all "
                              "ranges form one synthetic request `kineto-0`")
    run.spans = concat_spans(frames)


def _nums(ids: np.ndarray) -> np.ndarray:
    """request_num: the id itself when numeric (the range suffix), else its position."""
    try:
        return np.array([int(x) for x in ids], dtype=np.int64)
    except ValueError:
        return np.arange(len(ids), dtype=np.int64)
