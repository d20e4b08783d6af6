"""The hot-path recorder: exact round trip through the run store, bounds, concurrency, and
"recording never raises"."""

from __future__ import annotations

import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from agent.clock import ClockAnchor
from agent.runstore import RunStoreWriter, open_run
from agent.schema import ACCOUNTING_COLUMNS, STATE_CODE, TABLES
from agent.telemetry import (
    CLOCK_CPU,
    CLOCK_CUDA,
    EngineStatus,
    Recorder,
    RequestAccounting,
    output_digest,
)

ANCHOR = ClockAnchor(wall_ns=1_700_000_000_000_000_000, mono_ns=5_000)
OFF = ANCHOR.wall_ns - ANCHOR.mono_ns
Q, RR, H2D, PREFILL, DECODE = (STATE_CODE[s] for s in
                               ("queue", "remote_read", "h2d", "prefill", "decode"))


class FakeClock:
    """Monotonic ns the test sets explicitly."""

    def __init__(self, t: int = 0) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def make(**kw: Any) -> Recorder:
    kw.setdefault("anchor", ANCHOR)
    kw.setdefault("clock", FakeClock(3_333))
    return Recorder(**kw)


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """DataFrame rows as plain Python values (NA → None, arrays → lists)."""
    out = []
    for row in df.to_dict("records"):
        clean = {}
        for k, v in row.items():
            if isinstance(v, np.ndarray):
                v = v.tolist()
            elif v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)):
                v = None
            elif isinstance(v, np.integer):
                v = int(v)
            clean[k] = v
        out.append(clean)
    return out


def span(**kw: Any) -> dict[str, Any]:
    row = dict.fromkeys(TABLES["spans"].names)
    row.update(kw)
    return row


