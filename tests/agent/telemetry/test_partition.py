"""The TTFT partition: impossible to break through the Recorder API, flagged (never repaired) in
imported data."""

from __future__ import annotations

import itertools
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.clock import ClockAnchor
from agent.schema import STATE_CODE, STATES, TTFT_STAGES
from agent.telemetry import PartitionViolation, Recorder, RequestAccounting, check_partition

ANCHOR = ClockAnchor(wall_ns=10**18, mono_ns=0)
DECODE = STATE_CODE["decode"]

# (request index, op, state code among the TTFT stages, time step that may go backwards)
OPS = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from(["stage", "stage", "stage", "first_token",
                                                  "drain"]),
              st.integers(0, len(TTFT_STAGES) - 1), st.integers(-40, 100)),
    max_size=60,
)


class _Model:
    """What the recorder must produce for one request."""

    def __init__(self, rid: str, arrival: int) -> None:
        self.rid = rid
        self.arrival = arrival
        self.state = STATE_CODE["lookup"]
        self.start = arrival
        self.first: int | None = None
        self.spans: list[tuple[str, int, int]] = []
        self.regressions = 0

    def move(self, state: int, t: int) -> None:
        if t < self.start:
            self.regressions += 1
            t = self.start
        self.spans.append((STATES[self.state], self.start, t))
        self.state, self.start = state, t


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(st.integers(0, 1_000), min_size=3, max_size=3), ops=OPS,
       ends=st.lists(st.integers(-40, 100), min_size=3, max_size=3))
def test_recorder_states_tile_arrival_to_finish(arrivals: list[int], ops: list[Any],
                                                ends: list[int]) -> None:
    rec = Recorder(anchor=ANCHOR, clock=lambda: 0, segment_rows=4)
    models = [_Model(f"r{i}", a) for i, a in enumerate(arrivals)]
    rns = [rec.request_begin(m.rid, m.arrival) for m in models]
    drained: list[dict[str, pa.Table]] = []
    errors = 0
    for who, op, state, dt in ops:
        m, rn = models[who], rns[who]
        t = m.start + dt
        if op == "stage":
            rec.stage(rn, state, t)
            m.move(state, t)
        elif op == "first_token":
            rec.first_token(rn, t)
            if m.first is None:
                m.move(DECODE, t)
                m.first = m.start
            else:
                errors += 1  # TTFT ends once
        else:
            drained.append(rec.drain())
    for m, rn, dt in zip(models, rns, ends, strict=True):
        t = m.start + dt
        rec.request_end(rn, RequestAccounting(), t=t)
        m.move(m.state, t)
    drained.append(rec.drain())

    assert rec.stats.recording_errors == errors
    assert rec.stats.clock_regressions == sum(m.regressions for m in models)
    spans = pa.concat_tables([d["spans"] for d in drained if "spans" in d])
    requests = pa.concat_tables([d["requests"] for d in drained if "requests" in d])
    off = ANCHOR.offset_ns
    by_req = {m.rid: [] for m in models}
    for row in spans.to_pylist():
        assert row["kind"] == "state"
        by_req[row["request_id"]].append((row["name"], row["start_ns"] - off,
                                          row["end_ns"] - off))
    for m in models:
        got = by_req[m.rid]
        assert got == m.spans
        # Tiling: first at arrival, each where the previous ended, the last at finish.
        assert got[0][1] == m.arrival
        assert all(a[2] == b[1] for a, b in itertools.pairwise(got))
        assert all(s <= e for _, s, e in got)
        assert got[-1][2] == m.start
    req = {r["request_id"]: r for r in requests.to_pylist()}
    for m in models:
        assert req[m.rid]["arrival_ns"] - off == m.arrival
        assert req[m.rid]["finish_ns"] - off == m.start
        assert (req[m.rid]["first_token_ns"] is None) == (m.first is None)
        if m.first is not None:
            assert req[m.rid]["first_token_ns"] - off == m.first
            ttft = sum(e - s for name, s, e in by_req[m.rid] if name != "decode" and s < m.first)
            assert ttft == m.first - m.arrival
    assert check_partition(spans, requests) == []


# --------------------------------------------------------------------------- imported data
def spans_table(rows: list[tuple[Any, ...]]) -> pa.Table:
    """Rows (request_id, name, start, end[, kind])."""
    return pa.table({
        "request_id": pa.array([r[0] for r in rows], pa.string()),
        "kind": pa.array([r[4] if len(r) > 4 else "state" for r in rows], pa.string()),
        "name": pa.array([r[1] for r in rows], pa.string()),
        "start_ns": pa.array([r[2] for r in rows], pa.int64()),
        "end_ns": pa.array([r[3] for r in rows], pa.int64()),
    })


def requests_table(rows: list[tuple[Any, ...]]) -> pa.Table:
    """Rows (request_id, arrival, first_token)."""
    return pa.table({
        "request_id": pa.array([r[0] for r in rows], pa.string()),
        "arrival_ns": pa.array([r[1] for r in rows], pa.int64()),
        "first_token_ns": pa.array([r[2] for r in rows], pa.int64()),
    })


def v(rid: str, kind: str, at: int, size: int) -> PartitionViolation:
    return PartitionViolation(rid, kind, at, size)


