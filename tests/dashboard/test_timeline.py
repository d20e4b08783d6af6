"""`kvscope timeline`: a hand-built run store rendered as a Chrome/Perfetto trace."""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from agent.cli import main
from agent.clock import ClockAnchor
from agent.errors import InputError
from agent.runstore import RunStoreWriter, open_run
from agent.schema import ACCOUNTING_COLUMNS, TABLES
from dashboard.timeline import (
    PID_COUNTERS,
    PID_ENGINE,
    PID_REQUESTS,
    PID_TRANSFERS,
    TRANSFER_TIDS,
    Window,
    build_trace,
    load_kineto,
)
from tests.conftest import shared_data

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
]
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


def _ns(ms: float) -> int:
    return T0 + round(ms * MS)


def _requests() -> pa.Table:
    base = dict.fromkeys(ACCOUNTING_COLUMNS, 0)
    rows = [
        {**base, "request_id": "r-a", "request_num": 0, "tenant": None, "workload_class": None,
         "arrival_ns": _ns(1.0), "first_token_ns": _ns(9.0), "finish_ns": _ns(12.0),
         "status": "ok", "prompt_tokens": 512},
        {**base, "request_id": "r-b", "request_num": 1, "tenant": None, "workload_class": None,
         "arrival_ns": _ns(3.0), "first_token_ns": _ns(9.0), "finish_ns": _ns(10.0),
         "status": "ok", "prompt_tokens": 512},
        {**base, "request_id": "r-c", "request_num": 2, "tenant": None, "workload_class": None,
         "arrival_ns": _ns(20.0), "first_token_ns": None, "finish_ns": _ns(30.0),
         "status": "aborted", "prompt_tokens": 64},
    ]
    return pa.Table.from_pylist(rows, schema=TABLES["requests"])


def _spans() -> pa.Table:
    null = {"tier": None, "layer": None, "tokens": None, "bytes": None, "step_id": None,
            "transfer_id": None, "waits_on": None, "batch_requests": None, "clock": "cpu",
            "request_num": None}
    rows: list[dict[str, Any]] = []
    for rid, stage, s, e, waits in STATES:
        rows.append({**null, "request_id": rid, "kind": "state", "name": stage,
                     "start_ns": _ns(s), "end_ns": _ns(e), "waits_on": waits})
    for name, tier, s, e, tid, rid in ACTIVITIES:
        rows.append({**null, "request_id": rid, "kind": "activity", "name": name, "tier": tier,
                     "start_ns": _ns(s), "end_ns": _ns(e), "transfer_id": tid,
                     "tokens": 256, "bytes": 1 << 20})
    for name, s, e in STEPS:
        rows.append({**null, "request_id": None, "kind": "step", "name": name,
                     "start_ns": _ns(s), "end_ns": _ns(e), "step_id": 1, "batch_requests": 2})
    return pa.Table.from_pylist(rows, schema=TABLES["spans"])


def _samples() -> pa.Table:
    return pa.Table.from_pylist(
        [{"ts_ns": _ns(t), "source": src, "entity": ent, "metric": m, "value": v, "unit": u}
         for src, m, ent, t, v, u in SAMPLES], schema=TABLES["samples"])


def _events() -> pa.Table:
    return pa.Table.from_pylist([
        {"ts_ns": _ns(15.0), "source": "engine", "name": "circuit_open", "request_id": None,
         "detail": '{"tier": "remote"}'},
        {"ts_ns": _ns(25.0), "source": "engine", "name": "preemption", "request_id": "r-c",
         "detail": None},
    ], schema=TABLES["events"])


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    w = RunStoreWriter(path, config={"model": "tiny"}, run_id="timeline-test",
                       anchor=ClockAnchor(wall_ns=T0, mono_ns=0))
    w.write_all({"requests": _requests(), "spans": _spans(), "samples": _samples(),
                 "events": _events()})
    w.close(end_ns=_ns(30.0))
    return path


