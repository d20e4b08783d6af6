"""The interval algebra of the partition: each function against a brute-force recomputation
over every nanosecond of small windows, and its two partitions against each other."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.intervals import (
    clip_to_window,
    group_running_max,
    merge_intervals,
    priority_partition,
    priority_spans,
    union_length,
)
from agent.schema import STAGE_PRIORITY, TTFT_STAGES

OTHER = TTFT_STAGES.index("other")


def test_merge_intervals_joins_overlapping_and_touching_ones() -> None:
    s, e = merge_intervals(np.array([5, 0, 2, 10, 20]), np.array([8, 3, 4, 12, 20]))
    assert s.tolist() == [0, 5, 10, 20] and e.tolist() == [4, 8, 12, 20]
    assert union_length(np.array([0, 2, 10]), np.array([3, 4, 11])) == 5
    assert union_length(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == 0


def test_group_running_max_restarts_per_group() -> None:
    g = np.array([0, 0, 0, 1, 1, 2])
    v = np.array([5, 3, 9, 1, 4, 2])
    assert group_running_max(g, v).tolist() == [5, 5, 9, 1, 4, 2]


windows = st.lists(st.integers(0, 40), min_size=1, max_size=4)
intervals = st.lists(st.tuples(st.integers(0, 3), st.integers(0, len(TTFT_STAGES) - 1),
                               st.integers(-5, 45), st.integers(-5, 45)), max_size=12)


def _brute(widths: list[int], ivs: list[tuple[int, int, int, int]]) -> np.ndarray:
    """Time per stage per group, instant by instant: the best-ranked covering stage owns it."""
    rank = {s: i for i, s in enumerate(STAGE_PRIORITY)}
    out = np.zeros((len(widths), len(TTFT_STAGES)), dtype=np.int64)
    for g, w in enumerate(widths):
        for t in range(w):
            open_ = [stg for gg, stg, a, b in ivs if gg == g and a <= t < b]
            best = min(open_, key=lambda x: rank[TTFT_STAGES[x]], default=OTHER)
            out[g, best] += 1
    return out


@settings(max_examples=300, deadline=None, derandomize=True)
@given(windows, intervals)
def test_both_partitions_agree_with_a_brute_force_sweep(widths: list[int],
                                                        ivs: list[tuple]) -> None:
    ivs = [(g % len(widths), stg, a, b) for g, stg, a, b in ivs]
    want = _brute(widths, ivs)
    g = np.array([x[0] for x in ivs], dtype=np.int64)
    stage = np.array([x[1] for x in ivs], dtype=np.int64)
    start = np.array([x[2] for x in ivs], dtype=np.int64)
    end = np.array([x[3] for x in ivs], dtype=np.int64)
    origin = np.zeros(len(widths), dtype=np.int64)
    width = np.array(widths, dtype=np.int64)
    s, e = clip_to_window(g, start, end, origin, origin + width)
    totals, _ = priority_partition(g, s, e, stage, origin, width)
    assert totals.tolist() == want.tolist()
    sg, sst, ss, se, _, other = priority_spans(g, stage, start, end, origin, origin + width)
    spans = np.zeros_like(want)
    np.add.at(spans, (sg, sst), se - ss)
    assert spans.tolist() == want.tolist()
    uncovered = sum(1 for grp, w in enumerate(widths) for t in range(w)
                    if not any(gg == grp and a <= t < b for gg, _, a, b in ivs))
    assert other == uncovered
    # The spans tile each window: sorted, no gap, no overlap.
    for grp in range(len(widths)):
        m = sg == grp
        if widths[grp]:
            assert ss[m][0] == 0 and se[m][-1] == widths[grp]
            assert (ss[m][1:] == se[m][:-1]).all()
        else:
            assert not m.any()