CASES: list[tuple[str, list[tuple[Any, ...]], tuple[int, int], list[PartitionViolation]]] = [
    ("exact", [("lookup", 0, 10), ("queue", 10, 30), ("prefill", 30, 50)], (0, 50), []),
    ("zero-length spans are fine", [("lookup", 0, 0), ("queue", 0, 20), ("sync", 20, 20),
                                    ("prefill", 20, 50)], (0, 50), []),
    ("gap", [("lookup", 0, 10), ("queue", 12, 50)], (0, 50), [v("r", "gap", 10, 2)]),
    ("overlap", [("lookup", 0, 12), ("queue", 10, 50)], (0, 50), [v("r", "overlap", 10, 2)]),
    ("nested overlap measured against the furthest end",
     [("queue", 0, 40), ("h2d", 5, 8), ("sync", 8, 12), ("prefill", 40, 50)], (0, 50),
     [v("r", "overlap", 5, 3), v("r", "overlap", 8, 4)]),
    ("late start", [("queue", 5, 50)], (0, 50), [v("r", "starts_late", 0, 5)]),
    ("early start", [("lookup", -3, 50)], (0, 50), [v("r", "starts_early", -3, 3)]),
    ("early end", [("lookup", 0, 44)], (0, 50), [v("r", "ends_early", 44, 6)]),
    ("late end", [("lookup", 0, 10), ("prefill", 10, 57)], (0, 50), [v("r", "ends_late", 50, 7)]),
    ("negative span is reported and left out",
     [("lookup", 0, 10), ("queue", 30, 20), ("prefill", 10, 50)], (0, 50),
     [v("r", "negative", 30, 10)]),
    ("only a negative span", [("queue", 30, 20)], (0, 50),
     [v("r", "no_spans", 0, 50), v("r", "negative", 30, 10)]),
    ("no spans", [], (0, 50), [v("r", "no_spans", 0, 50)]),
    ("first token before arrival", [], (10, 4), [v("r", "negative_ttft", 4, 6)]),
    ("zero TTFT without spans", [], (7, 7), []),
    ("several at once, in time order",
     [("lookup", 2, 10), ("queue", 15, 20), ("prefill", 18, 45)], (0, 50),
     [v("r", "starts_late", 0, 2), v("r", "gap", 10, 5), v("r", "overlap", 18, 2),
      v("r", "ends_early", 45, 5)]),
    ("decode, activity and post-TTFT stage spans are not part of it",
     [("lookup", 0, 50), ("decode", 50, 60), ("h2d", 3, 90, "activity"), ("queue", 60, 70),
      ("forward", 1, 2, "step")], (0, 50), []),
]


@pytest.mark.parametrize("rows,times,expected", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_check_partition_flags_exact_sizes_and_positions(
        rows: list[tuple[Any, ...]], times: tuple[int, int],
        expected: list[PartitionViolation]) -> None:
    spans = spans_table([("r", *row) for row in rows])
    requests = requests_table([("r", *times)])
    assert check_partition(spans, requests) == expected


def test_violations_are_ordered_by_request_then_time_and_never_modify_data() -> None:
    spans = spans_table([
        ("b", "lookup", 0, 10), ("b", "queue", 20, 30),
        ("a", "lookup", 5, 10), ("a", "queue", 10, 12),
        (None, "lookup", 0, 1), ("ghost", "lookup", 0, 1),  # ignored: no such request
        ("skip", "lookup", 0, 99),  # no first token: not checked
    ])
    requests = requests_table([("b", 0, 30), ("a", 0, 12), ("c", 3, 9), ("skip", 0, None)])
    spans_before = pa.table(spans.to_pydict(), schema=spans.schema)
    requests_before = pa.table(requests.to_pydict(), schema=requests.schema)
    got = check_partition(spans, requests)
    assert got == [v("b", "gap", 10, 10), v("a", "starts_late", 0, 5), v("c", "no_spans", 3, 6)]
    assert spans.equals(spans_before) and requests.equals(requests_before)
    assert str(got[0]) == "request b: gap of 10 ns at 10"


def test_missing_columns_are_named() -> None:
    spans = spans_table([("r", "lookup", 0, 1)]).drop_columns(["kind"])
    with pytest.raises(ValueError, match=r"spans table lacks column.*kind"):
        check_partition(spans, requests_table([("r", 0, 1)]))


def test_many_requests_are_checked_vectorised() -> None:
    n = 50_000
    rids = [f"r{i}" for i in range(n)]
    # Every request: lookup [0, 10), queue [10, 20), prefill [20, 30); every 1000th has a gap.
    starts = [0, 10, 20]
    rows_r, rows_n, rows_s, rows_e = [], [], [], []
    for i, rid in enumerate(rids):
        for k, name in enumerate(("lookup", "queue", "prefill")):
            rows_r.append(rid)
            rows_n.append(name)
            rows_s.append(starts[k] + (1 if k == 2 and i % 1000 == 0 else 0))
            rows_e.append(starts[k] + 10)
    spans = pa.table({"request_id": rows_r, "kind": ["state"] * len(rows_r), "name": rows_n,
                      "start_ns": pa.array(rows_s, pa.int64()),
                      "end_ns": pa.array(rows_e, pa.int64())})
    requests = requests_table([(rid, 0, 30) for rid in rids])
    got = check_partition(spans, requests)
    assert got == [v(f"r{i}", "gap", 20, 1) for i in range(0, n, 1000)]
    assert pc.sum(spans["end_ns"]).as_py() == n * 60  # untouched
