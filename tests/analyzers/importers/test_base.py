from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.schema import TTFT_STAGES
from analyzers.importers.base import spans_frame, sweep_partition


def test_sweep_priority_gap_and_clipping():
    # request 0 window [0, 100): queue [0,60) overlaps h2d [40,70); nothing in [70,80);
    # prefill [80,120) is clipped at first token. Request 1 window [1000, 1010): lookup only.
    part = sweep_partition(
        req=np.array([0, 0, 0, 1]),
        stage=np.array(["queue", "h2d", "prefill", "lookup"], dtype=object),
        start_ns=np.array([0, 40, 80, 1000]), end_ns=np.array([60, 70, 120, 1010]),
        arrival_ns=np.array([0, 1000]), first_ns=np.array([100, 1010]))
    got = list(zip(part.req.tolist(), part.stage.tolist(), part.start_ns.tolist(),
                   part.end_ns.tolist(), strict=True))
    assert got == [(0, "queue", 0, 40), (0, "h2d", 40, 70), (0, "other", 70, 80),
                   (0, "prefill", 80, 100), (1, "lookup", 1000, 1010)]
    assert (part.overlap_ns, part.other_ns) == (20, 10)


def test_request_without_ranges_is_all_other():
    part = sweep_partition(np.array([], dtype=np.int64), np.array([], dtype=object),
                           np.array([], dtype=np.int64), np.array([], dtype=np.int64),
                           np.array([10]), np.array([30]))
    assert part.stage.tolist() == ["other"] and part.other_ns == 20


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(TTFT_STAGES),
                          st.integers(0, 200), st.integers(0, 200)), max_size=30))
def test_sweep_always_partitions_each_window(ranges):
    arrival = np.array([0, 50, 500])
    first = np.array([100, 250, 600])
    req = np.array([r[0] for r in ranges], dtype=np.int64)
    stage = np.array([r[1] for r in ranges], dtype=object)
    a = np.array([min(r[2], r[3]) for r in ranges], dtype=np.int64) + arrival[req]
    b = np.array([max(r[2], r[3]) for r in ranges], dtype=np.int64) + arrival[req]
    part = sweep_partition(req, stage, a, b, arrival, first)
    for r in range(3):
        m = part.req == r
        s, e = part.start_ns[m], part.end_ns[m]
        assert s[0] == arrival[r] and e[-1] == first[r]
        assert (s[1:] == e[:-1]).all() and (e > s).all()
        names = part.stage[m]
        assert (names[1:] != names[:-1]).all()  # adjacent equal stages are merged


def test_spans_frame_has_schema_columns_and_nullable_ints():
    df = spans_frame({"kind": ["activity"], "name": ["h2d"], "start_ns": [1], "end_ns": [2],
                      "clock": ["cpu"], "bytes": [None]}, 1)
    assert str(df["bytes"].dtype) == "Int64" and df["bytes"].isna().all()
    assert str(df["layer"].dtype) == "Int32"
