"""Interval partitioning: lay overlapping spans out on the fewest lanes (threads) of a track.

Trace viewers draw `X` slices of one thread as a stack, so slices on one thread must nest or be
disjoint; and they bind flow arrows only to thread slices. Spans that overlap freely (KV
transfers, concurrent GPU work) therefore go on lanes, each lane a thread.
"""

from __future__ import annotations

import heapq

import numpy as np
import pandas as pd


def assign_lanes(group: np.ndarray, start: np.ndarray, end: np.ndarray, *,
                 strict: bool = True) -> np.ndarray:
    """A lane number (0, 1, ...) per span such that spans on one (group, lane) never overlap.

    Greedy interval partitioning in start order with a min-heap of lane end times, which uses
    the fewest lanes possible (as many as the deepest overlap); a span takes the lowest lane
    free at its start. Groups without any overlap,
    the common case, are settled vectorised; only overlapping groups take the O(n log n) loop.

    Args:
        group: a key per span (lanes are numbered per group).
        start: span starts (any int or float unit).
        end: span ends, >= start.
        strict: True → spans on one lane do not even touch (`end < next start`), so every
            instant of a span belongs to it alone on its lane (what flow binding needs);
            False → back-to-back spans (`end == next start`) may share a lane.

    Returns:
        int64 lane per span, in input order.
    """
    n = len(start)
    lanes = np.zeros(n, np.int64)
    if n == 0:
        return lanes
    codes = pd.factorize(pd.Series(group), use_na_sentinel=False)[0]
    order = np.lexsort((end, start, codes))
    g, s, e = codes[order], np.asarray(start)[order], np.asarray(end)[order]
    # End of the latest-ending earlier span of the same group, kept in the input dtype: epoch ns
    # do not survive a float64 round trip.
    running_max = pd.Series(e).groupby(g).cummax().to_numpy()
    prev = np.r_[running_max[:1], running_max[:-1]]
    first = np.r_[True, g[1:] != g[:-1]]
    clash = ~first & ((s <= prev) if strict else (s < prev))
    # A lane whose last span ends before `free_below` is free: `end < start` when strict, and
    # `end <= start` (as `end < next value after start`) otherwise.
    if strict:
        free_below = s
    elif np.issubdtype(s.dtype, np.integer):
        free_below = s + 1
    else:
        free_below = np.nextafter(s, np.inf)
    for code in np.unique(g[clash]):
        idx = np.flatnonzero(g == code)
        # Lanes freed by the current start go back to `free`, and a span takes the lowest free
        # lane, so lane 0 stays the busiest and the lane count is the deepest overlap.
        running: list[tuple[float, int]] = []  # (end, lane) of the lanes in use
        free: list[int] = []
        used = 0
        got = []
        # NOTE: plain Python lists: indexing numpy arrays per element is several times slower.
        for lim, ei in zip(free_below[idx].tolist(), e[idx].tolist(), strict=True):
            while running and running[0][0] < lim:
                heapq.heappush(free, heapq.heappop(running)[1])
            if free:
                lane = heapq.heappop(free)
            else:
                lane = used
                used += 1
            heapq.heappush(running, (ei, lane))
            got.append(lane)
        lanes[order[idx]] = got
    return lanes