def _trace(run_dir: Path, **kw: Any) -> dict[str, Any]:
    # Round-trip through JSON text: what a viewer loads.
    return json.loads(json.dumps(build_trace(open_run(run_dir), **kw), allow_nan=False))


def _by_ph(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ev in trace["traceEvents"]:
        out[ev["ph"]].append(ev)
    return out


def _thread_ids(trace: dict[str, Any]) -> dict[tuple[int, str], int]:
    return {(e["pid"], e["args"]["name"]): e["tid"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_header_and_clock(run_dir: Path) -> None:
    trace = _trace(run_dir)
    assert trace["displayTimeUnit"] == "ns"
    assert trace["otherData"]["origin_epoch_ns"] == T0
    assert trace["otherData"]["kvscope_run_id"] == "timeline-test"
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"kvscope requests", "kvscope engine", "kvscope transfers",
                     "kvscope counters"}


def test_known_request_stages_at_the_right_times(run_dir: Path) -> None:
    trace = _trace(run_dir)
    tids = _thread_ids(trace)
    # Threads are numbered in arrival order.
    assert [tids[(PID_REQUESTS, r)] for r in ("r-a", "r-b", "r-c")] == [1, 2, 3]
    stages = [(e["name"], e["ts"], e["dur"]) for e in _by_ph(trace)["X"]
              if e["pid"] == PID_REQUESTS and e["tid"] == tids[(PID_REQUESTS, "r-a")]]
    assert stages == [("lookup", 1000.0, 200.0), ("queue", 1200.0, 800.0),
                      ("remote_read", 2000.0, 3000.0), ("h2d", 5000.0, 500.0),
                      ("prefill", 5500.0, 3500.0), ("decode", 9000.0, 3000.0)]
    first = [e for e in _by_ph(trace)["i"] if e["name"] == "first_token"]
    assert [(e["tid"], e["ts"], e["args"]["ttft_ms"]) for e in first] == [
        (1, 9000.0, 8.0), (2, 9000.0, 6.0)]


def test_event_counts_and_nesting(run_dir: Path) -> None:
    trace = _trace(run_dir)
    counts = Counter(e["ph"] for e in trace["traceEvents"])
    assert counts["X"] == len(STATES) + len(STEPS)
    assert counts["b"] == counts["e"] == len(ACTIVITIES)
    assert counts["s"] == counts["f"] == 3  # r-a waits on 7; r-b on 7 and on 8
    assert counts["B"] == counts["E"] == 0
    # X events on one thread are disjoint or nested, never partially overlapping.
    per_track: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in _by_ph(trace)["X"]:
        per_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for track, spans in per_track.items():
        spans.sort(key=lambda se: (se[0], -se[1]))
        stack: list[float] = []
        for s, e in spans:
            while stack and stack[-1] <= s:
                stack.pop()
            assert not stack or e <= stack[-1], f"partial overlap on {track}"
            stack.append(e)
    steps = [(e["name"], e["tid"]) for e in _by_ph(trace)["X"] if e["pid"] == PID_ENGINE]
    assert steps == [(p, 1) for p, _, _ in STEPS]
    # Async pairs share an id, one id per activity span.
    ids = Counter(e["id"] for e in trace["traceEvents"] if e["ph"] in "be")
    assert set(ids.values()) == {2} and len(ids) == len(ACTIVITIES)


def test_flows_link_transfers_to_waiting_states(run_dir: Path) -> None:
    trace = _trace(run_dir)
    ev = _by_ph(trace)
    tids = _thread_ids(trace)
    transfers = {e["args"]["transfer_id"]: e for e in ev["b"] if "transfer_id" in e["args"]}
    starts = {e["id"]: e for e in ev["s"]}
    links = []
    for f in ev["f"]:
        s = starts[f["id"]]
        tr = transfers[s["args"]["transfer_id"]]
        assert (s["pid"], s["tid"], s["ts"]) == (PID_TRANSFERS, tr["tid"], tr["ts"])
        assert f["bp"] == "e" and f["pid"] == PID_REQUESTS
        # The flow ends inside the state span that lists the transfer in waits_on.
        (state,) = [x for x in ev["X"] if x["pid"] == PID_REQUESTS and x["tid"] == f["tid"]
                    and x["ts"] < f["ts"] < x["ts"] + x["dur"]]
        assert s["args"]["transfer_id"] in state["args"]["waits_on"]
        links.append((s["args"]["transfer_id"], f["tid"], state["name"]))
    ra, rb = tids[(PID_REQUESTS, "r-a")], tids[(PID_REQUESTS, "r-b")]
    assert sorted(links) == [(7, ra, "remote_read"), (7, rb, "remote_read"), (8, rb, "sync")]
    assert transfers[7]["tid"] == TRANSFER_TIDS["remote"]
    assert transfers[8]["tid"] == TRANSFER_TIDS["host"]


def test_counters_cover_the_samples(run_dir: Path) -> None:
    trace = _trace(run_dir)
    c = [e for e in _by_ph(trace)["C"]]
    assert all(e["pid"] == PID_COUNTERS for e in c)
    assert [(e["name"], e["ts"], e["args"]) for e in c if e["name"].startswith("nvml/")] == [
        ("nvml/gpu_utilization (ratio)", 0.0, {"0": 0.1, "1": 0.1}),
        ("nvml/gpu_utilization (ratio)", 5000.0, {"0": 0.9, "1": 0.9}),
        ("nvml/gpu_utilization (ratio)", 10000.0, {"0": 0.5, "1": 0.5}),
    ]
    assert {e["name"] for e in c} == {"nvml/gpu_utilization (ratio)",
                                      "nic/receive_bytes (bytes)", "pool/blocks_empty"}
    # Every sample timestamp of every series is on its counter track.
    assert sorted((e["name"].split(" ")[0], e["ts"]) for e in c) == sorted(
        {(f"{src}/{m}", t * 1000) for src, m, _, t, _, _ in SAMPLES})


def test_events_become_instants(run_dir: Path) -> None:
    trace = _trace(run_dir)
    tids = _thread_ids(trace)
    inst = {e["name"]: e for e in _by_ph(trace)["i"] if e["cat"] == "kvscope.event"}
    assert (inst["circuit_open"]["pid"], inst["circuit_open"]["ts"]) == (PID_ENGINE, 15000.0)
    assert (inst["preemption"]["pid"], inst["preemption"]["tid"]) == (
        PID_REQUESTS, tids[(PID_REQUESTS, "r-c")])


def test_window_keeps_what_overlaps(run_dir: Path) -> None:
    trace = _trace(run_dir, window=Window.parse("0.015:"))
    ev = _by_ph(trace)
    assert [(e["name"], e["ts"]) for e in ev["X"]] == [("lookup", 20000.0), ("queue", 20500.0)]
    assert {e["name"] for e in ev["i"]} == {"circuit_open", "preemption"}
    assert ev["C"] == [] and ev["b"] == [] and ev["s"] == []
    assert [e["args"]["name"] for e in ev["M"] if e["name"] == "thread_name"
            and e["pid"] == PID_REQUESTS] == ["r-c"]
    # The ts stay on the run's clock; overlapping spans are kept whole.
    early = _by_ph(_trace(run_dir, window=Window.parse(":0.0021")))
    assert {(e["args"]["request_id"], e["name"]) for e in early["X"]
            if e["pid"] == PID_REQUESTS} == {("r-a", "lookup"), ("r-a", "queue"),
                                            ("r-a", "remote_read")}
    assert [e["name"] for e in early["b"]] == ["lookup", "remote_get"]


@pytest.mark.parametrize(("text", "message"), [
    ("5", "expected START:END"), ("a:b", "must be numbers"), ("3:1", "must be after"),
    ("-1:2", "start_s: must be a finite number >= 0"), ("1:inf", "end_s"),
])
def test_bad_window(text: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        Window.parse(text)


def _kineto(tmp_path: Path, base_ns: int | None) -> Path:
    doc: dict[str, Any] = {"schemaVersion": 1, "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 1000.5,
         "dur": 250.25},
    ]}
    if base_ns is not None:
        doc["baseTimeNanoseconds"] = base_ns
    p = tmp_path / "kineto.json.gz"
    with gzip.open(p, "wt") as fh:
        json.dump(doc, fh)
    return p


def test_merge_relative_to_base_time(run_dir: Path, tmp_path: Path) -> None:
    trace = _trace(run_dir, merge=[_kineto(tmp_path, T0 + 2 * MS)])
    (gemm,) = [e for e in trace["traceEvents"] if e.get("name") == "gemm"]
    # epoch = base + ts µs = T0 + 2 ms + 1000.5 µs → 3000.5 µs after the origin.
    assert (gemm["ts"], gemm["dur"], gemm["pid"], gemm["tid"]) == (3000.5, 250.25, 0, 7)
    assert any(e["ph"] == "M" and e["args"] == {"name": "GPU 0"} for e in trace["traceEvents"])
    assert trace["otherData"]["merged"] == [str(tmp_path / "kineto.json.gz")]
    # A window excludes merged events like kvscope's own.
    windowed = _trace(run_dir, window=Window.parse("0.004:"),
                      merge=[_kineto(tmp_path, T0 + 2 * MS)])
    assert not [e for e in windowed["traceEvents"] if e.get("name") == "gemm"]


@pytest.mark.parametrize("name", ["benchmark_result_2869224_1695835535_trace.json.gz",
                                  "sampled_rank-0.json.gz"])
def test_merge_real_kineto_absolute_time(run_dir: Path, name: str) -> None:
    path = shared_data(f"kineto/{name}")
    events, base = load_kineto(path)
    assert base == 0  # these traces predate baseTimeNanoseconds: ts are epoch µs
    trace = _trace(run_dir, merge=[path])
    own = build_trace(open_run(run_dir))["traceEvents"]
    assert len(trace["traceEvents"]) == len(own) + len(events)
    src = next(e for e in events if e["ph"] == "X")
    (out,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("args") == src["args"]
              and e["name"] == src["name"] and e["pid"] == src["pid"]]
    assert out["ts"] == (src["ts"] * 1000 - T0) / 1000


def test_merge_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"events": []}')
    with pytest.raises(InputError, match="no 'traceEvents'"):
        load_kineto(bad)
    with pytest.raises(InputError, match="no such trace file"):
        load_kineto(tmp_path / "missing.json")