# --------------------------------------------------------------------------- round trip
def test_round_trip_through_run_store_is_exact(tmp_path: Path) -> None:
    clock = FakeClock(3_333)
    rec = make(clock=clock)
    a = rec.request_begin("req-a", 1_000, tenant="t1", workload_class="chat")
    t1, t2, t3 = rec.new_transfer_id(), rec.new_transfer_id(), rec.new_transfer_id()
    rec.wait_for(a, t1)
    b = rec.request_begin("req-b", 1_200)
    rec.stage(a, Q, 1_100)
    rec.stage(a, RR, 1_300)
    rec.wait_for(a, t2)
    rec.wait_for(a, t2)  # listed once
    rec.wait_for(a, t3)
    rec.activity("remote_read", 1_310, 1_590, request_num=a, tier="remote", tokens=32,
                 nbytes=8_192, transfer_id=t2)
    rec.request_end(b, RequestAccounting(prompt_tokens=7, recomputed_tokens=0),
                    status="aborted", t=1_500)
    rec.stage(a, H2D, 1_600)
    rec.activity("h2d", 1_600, 1_690, request_num=a, tier="host", layer=3, tokens=16,
                 nbytes=4_096, transfer_id=t3, clock=CLOCK_CUDA)
    rec.activity("store", 1_650, 1_660)  # unattributed: every optional column null
    rec.stage(a, PREFILL, 1_700)
    rec.step_span(7, "schedule", 1_690, 1_700)
    rec.step_span(7, "forward", 1_700, 1_900, batch_requests=2, tokens=64, clock=CLOCK_CUDA)
    rec.layer(a, 0, 16, 16, 0, 48, load_ns=90, wait_ns=10)
    rec.layer(a, 1, 0, 0, 32, 48, skipped_tokens=16)  # a window layer skipping the hit
    rec.first_token(a, 2_000)
    rec.event("eviction", t=1_234, detail={"blocks": [1, 2], "tier": "device"})
    rec.event("preemption", source="scheduler", request_num=a)  # t from the clock
    rec.sample("pool", "free_blocks", 12, entity="device", unit="blocks", t=1_400)
    clock.t = 4_444
    rec.sample("host", "cpu_utilization", 0.25)
    acct = RequestAccounting(**{c: i + 1 for i, c in enumerate(ACCOUNTING_COLUMNS)})
    rec.request_end(a, acct, t=2_500, output_digest=output_digest([5, 9]),
                    output_token_ids=[5, 9])

    out = rec.drain()
    assert rec.stats.recording_errors == 0 and rec.stats.unknown_requests == 0
    assert rec.stats.dropped == {} and rec.open_requests() == 0
    w = RunStoreWriter(tmp_path / "run", config={"model": "tiny"}, anchor=ANCHOR, run_id="r1")
    w.write_all(out)
    w.close(end_ns=ANCHOR.wall_ns + 10_000)
    rs = open_run(tmp_path / "run")
    assert rs.gaps == [] and rs.complete
    assert rs.meta["clock"]["wall_ns"] == ANCHOR.wall_ns
    assert rs.meta["clock"]["mono_ns"] == ANCHOR.mono_ns
    assert rs.meta["run_id"] == "r1" and rs.meta["config"] == {"model": "tiny"}
    assert rs.meta["rows"] == {"requests": 2, "spans": 12, "layers": 2, "samples": 2,
                               "events": 2}

    def st(rid: str, rn: int, name: str, s: int, e: int, waits: list[int] | None = None
           ) -> dict[str, Any]:
        return span(request_id=rid, request_num=rn, kind="state", name=name, start_ns=s + OFF,
                    end_ns=e + OFF, waits_on=waits, clock="cpu")

    expected_spans = [
        st("req-a", a, "lookup", 1_000, 1_100, [t1]),
        st("req-a", a, "queue", 1_100, 1_300),
        st("req-b", b, "lookup", 1_200, 1_500),
        st("req-a", a, "remote_read", 1_300, 1_600, [t2, t3]),
        st("req-a", a, "h2d", 1_600, 1_700),
        st("req-a", a, "prefill", 1_700, 2_000),
        st("req-a", a, "decode", 2_000, 2_500),
        span(request_id="req-a", request_num=a, kind="activity", name="remote_read",
             start_ns=1_310 + OFF, end_ns=1_590 + OFF, tier="remote", tokens=32, bytes=8_192,
             transfer_id=t2, clock="cpu"),
        span(request_id="req-a", request_num=a, kind="activity", name="h2d",
             start_ns=1_600 + OFF, end_ns=1_690 + OFF, tier="host", layer=3, tokens=16,
             bytes=4_096, transfer_id=t3, clock="cuda_event"),
        span(kind="activity", name="store", start_ns=1_650 + OFF, end_ns=1_660 + OFF,
             clock="cpu"),
        span(kind="step", name="schedule", start_ns=1_690 + OFF, end_ns=1_700 + OFF, step_id=7,
             clock="cpu"),
        span(kind="step", name="forward", start_ns=1_700 + OFF, end_ns=1_900 + OFF, step_id=7,
             tokens=64, batch_requests=2, clock="cuda_event"),
    ]
    # State rows first, in recording order (b's lookup closed before a's remote_read), then
    # activity rows, then step rows.
    assert records(rs.spans) == expected_spans
    zero = dict.fromkeys(ACCOUNTING_COLUMNS, 0)
    assert records(rs.requests) == [
        {"request_id": "req-b", "request_num": b, "tenant": None, "workload_class": None,
         "arrival_ns": 1_200 + OFF, "first_token_ns": None, "finish_ns": 1_500 + OFF,
         "status": "aborted", **zero, "prompt_tokens": 7, "output_digest": None,
         "output_token_ids": None},
        {"request_id": "req-a", "request_num": a, "tenant": "t1", "workload_class": "chat",
         "arrival_ns": 1_000 + OFF, "first_token_ns": 2_000 + OFF, "finish_ns": 2_500 + OFF,
         "status": "ok", **{c: i + 1 for i, c in enumerate(ACCOUNTING_COLUMNS)},
         "output_digest": output_digest([5, 9]), "output_token_ids": [5, 9]},
    ]
    assert records(rs.layers) == [
        {"request_id": "req-a", "layer": 0, "hit_tokens": 16, "loaded_tokens": 16,
         "recomputed_tokens": 0, "prompt_tokens": 48, "load_ns": 90, "wait_ns": 10,
         "skipped_tokens": 0},
        {"request_id": "req-a", "layer": 1, "hit_tokens": 0, "loaded_tokens": 0,
         "recomputed_tokens": 32, "prompt_tokens": 48, "load_ns": 0, "wait_ns": 0,
         "skipped_tokens": 16},
    ]
    assert records(rs.samples) == [
        {"ts_ns": 1_400 + OFF, "source": "pool", "entity": "device", "metric": "free_blocks",
         "value": 12.0, "unit": "blocks"},
        {"ts_ns": 4_444 + OFF, "source": "host", "entity": None, "metric": "cpu_utilization",
         "value": 0.25, "unit": None},
    ]
    assert records(rs.events) == [
        {"ts_ns": 1_234 + OFF, "source": "engine", "name": "eviction", "request_id": None,
         "detail": '{"blocks": [1, 2], "tier": "device"}'},
        {"ts_ns": 3_333 + OFF, "source": "scheduler", "name": "preemption",
         "request_id": "req-a", "detail": None},
    ]
    # Nullable integers stay exact pandas Int64/Int32; non-nullable ones are numpy int64.
    assert str(rs.requests["first_token_ns"].dtype) == "Int64"
    assert str(rs.spans["layer"].dtype) == "Int32"
    assert rs.spans["start_ns"].dtype == np.int64
    assert rec.stats.rows == {"spans": 12, "layers": 2, "requests": 2, "samples": 2,
                              "events": 2}


