"""Joining finished requests with their state spans across drains.

A drain hands over whatever the recorder published so far, so a request's state spans and its
requests row may arrive in different drains: most spans come in earlier drains than the row,
and the final span (closed by `request_end` while a drain was running) can come one drain
*after* it. The assembler holds state spans (bounded) and request rows until the spans tile
[arrival, finish], then hands both over together, vectorised over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent.schema import REQUESTS_SCHEMA, SPANS_SCHEMA

#: The columns of a state span the exporters use.
SPAN_COLS: tuple[str, ...] = ("request_num", "name", "start_ns", "end_ns", "waits_on")
_SPAN_SCHEMA = pa.schema([SPANS_SCHEMA.field(c) for c in SPAN_COLS])


@dataclass(slots=True)
class Finished:
    """Finished requests and their state spans, both ordered by `request_num`.

    Attributes:
        requests: rows of the requests table.
        spans: their state spans (`SPAN_COLS`), ordered by (request_num, start_ns).
        lo, hi: request i's spans are rows [lo[i], hi[i]) of `spans`.
        complete: request i's spans tile [arrival, finish] (none was lost or late).
    """

    requests: pa.Table
    spans: pa.Table
    lo: np.ndarray
    hi: np.ndarray
    complete: np.ndarray

    @property
    def num_requests(self) -> int:
        return self.requests.num_rows


def empty_finished() -> Finished:
    z = np.zeros(0, dtype=np.int64)
    return Finished(REQUESTS_SCHEMA.empty_table(), _SPAN_SCHEMA.empty_table(), z, z,
                    np.zeros(0, dtype=bool))


def _ns(col: pa.ChunkedArray | pa.Array, fill: int = -1) -> np.ndarray:
    """An int64 column as numpy, nulls replaced by `fill`."""
    if col.null_count:
        col = pc.fill_null(col, fill)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.int64)


class RequestAssembler:
    """Buffers state spans and request rows until each finished request is whole.

    Args:
        max_pending_spans: state spans held for requests whose row has not arrived; beyond it
            the oldest are dropped and counted in `dropped_spans` (bounded memory when rows
            never come, e.g. requests that never finish).
        max_wait: drains a request row waits for missing spans before it is handed over
            incomplete (a span the recorder dropped never arrives).
    """

    def __init__(self, *, max_pending_spans: int = 262_144, max_wait: int = 3) -> None:
        if max_pending_spans < 1:
            raise ValueError(f"max_pending_spans must be >= 1, got {max_pending_spans}")
        if max_wait < 0:
            raise ValueError(f"max_wait must be >= 0, got {max_wait}")
        self.max_pending_spans = max_pending_spans
        self.max_wait = max_wait
        self._spans = _SPAN_SCHEMA.empty_table()
        self._reqs = REQUESTS_SCHEMA.empty_table()
        self._age = np.zeros(0, dtype=np.int64)
        #: State spans dropped because the buffer was full.
        self.dropped_spans = 0
        #: Requests handed over without all their spans.
        self.incomplete = 0

    @property
    def pending_spans(self) -> int:
        return self._spans.num_rows

    @property
    def pending_requests(self) -> int:
        return self._reqs.num_rows

    def feed(self, batch: dict[str, pa.Table]) -> Finished:
        """Take one drained batch; returns the requests that are now whole (maybe none)."""
        spans = batch.get("spans")
        if spans is not None and spans.num_rows:
            state = spans.filter(pc.equal(spans["kind"], "state")).select(list(SPAN_COLS))
            if state.num_rows:
                self._spans = pa.concat_tables([self._spans, state.cast(_SPAN_SCHEMA)])
        over = self._spans.num_rows - self.max_pending_spans
        if over > 0:
            self._spans = self._spans.slice(over)
            self.dropped_spans += over
        reqs = batch.get("requests")
        if reqs is not None and reqs.num_rows:
            self._reqs = pa.concat_tables([self._reqs, reqs.select(REQUESTS_SCHEMA.names)
                                           .cast(REQUESTS_SCHEMA)])
            self._age = np.concatenate([self._age, np.zeros(reqs.num_rows, dtype=np.int64)])
        return self._emit(final=False)

    def flush(self) -> Finished:
        """Hand over every pending request row, whole or not. Spans of requests whose row has
        not arrived (still running) stay buffered."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> Finished:
        reqs = self._reqs
        if reqs.num_rows == 0:
            return empty_finished()
        spans = self._spans
        rn_req = _ns(reqs["request_num"])
        arrival = _ns(reqs["arrival_ns"])
        finish = _ns(reqs["finish_ns"])
        rn_sp = _ns(spans["request_num"])
        dur = _ns(spans["end_ns"]) - _ns(spans["start_ns"])
        covered = np.zeros(len(rn_req), dtype=np.int64)
        if len(rn_sp):
            uniq, inverse = np.unique(rn_sp, return_inverse=True)
            per = np.zeros(len(uniq), dtype=np.int64)
            np.add.at(per, inverse, dur)
            pos = np.minimum(np.searchsorted(uniq, rn_req), len(uniq) - 1)
            found = uniq[pos] == rn_req
            covered = np.where(found, per[pos], 0)
        # NOTE: the recorder's state spans tile [arrival, finish] by construction, so equal
        # coverage means every span arrived; a null finish can never be checked.
        complete = (finish >= 0) & (covered == finish - arrival)
        emit = complete | (self._age >= self.max_wait) | final | (finish < 0)
        if not emit.any():
            self._age += 1
            return empty_finished()
        out_rn = rn_req[emit]
        take = np.isin(rn_sp, out_rn)
        out_spans = spans.filter(pa.array(take))
        self._spans = spans.filter(pa.array(~take))
        out_reqs = reqs.filter(pa.array(emit))
        out_complete = complete[emit]
        self._reqs = reqs.filter(pa.array(~emit))
        self._age = self._age[~emit] + 1
        self.incomplete += int((~out_complete).sum())
        # Order both sides by request_num so each request's spans are one contiguous slice.
        r_order = np.argsort(out_rn, kind="stable")
        out_reqs = out_reqs.take(pa.array(r_order))
        out_rn = out_rn[r_order]
        out_complete = out_complete[r_order]
        s_rn = _ns(out_spans["request_num"])
        s_order = np.lexsort((_ns(out_spans["start_ns"]), s_rn))
        out_spans = out_spans.take(pa.array(s_order))
        s_rn = s_rn[s_order]
        lo = np.searchsorted(s_rn, out_rn, side="left")
        hi = np.searchsorted(s_rn, out_rn, side="right")
        return Finished(out_reqs, out_spans, lo, hi, out_complete)

    def clear(self) -> None:
        """Forget everything buffered (at shutdown)."""
        self._spans = _SPAN_SCHEMA.empty_table()
        self._reqs = REQUESTS_SCHEMA.empty_table()
        self._age = np.zeros(0, dtype=np.int64)