def test_cli(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json.gz"
    assert main(["timeline", str(run_dir), "--out", str(out), "--window", "0:0.015"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: ")
    with gzip.open(out, "rt") as fh:
        trace = json.load(fh)
    assert trace["otherData"]["window_s"] == [0.0, 0.015]
    assert main(["timeline", str(run_dir), "--out", str(out), "--window", "x"]) == 2
    assert "--window 'x'" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_golden_run_if_present() -> None:
    """On the shared golden run: one X per state span, flows for every waits_on link."""
    from tests.conftest import GOLDEN_RUN

    if not (GOLDEN_RUN / "run.json").exists():
        pytest.skip("tests/golden/run not built (python tests/golden/make_golden.py)")
    run = open_run(GOLDEN_RUN)
    trace = json.loads(json.dumps(build_trace(run), allow_nan=False))
    ev = _by_ph(trace)
    spans = run.spans
    states = spans[spans["kind"] == "state"]
    assert len([e for e in ev["X"] if e["pid"] == PID_REQUESTS]) == len(states)
    assert len(ev["b"]) == len(ev["e"]) == int((spans["kind"] == "activity").sum())
    transfers = set(spans.loc[spans["kind"] == "activity", "transfer_id"].dropna().astype(int))
    links = sum(int(w) in transfers for ws in states["waits_on"] if ws is not None for w in ws)
    assert len(ev["s"]) == len(ev["f"]) == links
    assert len([e for e in ev["M"] if e["name"] == "thread_name"
                and e["pid"] == PID_REQUESTS]) == states["request_id"].nunique()