def test_state_rows_come_in_recording_order() -> None:
    rec = make()
    a = rec.request_begin("a", 0)
    b = rec.request_begin("b", 5)
    rec.stage(b, Q, 6)
    rec.stage(a, Q, 7)
    rows = rec.drain()["spans"].select(["request_id", "name", "start_ns"]).to_pylist()
    assert rows == [{"request_id": "b", "name": "lookup", "start_ns": 5 + OFF},
                    {"request_id": "a", "name": "lookup", "start_ns": OFF}]


def test_drain_with_nothing_new_is_empty() -> None:
    rec = make()
    assert rec.drain() == {}
    rn = rec.request_begin("a", 0)
    rec.stage(rn, Q, 1)
    assert set(rec.drain()) == {"spans"}
    assert rec.drain() == {}


def test_first_token_twice_keeps_the_first_and_counts() -> None:
    rec = make()
    rn = rec.request_begin("a", 0)
    rec.first_token(rn, 10)
    rec.first_token(rn, 20)
    rec.request_end(rn, RequestAccounting(), t=30)
    req = rec.drain()["requests"].to_pylist()[0]
    assert req["first_token_ns"] == 10 + OFF
    assert rec.stats.recording_errors == 1


def test_clock_regression_is_clamped_and_counted() -> None:
    rec = make()
    rn = rec.request_begin("a", 100)
    rec.stage(rn, Q, 90)  # before the lookup started: clamped to 100
    rec.first_token(rn, 95)
    rec.request_end(rn, RequestAccounting(), t=80)
    out = rec.drain()
    assert rec.stats.clock_regressions == 3
    assert out["spans"].select(["name", "start_ns", "end_ns"]).to_pylist() == [
        {"name": n, "start_ns": 100 + OFF, "end_ns": 100 + OFF}
        for n in ("lookup", "queue", "decode")
    ]
    req = out["requests"].to_pylist()[0]
    assert (req["first_token_ns"], req["finish_ns"]) == (100 + OFF, 100 + OFF)


# --------------------------------------------------------------------------- bounds
def _boundaries(rec: Recorder, rn: int, t0: int, n: int) -> None:
    for k in range(n):
        rec.stage(rn, Q if k % 2 else PREFILL, t0 + k + 1)


def test_rows_beyond_the_bound_are_dropped_counted_and_recording_resumes() -> None:
    rec = make(segment_rows=4, max_segments=2)
    rn = rec.request_begin("a", 0)
    _boundaries(rec, rn, 0, 20)  # room for 4 (active) + 2 x 4 (full) rows
    assert rec.stats.dropped == {"spans": 8}
    first = rec.drain()["spans"]
    assert first["end_ns"].to_pylist() == [k + 1 + OFF for k in range(12)]
    _boundaries(rec, rn, 100, 5)
    assert rec.stats.dropped == {"spans": 8}
    second = rec.drain()["spans"]
    assert second["end_ns"].to_pylist() == [101 + k + OFF for k in range(5)]
    # The state machine kept moving while rows were dropped: the next span starts at 100.
    assert second["start_ns"].to_pylist()[0] == 20 + OFF


def test_queue_tables_are_bounded_too() -> None:
    rec = make(segment_rows=2, max_segments=3)  # 6 rows per table
    rn = rec.request_begin("a", 0)
    for k in range(9):
        rec.event("eviction", t=k)
        rec.sample("pool", "m", k, t=k)
        rec.activity("x", k, k + 1)
        rec.step_span(k, "forward", k, k + 1)
        rec.layer(rn, k, 0, 0, 0, 1)
    # Columnar buffers hold the active segment plus 3 full ones (8 rows each for activity,
    # step and layer rows); queued tables hold segment_rows * max_segments = 6 rows.
    assert rec.stats.dropped == {"events": 3, "samples": 3, "spans": 2, "layers": 1}
    out = rec.drain()
    assert out["events"]["ts_ns"].to_pylist() == [k + OFF for k in range(6)]
    assert out["samples"]["value"].to_pylist() == [float(k) for k in range(6)]
    assert out["layers"]["layer"].to_pylist() == list(range(8))
    assert out["spans"].num_rows == 16


