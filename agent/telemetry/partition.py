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

from agent.schema import TTFT_STAGES


@dataclass(slots=True, frozen=True)
class PartitionViolation:
    request_id: str
    #: gap | overlap | starts_late | starts_early | ends_early | ends_late | negative | no_spans
    kind: str
    at_ns: int
    size_ns: int

    def __str__(self) -> str:
        return f"request {self.request_id}: {self.kind} of {self.size_ns} ns at {self.at_ns}"


def check_partition(spans: pa.Table, requests: pa.Table) -> list[PartitionViolation]:
    """Violations of the TTFT partition, in request order.

    Args:
        spans: a table with `request_id, kind, name, start_ns, end_ns` (other columns ignored);
            only `kind == "state"` spans named after a TTFT stage are checked.
        requests: a table with `request_id, arrival_ns, first_token_ns`; requests without a
            first token are skipped.
    """
    state = spans.filter(
        pc.and_(pc.equal(spans["kind"], "state"),
                pc.is_in(spans["name"], value_set=pa.array(TTFT_STAGES)))
    )
    req = requests.filter(pc.is_valid(requests["first_token_ns"]))
    req_ids = req["request_id"].to_pylist()
    arrival = req["arrival_ns"].to_numpy()
    first = req["first_token_ns"].to_numpy()
    idx = pc.fill_null(pc.index_in(state["request_id"], value_set=req["request_id"]), -1)
    idx = idx.to_numpy()
    keep = idx >= 0
    ridx = np.asarray(idx[keep], dtype=np.int64)
    start = state["start_ns"].to_numpy()[keep]
    end = state["end_ns"].to_numpy()[keep]
    order = np.lexsort((end, start, ridx))
    ridx, start, end = ridx[order], start[order], end[order]

    out: list[PartitionViolation] = []

    def add(mask: np.ndarray, kind: str, at: np.ndarray, size: np.ndarray, who: np.ndarray) -> None:
        for r, a, s in zip(who[mask], at[mask], size[mask], strict=True):
            out.append(PartitionViolation(req_ids[int(r)], kind, int(a), int(s)))

    add(end < start, "negative", start, start - end, ridx)
    if len(ridx):
        same = ridx[1:] == ridx[:-1]
        delta = start[1:] - end[:-1]
        add(same & (delta > 0), "gap", end[:-1], delta, ridx[1:])
        add(same & (delta < 0), "overlap", start[1:], -delta, ridx[1:])
        first_i = np.r_[0, np.flatnonzero(~same) + 1]
        last_i = np.r_[np.flatnonzero(~same), len(ridx) - 1]
        r_first = ridx[first_i]
        d0 = start[first_i] - arrival[r_first]
        add(d0 > 0, "starts_late", arrival[r_first], d0, r_first)
        add(d0 < 0, "starts_early", start[first_i], -d0, r_first)
        r_last = ridx[last_i]
        d1 = end[last_i] - first[r_last]
        add(d1 < 0, "ends_early", end[last_i], -d1, r_last)
        add(d1 > 0, "ends_late", first[r_last], d1, r_last)
    seen = np.zeros(len(req_ids), dtype=bool)
    seen[ridx] = True
    for r in np.flatnonzero(~seen):
        out.append(PartitionViolation(req_ids[int(r)], "no_spans", int(arrival[r]),
                                      int(first[r] - arrival[r])))
    return out
