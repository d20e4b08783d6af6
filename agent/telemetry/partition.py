"""Checks that state spans partition [arrival, first_token] of every request exactly.

The recorder's API makes a gap or overlap impossible; imported traces and hand-written run stores
can still contain them. This check flags every violation with where and how large it is; it
never repairs data (analyzers report what they found instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent.intervals import group_running_max
from agent.schema import TTFT_STAGES

#: Violation kinds, in the order they are listed for one instant of one request.
KINDS: tuple[str, ...] = ("negative_ttft", "no_spans", "negative", "starts_early", "starts_late",
                          "gap", "overlap", "ends_early", "ends_late")


@dataclass(slots=True, frozen=True)
class PartitionViolation:
    """One place where a request's TTFT-stage spans fail to tile [arrival, first_token].

    Attributes:
        request_id: the request.
        kind: one of `KINDS`.
        at_ns: where it starts (the gap's or overlap's start, the arrival for a late start, the
            last span's end for an early end, ...).
        size_ns: how long it is (always > 0).
    """

    request_id: str
    #: gap | overlap | starts_late | starts_early | ends_early | ends_late | negative | no_spans
    #: | negative_ttft (first token before arrival)
    kind: str
    at_ns: int
    size_ns: int

    def __str__(self) -> str:
        return f"request {self.request_id}: {self.kind} of {self.size_ns} ns at {self.at_ns}"


_SPAN_COLS = ("request_id", "kind", "name", "start_ns", "end_ns")
_REQ_COLS = ("request_id", "arrival_ns", "first_token_ns")


def check_partition(spans: pa.Table, requests: pa.Table) -> list[PartitionViolation]:
    """Violations of the TTFT partition, ordered by request (as in `requests`), then time.

    Only `kind == "state"` spans named after a TTFT stage that start before the request's first
    token are checked: stage spans after it (a request re-queued by a preemption during decode)
    are decode time, not TTFT. A negative span (end < start) is reported and left out of the
    rest of the analysis (a request with nothing else is also `no_spans`). An overlap's size is
    the overlapped part of the later span, measured against the furthest end of all earlier
    spans of the request; zero-length spans never overlap anything. A request with a zero TTFT
    needs no spans.

    Args:
        spans: a table with `request_id, kind, name, start_ns, end_ns` (other columns ignored).
        requests: a table with `request_id, arrival_ns, first_token_ns`; requests without a
            first token are skipped.

    Returns:
        The violations (empty when every request's spans tile its TTFT exactly).

    Raises:
        ValueError: a required column is missing.
    """
    for tbl, cols, what in ((spans, _SPAN_COLS, "spans"), (requests, _REQ_COLS, "requests")):
        missing = [c for c in cols if c not in tbl.column_names]
        if missing:
            raise ValueError(f"check_partition: {what} table lacks column(s) {missing}")
    state = spans.filter(
        pc.and_(pc.equal(spans["kind"], "state"),
                pc.is_in(spans["name"], value_set=pa.array(TTFT_STAGES)))
    )
    req = requests.filter(pc.is_valid(requests["first_token_ns"]))
    req_ids = req["request_id"].to_pylist()
    arrival = np.asarray(req["arrival_ns"].to_numpy(), dtype=np.int64)
    first = np.asarray(req["first_token_ns"].to_numpy(), dtype=np.int64)
    value_set = pa.array(req_ids, pa.string())
    idx = pc.fill_null(pc.index_in(state["request_id"], value_set=value_set), -1).to_numpy()
    ridx = np.asarray(idx, dtype=np.int64)
    start = np.asarray(state["start_ns"].to_numpy(), dtype=np.int64)
    end = np.asarray(state["end_ns"].to_numpy(), dtype=np.int64)
    keep = ridx >= 0
    keep[keep] = start[keep] < first[ridx[keep]]  # only the TTFT window
    ridx, start, end = ridx[keep], start[keep], end[keep]

    found: list[tuple[int, int, int, str, int]] = []  # (request, at, kind order, kind, size)

    def add(mask: np.ndarray, kind: str, who: np.ndarray, at: np.ndarray, size: np.ndarray
            ) -> None:
        k = KINDS.index(kind)
        for r, a, s in zip(who[mask].tolist(), at[mask].tolist(), size[mask].tolist(),
                           strict=True):
            found.append((r, a, k, kind, s))

    neg = end < start
    add(neg, "negative", ridx, start, start - end)
    ridx, start, end = ridx[~neg], start[~neg], end[~neg]
    seen = np.zeros(len(req_ids), dtype=bool)
    seen[ridx] = True  # has a valid span (a request with only negative spans has none)
    n = len(ridx)
    if n:
        order = np.lexsort((end, start, ridx))
        ridx, start, end = ridx[order], start[order], end[order]
        reach = group_running_max(ridx, end)  # furthest end of spans [.., i] of i's request
        same = ridx[1:] == ridx[:-1]
        prev = reach[:-1]
        s1, e1, r1 = start[1:], end[1:], ridx[1:]
        add(same & (s1 > prev), "gap", r1, prev, s1 - prev)
        over = np.minimum(prev, e1) - s1  # a zero-length span inside another overlaps nothing
        add(same & (over > 0), "overlap", r1, s1, over)
        first_i = np.r_[0, np.flatnonzero(~same) + 1]
        last_i = np.r_[np.flatnonzero(~same), n - 1]
        r0 = ridx[first_i]
        d0 = start[first_i] - arrival[r0]
        add(d0 > 0, "starts_late", r0, arrival[r0], d0)
        add(d0 < 0, "starts_early", r0, start[first_i], -d0)
        r_last = ridx[last_i]
        stop = reach[last_i]
        d1 = stop - first[r_last]
        add(d1 < 0, "ends_early", r_last, stop, -d1)
        add(d1 > 0, "ends_late", r_last, first[r_last], d1)
    everyone = np.arange(len(req_ids))
    ttft = first - arrival
    add(~seen & (ttft > 0), "no_spans", everyone, arrival, ttft)
    add(ttft < 0, "negative_ttft", everyone, first, -ttft)
    found.sort(key=lambda v: v[:3])
    return [PartitionViolation(req_ids[r], kind, a, s) for r, a, _, kind, s in found]