def test_many_rotations_with_drains_in_between_are_exact() -> None:
    rng = np.random.default_rng(7)
    rec = make(segment_rows=3, max_segments=1_000)
    rns = [rec.request_begin(f"r{i}", 0) for i in range(4)]
    expected: list[tuple[str, int, int]] = []
    start = dict.fromkeys(rns, 0)
    got: list[tuple[str, int, int]] = []
    for t in range(1, 2_001):
        rn = rns[int(rng.integers(4))]
        rec.stage(rn, int(rng.integers(8)), t)
        expected.append((f"r{rn}", start[rn], t))
        start[rn] = t
        if rng.random() < 0.05:
            sp = rec.drain().get("spans")
            if sp is not None:
                got += [(r["request_id"], r["start_ns"] - OFF, r["end_ns"] - OFF)
                        for r in sp.to_pylist()]
    sp = rec.drain()["spans"]
    got += [(r["request_id"], r["start_ns"] - OFF, r["end_ns"] - OFF) for r in sp.to_pylist()]
    assert got == expected
    assert rec.stats.dropped == {}


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="segment_rows"):
        Recorder(segment_rows=0)
    with pytest.raises(ValueError, match="max_segments"):
        Recorder(max_segments=0)
    with pytest.raises(ValueError, match="retain_ids"):
        Recorder(retain_ids=-1)


# --------------------------------------------------------------------------- id retirement
class _RaceDeque(deque):
    """A `full` queue that runs `hook` (the writer) right after the drain finds it empty:
    the interleaving where the writer rotates between the drain's two reads."""

    def __init__(self, hook: Any) -> None:
        super().__init__()
        self.hook = hook

    def popleft(self) -> Any:
        if not self and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
            raise IndexError("pop from an empty deque")
        return super().popleft()


def test_rows_held_back_by_a_racing_rotation_keep_their_request_id() -> None:
    rec = make(segment_rows=2, retain_ids=0)
    x = rec.request_begin("x", 0)
    rec.stage(x, Q, 10)
    rec.request_end(x, RequestAccounting(), t=20)  # x's 2 rows fill the segment; x retired
    y = rec.request_begin("y", 20)
    rec._state.full = _RaceDeque(lambda: rec.stage(y, Q, 30))  # rotates during drain #1
    first = rec.drain()["spans"].select(["request_id", "name"]).to_pylist()
    assert first == [{"request_id": "y", "name": "lookup"}]  # x's rows were held back
    second = rec.drain()["spans"].select(["request_id", "name"]).to_pylist()
    assert second == [{"request_id": "x", "name": "lookup"}, {"request_id": "x", "name": "queue"}]
    assert x not in rec._ids  # forgotten once no row can name it any more


def test_ids_are_forgotten_after_two_drains_beyond_the_retention() -> None:
    rec = make(retain_ids=2)
    rns = [rec.request_begin(f"r{i}", 0) for i in range(5)]
    for rn in rns:
        rec.request_end(rn, RequestAccounting(), t=1)
    rec.drain()
    assert len(rec._ids) == 5
    rec.drain()
    assert sorted(rec._ids) == rns[3:]  # the 2 most recent are retained


def test_late_rows_of_an_ended_request_keep_its_id() -> None:
    rec = make(retain_ids=1)
    a = rec.request_begin("a", 0)
    rec.request_end(a, RequestAccounting(), t=5)
    rec.drain()
    rec.activity("host_write", 6, 9, request_num=a, tier="host")  # a write-back after the end
    rec.event("eviction", t=9, request_num=a)
    out = rec.drain()
    assert out["spans"]["request_id"].to_pylist() == ["a"]
    assert out["events"]["request_id"].to_pylist() == ["a"]


