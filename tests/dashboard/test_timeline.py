"""`kvscope timeline`: a hand-built run store rendered as a Chrome/Perfetto trace."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from agent.errors import InputError
from agent.runstore import open_run
from dashboard.timeline import (
    PID_COUNTERS,
    PID_ENGINE,
    PID_REQUESTS,
    PID_TRANSFERS,
    Window,
    build_trace,
    load_kineto,
)
from kvscope.cli import main
from tests.conftest import shared_data
from tests.dashboard.timeline.synthetic import (
    ACTIVITIES,
    LANES,
    MS,
    SAMPLES,
    STATES,
    STEPS,
    T0,
    TRANSFER_LANE,
    assert_slices_nest,
    by_ph,
    enclosing,
    make_run,
    slices,
    spans_table,
    thread_ids,
    trace_of,
)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run", T0)

def test_header_and_clock(run_dir: Path) -> None:
    trace = trace_of(run_dir)
    assert trace["displayTimeUnit"] == "ns"
    assert trace["otherData"]["origin_epoch_ns"] == T0
    assert trace["otherData"]["kvscope_run_id"] == "timeline-test"
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"kvscope requests", "kvscope engine", "kvscope transfers",
                     "kvscope counters"}


def test_known_request_stages_at_the_right_times(run_dir: Path) -> None:
    trace = trace_of(run_dir)
    tids = thread_ids(trace)
    # Threads are numbered in arrival order.
    assert [tids[(PID_REQUESTS, r)] for r in ("r-a", "r-b", "r-c")] == [1, 2, 3]
    stages = [(e["name"], e["ts"], e["dur"]) for e in by_ph(trace)["X"]
              if e["pid"] == PID_REQUESTS and e["tid"] == tids[(PID_REQUESTS, "r-a")]]
    assert stages == [("lookup", 1000.0, 200.0), ("queue", 1200.0, 800.0),
                      ("remote_read", 2000.0, 3000.0), ("h2d", 5000.0, 500.0),
                      ("prefill", 5500.0, 3500.0), ("decode", 9000.0, 3000.0)]
    first = [e for e in by_ph(trace)["i"] if e["name"] == "first_token"]
    assert [(e["tid"], e["ts"], e["args"]["ttft_ms"]) for e in first] == [
        (1, 9000.0, 8.0), (2, 9000.0, 6.0)]

def test_event_counts_and_nesting(run_dir: Path) -> None:
    trace = trace_of(run_dir)
    counts = Counter(e["ph"] for e in trace["traceEvents"])
    assert counts["X"] == len(STATES) + len(STEPS) + len(ACTIVITIES)
    assert counts["s"] == counts["f"] == 3  # r-a waits on 7; r-b on 7 and on 8
    assert counts["B"] == counts["E"] == counts["b"] == counts["e"] == 0
    tids = thread_ids(trace)
    # Every request track, the steps track and every transfer lane.
    n_tracks = assert_slices_nest(trace)
    assert n_tracks == len({r for r, *_ in STATES}) + 1 + len(LANES)
    steps = [(e["name"], e["tid"]) for e in by_ph(trace)["X"] if e["pid"] == PID_ENGINE]
    assert steps == [(p, 1) for p, _, _ in STEPS]
    assert sorted((name, tid) for (pid, name), tid in tids.items()
                  if pid == PID_TRANSFERS) == LANES


def test_transfers_on_strict_lanes(run_dir: Path) -> None:
    trace = trace_of(run_dir)
    lanes = {tid: name for (pid, name), tid in thread_ids(trace).items() if pid == PID_TRANSFERS}
    xs = [e for e in by_ph(trace)["X"] if e["pid"] == PID_TRANSFERS]
    assert sorted((e["args"].get("transfer_id"), lanes[e["tid"]], e["ts"], e["dur"])
                  for e in xs if "transfer_id" in e["args"]) == [
        (7, TRANSFER_LANE[7], 2000.0, 3000.0), (8, TRANSFER_LANE[8], 4500.0, 1000.0),
        (9, TRANSFER_LANE[9], 3000.0, 1000.0), (10, TRANSFER_LANE[10], 5500.0, 500.0)]
    (lookup,) = [e for e in xs if e["name"] == "lookup"]
    assert lanes[lookup["tid"]] == "remote #1"
    assert lookup["args"] == {"request_id": "r-a", "tier": "remote", "tokens": 256,
                              "bytes": 1 << 20, "clock": "cpu"}
    # Slices on one lane do not even touch, so each instant belongs to one transfer.
    for evs in slices(trace).values():
        if evs[0]["pid"] != PID_TRANSFERS:
            continue
        ends = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs)
        assert all(b[0] > a[1] for a, b in pairwise(ends))


def test_flows_link_transfers_to_waiting_states(run_dir: Path) -> None:
    trace = trace_of(run_dir)
    ev = by_ph(trace)
    tids = thread_ids(trace)
    starts = {e["id"]: e for e in ev["s"]}
    assert len(starts) == len(ev["s"])  # one id per (transfer, waiter) pair
    links = []
    for f in ev["f"]:
        s = starts[f["id"]]
        # Both ends bind to exactly one thread slice: the transfer and the waiting state.
        (tr,) = enclosing(trace, s)
        assert s["pid"] == PID_TRANSFERS and s["ts"] == tr["ts"] + 0.001  # 1 ns in
        assert tr["args"]["transfer_id"] == s["args"]["transfer_id"]
        assert f["bp"] == "e" and f["pid"] == PID_REQUESTS
        (state,) = enclosing(trace, f)
        assert s["args"]["transfer_id"] in state["args"]["waits_on"]
        links.append((f["id"], s["args"]["transfer_id"], f["tid"], state["name"], f["ts"]))
    ra, rb = tids[(PID_REQUESTS, "r-a")], tids[(PID_REQUESTS, "r-b")]
    # f sits at the transfer's end, 1 ns inside the state span (neighbours touch at its ends).
    assert sorted(links) == [(1, 7, ra, "remote_read", 4999.999),
                             (2, 7, rb, "remote_read", 4999.999), (3, 8, rb, "sync", 5499.999)]


def test_flow_per_transfer_and_waiter(tmp_path: Path) -> None:
    """A transfer in two spans is one flow source; a span listing it twice is one waiter."""
    states = [("r-a", "remote_read", 2.0, 5.0, [7, 7]), ("r-a", "h2d", 5.0, 6.0, None)]
    activities = [("remote_get", "remote", 2.0, 3.0, 7, "r-a"),
                  ("remote_get", "remote", 3.5, 5.5, 7, "r-a")]
    run = make_run(tmp_path / "run", T0, spans_table(T0, states, activities))
    ev = by_ph(trace_of(run))
    (s,), (f,) = ev["s"], ev["f"]
    # s inside the first span; f at the last span's end, clipped 1 ns inside remote_read.
    assert (s["id"], s["ts"], f["id"], f["ts"]) == (1, 2000.001, 1, 4999.999)

def test_counters_cover_thesamples_table(run_dir: Path) -> None:
    trace = trace_of(run_dir)
    c = [e for e in by_ph(trace)["C"]]
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
    trace = trace_of(run_dir)
    tids = thread_ids(trace)
    inst = {e["name"]: e for e in by_ph(trace)["i"] if e["cat"] == "kvscope.event"}
    assert (inst["circuit_open"]["pid"], inst["circuit_open"]["ts"]) == (PID_ENGINE, 15000.0)
    assert (inst["preemption"]["pid"], inst["preemption"]["tid"]) == (
        PID_REQUESTS, tids[(PID_REQUESTS, "r-c")])


def test_window_keeps_what_overlaps(run_dir: Path) -> None:
    trace = trace_of(run_dir, window=Window.parse("0.015:"))
    ev = by_ph(trace)
    assert [(e["name"], e["ts"]) for e in ev["X"]] == [("lookup", 20000.0), ("queue", 20500.0)]
    assert {e["name"] for e in ev["i"]} == {"circuit_open", "preemption"}
    assert ev["C"] == [] and ev["s"] == []
    assert [(e["pid"], e["args"]["name"]) for e in ev["M"] if e["name"] == "thread_name"
            and e["pid"] != PID_ENGINE] == [(PID_REQUESTS, "r-c")]
    # The ts stay on the run's clock; overlapping spans are kept whole.
    early = by_ph(trace_of(run_dir, window=Window.parse(":0.0021")))
    assert {(e["args"]["request_id"], e["name"]) for e in early["X"]
            if e["pid"] == PID_REQUESTS} == {("r-a", "lookup"), ("r-a", "queue"),
                                            ("r-a", "remote_read")}
    assert [e["name"] for e in early["X"] if e["pid"] == PID_TRANSFERS] == [
        "lookup", "remote_get"]
    # Only r-a's remote_read, waiting on transfer 7, lies in the window: one flow.
    assert [(s["args"], f["args"]) for s, f in zip(early["s"], early["f"], strict=True)] == [
        ({"transfer_id": 7, "request_id": "r-a"},) * 2]


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
    trace = trace_of(run_dir, merge=[_kineto(tmp_path, T0 + 2 * MS)])
    (gemm,) = [e for e in trace["traceEvents"] if e.get("name") == "gemm"]
    # epoch = base + ts µs = T0 + 2 ms + 1000.5 µs → 3000.5 µs after the origin.
    assert (gemm["ts"], gemm["dur"], gemm["pid"], gemm["tid"]) == (3000.5, 250.25, 0, 7)
    assert any(e["ph"] == "M" and e["args"] == {"name": "GPU 0"} for e in trace["traceEvents"])
    assert trace["otherData"]["merged"] == [str(tmp_path / "kineto.json.gz")]
    # A window excludes merged events like kvscope's own.
    windowed = trace_of(run_dir, window=Window.parse("0.004:"),
                      merge=[_kineto(tmp_path, T0 + 2 * MS)])
    assert not [e for e in windowed["traceEvents"] if e.get("name") == "gemm"]


@pytest.mark.parametrize("name", ["benchmark_result_2869224_1695835535_trace.json.gz",
                                  "sampled_rank-0.json.gz"])
def test_merge_real_kineto_absolute_time(run_dir: Path, name: str) -> None:
    path = shared_data(f"kineto/{name}")
    events, base = load_kineto(path)
    assert base == 0  # these traces predate baseTimeNanoseconds: ts are epoch µs
    trace = trace_of(run_dir, merge=[path])
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
    with pytest.raises(InputError, match="no such file"):
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
    ev = by_ph(trace)
    spans = run.spans
    states = spans[spans["kind"] == "state"]
    assert len([e for e in ev["X"] if e["pid"] == PID_REQUESTS]) == len(states)
    assert len([e for e in ev["X"] if e["pid"] == PID_TRANSFERS]) == int(
        (spans["kind"] == "activity").sum())
    assert_slices_nest(trace)
    transfers = set(spans.loc[spans["kind"] == "activity", "transfer_id"].dropna().astype(int))
    links = sum(int(w) in transfers for ws in states["waits_on"] if ws is not None for w in ws)
    assert len(ev["s"]) == len(ev["f"]) == links
    for f in ev["f"]:
        (state,) = enclosing(trace, f)
        assert f["args"]["transfer_id"] in state["args"]["waits_on"]
    assert len([e for e in ev["M"] if e["name"] == "thread_name"
                and e["pid"] == PID_REQUESTS]) == states["request_id"].nunique()
