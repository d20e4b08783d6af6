"""A hand-built run store for the timeline tests, and checks on the traces built from it."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from agent.clock import ClockAnchor
from agent.runstore import RunStoreWriter, open_run
from agent.schema import ACCOUNTING_COLUMNS, TABLES
from dashboard.timeline import build_trace

T0 = 1_700_000_000_000_000_000  # run start, epoch ns
MS = 1_000_000

# (request, stage, start ms, end ms, waits_on)
STATES = [
    ("r-a", "lookup", 1.0, 1.2, None),
    ("r-a", "queue", 1.2, 2.0, None),
    ("r-a", "remote_read", 2.0, 5.0, [7]),
    ("r-a", "h2d", 5.0, 5.5, None),
    ("r-a", "prefill", 5.5, 9.0, None),
    ("r-a", "decode", 9.0, 12.0, None),
    ("r-b", "lookup", 3.0, 3.1, None),
    ("r-b", "queue", 3.1, 4.0, None),
    ("r-b", "remote_read", 4.0, 5.0, [7]),
    ("r-b", "sync", 5.0, 5.5, [8]),
    ("r-b", "prefill", 5.5, 9.0, None),
    ("r-b", "decode", 9.0, 10.0, None),
    ("r-c", "lookup", 20.0, 20.5, None),
    ("r-c", "queue", 20.5, 30.0, None),
]
# (name, tier, start ms, end ms, transfer_id, request)
ACTIVITIES = [
    ("remote_get", "remote", 2.0, 5.0, 7, "r-a"),
    ("h2d_copy", "host", 4.5, 5.5, 8, None),
    ("lookup", "remote", 1.0, 1.1, None, "r-a"),
    ("remote_get", "remote", 3.0, 4.0, 9, "r-b"),  # overlaps transfer 7: a second lane
    ("h2d_copy", "host", 5.5, 6.0, 10, None),  # touches transfer 8: lanes are strict
]
#: Transfer lanes: (tier thread name, tid) in display order, and each transfer's lane.
LANES = [("host #1", 1), ("host #2", 2), ("remote #1", 3), ("remote #2", 4)]
TRANSFER_LANE = {7: "remote #1", 8: "host #1", 9: "remote #2", 10: "host #2"}
STEPS = [("schedule", 5.5, 5.6), ("prepare", 5.6, 5.8), ("forward", 5.8, 8.8),
         ("sample", 8.8, 9.0)]
# (source, metric, entity, ms, value, unit)
SAMPLES = [
    *(("nvml", "gpu_utilization", gpu, t, v, "ratio")
      for t, v in ((0.0, 0.1), (5.0, 0.9), (10.0, 0.5)) for gpu in ("0", "1")),
    ("nic", "receive_bytes", "eth0", 0.0, 1e6, "bytes"),
    ("nic", "receive_bytes", "eth0", 10.0, 3e6, "bytes"),
    ("pool", "blocks_empty", "device", 0.0, 100.0, None),
    ("pool", "blocks_empty", "device", 10.0, 0.0, None),
]


def ns(ms: float, t0: int = T0) -> int:
    return t0 + round(ms * MS)


def requests_table(t0: int = T0) -> pa.Table:
    base = dict.fromkeys(ACCOUNTING_COLUMNS, 0)
    rows = [
        {**base, "request_id": "r-a", "request_num": 0, "tenant": None, "workload_class": None,
         "arrival_ns": ns(1.0, t0), "first_token_ns": ns(9.0, t0),
         "finish_ns": ns(12.0, t0), "status": "ok", "prompt_tokens": 512},
        {**base, "request_id": "r-b", "request_num": 1, "tenant": None, "workload_class": None,
         "arrival_ns": ns(3.0, t0), "first_token_ns": ns(9.0, t0),
         "finish_ns": ns(10.0, t0), "status": "ok", "prompt_tokens": 512},
        {**base, "request_id": "r-c", "request_num": 2, "tenant": None, "workload_class": None,
         "arrival_ns": ns(20.0, t0), "first_token_ns": None, "finish_ns": ns(30.0, t0),
         "status": "aborted", "prompt_tokens": 64},
    ]
    return pa.Table.from_pylist(rows, schema=TABLES["requests"])


def spans_table(t0: int = T0, states: list[Any] = STATES, activities: list[Any] = ACTIVITIES,
           ) -> pa.Table:
    null = {"tier": None, "layer": None, "tokens": None, "bytes": None, "step_id": None,
            "transfer_id": None, "waits_on": None, "batch_requests": None, "clock": "cpu",
            "request_num": None}
    rows: list[dict[str, Any]] = []
    for rid, stage, s, e, waits in states:
        rows.append({**null, "request_id": rid, "kind": "state", "name": stage,
                     "start_ns": ns(s, t0), "end_ns": ns(e, t0), "waits_on": waits})
    for name, tier, s, e, tid, rid in activities:
        rows.append({**null, "request_id": rid, "kind": "activity", "name": name, "tier": tier,
                     "start_ns": ns(s, t0), "end_ns": ns(e, t0), "transfer_id": tid,
                     "tokens": 256, "bytes": 1 << 20})
    for name, s, e in STEPS:
        rows.append({**null, "request_id": None, "kind": "step", "name": name,
                     "start_ns": ns(s, t0), "end_ns": ns(e, t0), "step_id": 1,
                     "batch_requests": 2})
    return pa.Table.from_pylist(rows, schema=TABLES["spans"])


def samples_table(t0: int = T0) -> pa.Table:
    return pa.Table.from_pylist(
        [{"ts_ns": ns(t, t0), "source": src, "entity": ent, "metric": m, "value": v, "unit": u}
         for src, m, ent, t, v, u in SAMPLES], schema=TABLES["samples"])


def events_table(t0: int = T0) -> pa.Table:
    return pa.Table.from_pylist([
        {"ts_ns": ns(15.0, t0), "source": "engine", "name": "circuit_open", "request_id": None,
         "detail": '{"tier": "remote"}'},
        {"ts_ns": ns(25.0, t0), "source": "engine", "name": "preemption", "request_id": "r-c",
         "detail": None},
    ], schema=TABLES["events"])


def make_run(path: Path, t0: int, spans: pa.Table | None = None) -> Path:
    w = RunStoreWriter(path, config={"model": "tiny"}, run_id="timeline-test",
                       anchor=ClockAnchor(wall_ns=t0, mono_ns=0))
    w.write_all({"requests": requests_table(t0),
                 "spans": spans_table(t0) if spans is None else spans,
                 "samples": samples_table(t0), "events": events_table(t0)})
    w.close(end_ns=ns(30.0, t0))
    return path



def trace_of(run_dir: Path, **kw: Any) -> dict[str, Any]:
    # Round-trip through JSON text: what a viewer loads.
    return json.loads(json.dumps(build_trace(open_run(run_dir), **kw), allow_nan=False))


def by_ph(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ev in trace["traceEvents"]:
        out[ev["ph"]].append(ev)
    return out


def thread_ids(trace: dict[str, Any]) -> dict[tuple[int, str], int]:
    return {(e["pid"], e["args"]["name"]): e["tid"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}

def slices(trace: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    out: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[(e["pid"], e["tid"])].append(e)
    return out


def assert_slices_nest(trace: dict[str, Any]) -> int:
    """X slices on every (pid, tid) are disjoint or nested, never partially overlapping.

    Returns:
        The number of tracks checked.
    """
    tracks = slices(trace)
    for track, evs in tracks.items():
        spans = sorted(((e["ts"], e["ts"] + e["dur"]) for e in evs), key=lambda se: (se[0],
                                                                                    -se[1]))
        stack: list[float] = []
        for s, e in spans:
            while stack and stack[-1] <= s:
                stack.pop()
            assert not stack or e <= stack[-1], f"partial overlap on {track} at {s}"
            stack.append(e)
    return len(tracks)

def enclosing(trace: dict[str, Any], ev: dict[str, Any]) -> list[dict[str, Any]]:
    """The X slices on `ev`'s thread that contain its ts (what a viewer binds a flow to)."""
    return [x for x in slices(trace)[(ev["pid"], ev["tid"])]
            if x["ts"] <= ev["ts"] <= x["ts"] + x["dur"]]