# --------------------------------------------------------------------------- concurrency
def test_concurrent_drain_and_foreign_thread_deliver_every_row_once() -> None:
    n_boundaries, n_foreign = 100_000, 20_000
    rec = Recorder(segment_rows=64, max_segments=100_000, anchor=ANCHOR, retain_ids=0)
    long_lived = [rec.request_begin(f"long{i}", 0) for i in range(8)]
    chunks: list[dict[str, pa.Table]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def drainer() -> None:
        try:
            while not stop.is_set():
                chunks.append(rec.drain())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def foreign() -> None:
        try:
            for j in range(n_foreign):
                rec.activity("io", j, j + 1, request_num=long_lived[j % 8], tier="remote",
                             tokens=j, transfer_id=j)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads as finely as the GIL allows
    try:
        # Two drain threads (exporters) at once: drains are serialised, rows split between them.
        threads = [threading.Thread(target=foreign), threading.Thread(target=drainer),
                   threading.Thread(target=drainer)]
        for th in threads:
            th.start()
        t = 0
        expected_state = 0
        rn = -1
        for k in range(n_boundaries):
            if k % 10 == 0:  # churn: short requests begin and end while drains run
                if rn >= 0:
                    rec.activity("own", t, t, request_num=rn)
                    rec.request_end(rn, RequestAccounting(), t=t)
                    expected_state += 1
                rn = rec.request_begin(f"short{k}", t)
            t += 1
            rec.wait_for(rn, k)  # waits_on rows land in a dict the drain reads concurrently
            rec.stage(rn, Q if k % 2 else PREFILL, t)
            expected_state += 1
        rec.activity("own", t, t, request_num=rn)
        rec.request_end(rn, RequestAccounting(), t=t)
        expected_state += 1
        threads[0].join()
    finally:
        stop.set()
        for th in threads:
            th.join()
        sys.setswitchinterval(old)
    assert errors == []
    chunks.append(rec.drain())
    spans = pa.concat_tables([c["spans"] for c in chunks if "spans" in c])
    state = spans.filter(pa.compute.equal(spans["kind"], "state"))
    act = spans.filter(pa.compute.equal(spans["kind"], "activity"))
    assert state.num_rows == expected_state
    assert state["request_id"].null_count == 0 and act["request_id"].null_count == 0
    # Every row exactly once: (request, start, end) is unique per state row.
    keys = set(zip(state["request_id"].to_pylist(), state["start_ns"].to_pylist(),
                   state["end_ns"].to_pylist(), strict=True))
    assert len(keys) == expected_state
    waits = [w for w in state["waits_on"].to_pylist() if w is not None]
    assert sorted(w for ws in waits for w in ws) == list(range(n_boundaries))
    assert all(len(ws) == 1 for ws in waits)
    io = act.filter(pa.compute.equal(act["name"], "io"))
    assert sorted(io["tokens"].to_pylist()) == list(range(n_foreign))
    assert io["request_id"].to_pylist() == [f"long{j % 8}" for j in io["tokens"].to_pylist()]
    own = act.filter(pa.compute.equal(act["name"], "own"))
    assert own.num_rows == n_boundaries // 10
    assert rec.stats.dropped == {} and rec.stats.recording_errors == 0
    assert rec.stats.unknown_requests == 0


# --------------------------------------------------------------------------- never raises
class _Weird:
    def __index__(self) -> int:
        raise RuntimeError("boom")


GARBAGE: list[tuple[str, Any]] = [
    ("stage unknown request", lambda r, rn: r.stage(12345, Q, 1)),
    ("stage bad state code", lambda r, rn: r.stage(rn, 99, 1)),
    ("stage negative state code", lambda r, rn: r.stage(rn, -1, 1)),
    ("stage float state code", lambda r, rn: r.stage(rn, 1.5, 1)),
    ("stage float time", lambda r, rn: r.stage(rn, Q, 15.5)),
    ("stage str time", lambda r, rn: r.stage(rn, Q, "now")),
    ("stage unhashable request", lambda r, rn: r.stage([rn], Q, 1)),
    ("begin int id", lambda r, rn: r.request_begin(7, 0)),
    ("begin bad state", lambda r, rn: r.request_begin("z", 0, state="nope")),
    ("begin bad tenant", lambda r, rn: r.request_begin("z", 0, tenant=5)),
    ("begin float arrival", lambda r, rn: r.request_begin("z", 0.5)),
    ("wait_for str transfer", lambda r, rn: r.wait_for(rn, "t1")),
    ("wait_for unknown request", lambda r, rn: r.wait_for(999, 1)),
    ("first_token unknown", lambda r, rn: r.first_token(999, 5)),
    ("first_token str time", lambda r, rn: r.first_token(rn, "x")),
    ("end unknown request", lambda r, rn: r.request_end(999, RequestAccounting())),
    ("end not accounting", lambda r, rn: r.request_end(rn, {"prompt_tokens": 1})),
    ("end float tokens", lambda r, rn: r.request_end(rn, RequestAccounting(prompt_tokens=1.5))),
    ("end negative tokens", lambda r, rn: r.request_end(rn, RequestAccounting(h2d_bytes=-1))),
    ("end huge tokens", lambda r, rn: r.request_end(rn, RequestAccounting(prompt_tokens=2**64))),
    ("end bad status", lambda r, rn: r.request_end(rn, RequestAccounting(), status="meh")),
    ("end weird time", lambda r, rn: r.request_end(rn, RequestAccounting(), t=_Weird())),
    ("activity bad tier", lambda r, rn: r.activity("x", 0, 1, tier="gpu")),
    ("activity int name", lambda r, rn: r.activity(5, 0, 1)),
    ("activity None name", lambda r, rn: r.activity(None, 0, 1)),
    ("activity str start", lambda r, rn: r.activity("x", "0", 1)),
    ("activity float tokens", lambda r, rn: r.activity("x", 0, 1, tokens=1.0)),
    ("activity bad clock", lambda r, rn: r.activity("x", 0, 1, clock=5)),
    ("activity huge layer", lambda r, rn: r.activity("x", 0, 1, layer=2**40)),
    ("activity unknown request", lambda r, rn: r.activity("x", 0, 1, request_num=999)),
    ("step bad phase type", lambda r, rn: r.step_span(1, b"fwd", 0, 1)),
    ("step huge batch", lambda r, rn: r.step_span(1, "forward", 0, 1, batch_requests=2**31)),
    ("step str id", lambda r, rn: r.step_span("1", "forward", 0, 1)),
    ("layer unknown request", lambda r, rn: r.layer(999, 0, 1, 1, 1, 3)),
    ("layer negative layer", lambda r, rn: r.layer(rn, -1, 1, 1, 1, 3)),
    ("layer str tokens", lambda r, rn: r.layer(rn, 0, "1", 1, 1, 3)),
    ("layers unknown request", lambda r, rn: r.layers(999, [(1, 1, 1, 3, 0, 0, 0)])),
    ("layers str in a later row", lambda r, rn: r.layers(rn, [(1, 1, 1, 3, 0, 0, 0),
                                                              (1, "1", 1, 3, 0, 0, 0)])),
    ("layers short row", lambda r, rn: r.layers(rn, [(1, 1, 1)])),
    ("event int name", lambda r, rn: r.event(5)),
    ("event list detail", lambda r, rn: r.event("x", detail=[1])),
    ("event float time", lambda r, rn: r.event("x", t=1.5)),
    ("event unknown request", lambda r, rn: r.event("x", request_num=999)),
    ("sample str value", lambda r, rn: r.sample("pool", "m", "high")),
    ("sample int entity", lambda r, rn: r.sample("pool", "m", 1, entity=3)),
    ("sample None metric", lambda r, rn: r.sample("pool", None, 1)),
    ("step_spans bad phase type", lambda r, rn: r.step_spans(1, [("prepare", 0, 1, CLOCK_CPU),
                                                                  (b"fwd", 1, 2, CLOCK_CPU)])),
    ("step_spans bad clock", lambda r, rn: r.step_spans(1, [("forward", 0, 1, 7)])),
    ("step_spans str time", lambda r, rn: r.step_spans(1, [("forward", "0", 1, CLOCK_CPU)])),
    ("samples str value in a later row", lambda r, rn: r.samples(
        "pool", [("m", 1, None, None), ("m", "high", None, None)])),
    ("samples int entity", lambda r, rn: r.samples("pool", [("m", 1, 3, None)])),
]


@pytest.mark.parametrize("call", [c for _, c in GARBAGE], ids=[n for n, _ in GARBAGE])
def test_garbage_is_counted_never_raised_and_changes_nothing(call: Any) -> None:
    rec = make()
    rn = rec.request_begin("a", 0)
    rec.stage(rn, Q, 10)
    call(rec, rn)
    stats = rec.stats
    assert stats.recording_errors + stats.unknown_requests == 1
    # The request is intact: it still tiles [0, 30] and the drain builds every table.
    rec.stage(rn, PREFILL, 20)
    rec.request_end(rn, RequestAccounting(), t=30)
    out = rec.drain()
    state = out["spans"].filter(pa.compute.equal(out["spans"]["kind"], "state"))
    state = state.filter(pa.compute.equal(state["request_id"], "a"))
    assert [(r["name"], r["start_ns"] - OFF, r["end_ns"] - OFF) for r in state.to_pylist()] == [
        ("lookup", 0, 10), ("queue", 10, 20), ("prefill", 20, 30)]
    assert out["requests"]["request_id"].to_pylist() == ["a"]
    assert stats.dropped == {}


def test_a_table_that_cannot_be_built_is_dropped_and_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.telemetry import tables

    def broken(*args: Any) -> pa.Table:
        raise RuntimeError("a bug in a table builder")

    monkeypatch.setattr(tables, "samples_table", broken)  # simulates a bug, not bad input
    rec = make()
    for k in range(3):
        rec.sample("pool", "m", k, t=k)
    rec.event("x", t=1)
    out = rec.drain()
    assert set(out) == {"events"}
    assert rec.stats.dropped == {"samples": 3} and rec.stats.recording_errors == 1


def test_unserialisable_event_detail_does_not_break_the_drain() -> None:
    rec = make()
    loop: dict[str, Any] = {}
    loop["self"] = loop
    rec.event("a", t=1, detail={(1, 2): "tuple key"})
    rec.event("b", t=2, detail=loop)
    rec.event("c", t=3, detail={"when": ClockAnchor(1, 2)})  # not JSON: written with str()
    details = rec.drain()["events"]["detail"].to_pylist()
    assert details[0].startswith('{"unserializable": "TypeError"')
    assert details[1].startswith('{"unserializable": "ValueError"')
    assert details[2] == '{"when": "ClockAnchor(wall_ns=1, mono_ns=2)"}'


def test_a_failing_clock_is_counted() -> None:
    def broken() -> int:
        raise OSError("clock gone")

    rec = Recorder(clock=broken, anchor=ANCHOR)
    assert rec.request_begin("a") == -1
    rec.event("x")
    rec.sample("pool", "m", 1)
    assert rec.stats.recording_errors == 3


def test_a_failing_annotator_does_not_break_the_partition() -> None:
    class Broken:
        def start(self, name: str, payload: int) -> int:
            raise RuntimeError("profiler gone")

        def end(self, rid: int) -> None:
            raise RuntimeError("profiler gone")

    rec = make()
    rec.add_annotator(Broken())
    rn = rec.request_begin("a", 0)
    rec.stage(rn, Q, 10)
    rec.stage(rn, PREFILL, 20)
    rec.request_end(rn, RequestAccounting(), t=30)
    out = rec.drain()
    assert [(r["start_ns"] - OFF, r["end_ns"] - OFF) for r in out["spans"].to_pylist()] == [
        (0, 10), (10, 20), (20, 30)]
    assert rec.stats.recording_errors == 3  # the three starts (request_begin, 2 stages)


def test_publish_replaces_the_status_whole() -> None:
    rec = make()
    assert rec.status is None
    first = EngineStatus(running=3, waiting=1, preemptions=2)
    rec.publish(first)
    seen = rec.status
    rec.publish(EngineStatus(running=0, waiting=0, preemptions=2))
    assert seen is first and seen.running == 3  # a reader's snapshot never changes under it
    assert rec.status is not None and rec.status.running == 0


def test_transfer_ids_are_unique_across_threads() -> None:
    rec = make()
    got: list[int] = []

    def take() -> None:
        got.extend(rec.new_transfer_id() for _ in range(5_000))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(got) == list(range(1, 20_001))


def test_activities_from_many_threads_keep_names_and_codes_consistent() -> None:
    # Four non-owner threads intern new names and queue rows at once: every code must map back
    # to its own name and every row must arrive once.
    rec = make()
    names = [f"n{i}" for i in range(400)]

    def record(offset: int) -> None:
        for i in range(len(names)):
            rec.activity(names[(i + offset) % len(names)], 0, 1)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=record, args=(k * 97,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    for name in names:
        assert rec._name_list[rec._names[name]] == name
    acts = rec.drain()["spans"]["name"].to_pylist()
    assert sorted(acts) == sorted(names * 4)


def test_clock_codes() -> None:
    assert (CLOCK_CPU, CLOCK_CUDA) == (0, 1)


# --------------------------------------------------------------------------- clock
def test_clock_anchor_converts_exactly() -> None:
    a = ClockAnchor(wall_ns=1_000_000_123, mono_ns=123)
    assert a.offset_ns == 1_000_000_000
    assert a.to_epoch_ns(500) == 1_000_000_500
    assert a.to_dict() == {"wall_ns": 1_000_000_123, "mono_ns": 123}


def test_clock_anchor_take_pairs_the_two_clocks() -> None:
    import time

    m0, w0 = time.monotonic_ns(), time.time_ns()
    a = ClockAnchor.take()
    m1, w1 = time.monotonic_ns(), time.time_ns()
    assert m0 <= a.mono_ns <= m1 and w0 <= a.wall_ns <= w1


def test_process_anchor_is_one_per_process_even_under_a_race() -> None:
    from agent import clock

    old = clock._PROCESS_ANCHOR
    clock._PROCESS_ANCHOR = None
    try:
        got: list[ClockAnchor] = []
        start = threading.Barrier(8)

        def take() -> None:
            start.wait()
            got.append(clock.process_anchor())

        threads = [threading.Thread(target=take) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len({id(a) for a in got}) == 1
        assert Recorder().anchor is got[0]
    finally:
        clock._PROCESS_ANCHOR = old


def test_requests_begun_on_another_thread_get_unique_numbers() -> None:
    rec = make()
    got: list[int] = []

    def begin() -> None:
        got.extend(rec.request_begin(f"t{threading.get_ident()}-{k}", k) for k in range(2_000))

    threads = [threading.Thread(target=begin) for _ in range(3)]
    for th in threads:
        th.start()
    begin()
    for th in threads:
        th.join()
    assert sorted(got) == list(range(8_000))
    assert rec.open_requests() == 8_000


def test_output_digest_is_a_function_of_the_ids_only() -> None:
    assert output_digest([1, 2, 3]) == output_digest(iter([1, 2, 3]))
    assert output_digest([1, 2, 3]) != output_digest([1, 2, 4]) != output_digest([1, 2])
    assert output_digest([2**40]) != output_digest([0])  # int64, not bytes of the low digits
    assert len(output_digest([])) == 32 and int(output_digest([7]), 16) >= 0


def test_one_layers_call_records_what_one_layer_call_per_layer_does() -> None:
    rows = [(16 * i, 16, 32, 48 + 16 * i, 90 * i, 10, i) for i in range(3)]
    tables = []
    for batched in (True, False):
        rec = make()
        rn = rec.request_begin("a", 0)
        if batched:
            rec.layers(rn, rows)
        else:
            for layer, r in enumerate(rows):
                rec.layer(rn, layer, *r[:6], skipped_tokens=r[6])
        # From another thread too (queued, validated the same way).
        t = threading.Thread(target=rec.layers, args=(rn, rows[:1]))
        t.start()
        t.join()
        rec.request_end(rn, RequestAccounting(), t=5)
        tables.append(rec.drain()["layers"].to_pylist())
        assert rec.stats.recording_errors == 0
    assert tables[0] == tables[1] and len(tables[0]) == 4


def test_layers_rows_cross_segment_boundaries() -> None:
    rec = Recorder(segment_rows=4, max_segments=8)
    rn = rec.request_begin("a", 0)
    rows = [(i, 0, 1, 1 + i, 0, 0, 0) for i in range(10)]  # 10 rows over 3 segments
    rec.layers(rn, rows)
    rec.request_end(rn, RequestAccounting(), t=5)
    got = rec.drain()["layers"].to_pylist()
    assert [(r["layer"], r["hit_tokens"], r["prompt_tokens"]) for r in got] == [
        (i, i, 1 + i) for i in range(10)]


def test_one_step_spans_call_records_what_one_step_span_call_per_phase_does() -> None:
    phases = [("schedule", 0, 5, CLOCK_CPU), ("prepare", 5, 9, CLOCK_CPU),
              ("sample", 20, 22, CLOCK_CPU), ("forward", 9, 20, CLOCK_CUDA)]
    tables = []
    for batched in (True, False):
        rec = make()
        for step in (0, 1):
            if batched:
                rec.step_spans(step, phases, batch_requests=3, tokens=70)
            else:
                for name, t0, t1, clock in phases:
                    rec.step_span(step, name, t0, t1, batch_requests=3, tokens=70, clock=clock)
        t = threading.Thread(target=rec.step_spans, args=(2, phases[:1]),
                             kwargs={"batch_requests": 1, "tokens": 2})
        t.start()
        t.join()
        tables.append(rec.drain()["spans"].to_pylist())
        assert rec.stats.recording_errors == 0
    assert tables[0] == tables[1] and len(tables[0]) == 9


def test_one_samples_call_records_what_one_sample_call_per_row_does() -> None:
    rows = [("in_use", 3, "device", "blocks"), ("empty", 5.5, "host", None),
            ("remote_read_ok", 7, "remote", "operations")]
    tables = []
    for batched in (True, False):
        rec = make()
        if batched:
            rec.samples("pool", rows, t=40)
        else:
            for metric, value, entity, unit in rows:
                rec.sample("pool", metric, value, entity=entity, unit=unit, t=40)
        tables.append(rec.drain()["samples"].to_pylist())
        assert rec.stats.recording_errors == 0
    assert tables[0] == tables[1] and len(tables[0]) == 3


def test_samples_beyond_the_bound_are_dropped_and_counted() -> None:
    rec = Recorder(segment_rows=2, max_segments=2)  # 4 rows at most
    rec.samples("pool", [("m", i, None, None) for i in range(6)], t=1)
    assert rec.stats.dropped == {"samples": 2}
    assert rec.drain()["samples"]["value"].to_pylist() == [0.0, 1.0, 2.0, 3.0]


def test_now_is_the_clock() -> None:
    clock = FakeClock(7)
    rec = Recorder(clock=clock)
    assert rec.now is clock and rec.now() == 7


def test_step_spans_cross_segment_boundaries_and_the_bound() -> None:
    rec = Recorder(segment_rows=3, max_segments=2, anchor=ANCHOR)  # 9 rows before a drain
    phases = [(name, i, i + 1, CLOCK_CPU) for i, name in
              enumerate(("schedule", "prepare", "sample", "forward"))]
    for step in range(3):
        rec.step_spans(step, phases, batch_requests=1, tokens=2)
    assert rec.stats.dropped == {"spans": 3}
    got = rec.drain()["spans"].to_pylist()
    assert [(r["step_id"], r["name"]) for r in got] == [
        (s, n) for s in range(3) for n, *_ in phases][:9]
