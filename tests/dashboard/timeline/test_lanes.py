"""Interval partitioning of overlapping spans onto lanes, and the nesting check itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from dashboard.timeline import assign_lanes
from tests.dashboard.timeline.synthetic import T0, assert_slices_nest


@given(hs.lists(hs.tuples(hs.integers(0, 2), hs.integers(0, 50), hs.integers(1, 20)),
                max_size=40), hs.booleans())
@settings(max_examples=100, deadline=None)
def test_assign_lanes_fewest_disjoint(rows: list[tuple[int, int, int]], strict: bool) -> None:
    group = np.array([g for g, _, _ in rows], np.int64)
    start = np.array([s for _, s, _ in rows], np.int64)
    end = start + np.array([d for _, _, d in rows], np.int64)
    lanes = assign_lanes(group, start, end, strict=strict)
    assert lanes.shape == (len(rows),)
    for g in set(group.tolist()):
        m = group == g
        s, e, ln = start[m], end[m], lanes[m]
        for lane in set(ln.tolist()):
            o = np.argsort(s[ln == lane], kind="stable")
            ls, le = s[ln == lane][o], e[ln == lane][o]
            gap = ls[1:] - le[:-1]
            assert (gap > 0).all() if strict else (gap >= 0).all()
        # As many lanes as the deepest overlap: greedy partitioning is optimal.
        depth = max(int(((s <= t) & ((e >= t) if strict else (e > t))).sum()) for t in s)
        assert int(ln.max()) + 1 == max(depth, 1)


def test_assign_lanes_exact() -> None:
    start = np.array([0, 1, 2, 10, 5, 0])
    end = np.array([5, 2, 3, 11, 10, 0])
    assert assign_lanes(np.zeros(6), start, end).tolist() == [1, 0, 2, 1, 0, 0]
    assert assign_lanes(np.zeros(6), start, end, strict=False).tolist() == [0, 1, 1, 0, 0, 0]
    assert assign_lanes(np.array(["a"] * 3 + ["b"] * 3), start, end).tolist() == [
        0, 1, 2, 1, 0, 0]
    # Epoch ns, 3 ns apart: beyond float64 precision, so the overlap test must stay integer.
    assert assign_lanes(np.zeros(2), T0 + np.array([0, 3]), T0 + np.array([5, 8]),
                        strict=False).tolist() == [0, 1]

def test_nesting_check_catches_partial_overlap() -> None:
    def x(tid: int, ts: float, dur: float) -> dict[str, Any]:
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    nested = {"traceEvents": [x(1, 0, 10), x(1, 2, 3), x(1, 5, 5), x(2, 4, 1), x(1, 10, 1)]}
    assert assert_slices_nest(nested) == 2
    with pytest.raises(AssertionError, match=r"partial overlap on \(1, 1\) at 5"):
        assert_slices_nest({"traceEvents": [x(1, 0, 10), x(1, 5, 10)]})
