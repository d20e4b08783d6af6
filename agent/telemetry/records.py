"""Activity spans, step spans, layer rows, events and samples.

Unlike request states these may come from any thread: the owner thread writes the columnar
segments directly, other threads queue rows validated in C (`array('q')`) for the drain, with
the request id resolved at record time. `Recorder` mixes this class in.
"""

from __future__ import annotations

import operator
import threading
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Any

from agent.telemetry.buffers import SegmentedTable
from agent.telemetry.codes import (
    CLOCK_CODES,
    CLOCK_CPU,
    I32_MAX,
    KIND_ACTIVITY,
    KIND_LEDGER,
    TIER_CODE,
)

_index = operator.index


class OtherRecords:
    """Everything but request states (mixed into `Recorder`, which defines the attributes
    below and the bookkeeping methods)."""

    _owner: int
    _ids: dict[int, str]
    _names: dict[str, int]
    _act: SegmentedTable
    _step: SegmentedTable
    _layers: SegmentedTable
    _events: deque[tuple[Any, ...]]
    _samples: deque[tuple[Any, ...]]
    _max_rows: int
    _clock: Any
    nvtx: Any

    def intern(self, name: str) -> int: ...
    def _error(self) -> None: ...
    def _drop(self, table: str, n: int = 1) -> None: ...
    def _count_unknown(self) -> None: ...

    def _append(self, tbl: SegmentedTable, values: tuple[int, ...]) -> None:
        """(Owner thread) append one row of ints to `tbl`."""
        seg = tbl.active
        i = seg.n
        if i == seg.cap:
            seg = tbl.rotate()
            i = 0
            if seg is None:
                self._drop(tbl.name)
                return
        for col, v in zip(seg.cols, values, strict=True):
            col[i] = v  # a non-int raises before the row is published
        seg.n = i + 1

    def _append_foreign(self, tbl: SegmentedTable, values: tuple[int, ...], rn: int,
                        rid: str | None) -> None:
        """(Any other thread) queue one row; `array('q', ...)` validates it in C now, so a bad
        value fails this call rather than a later drain."""
        row = array("q", values)
        if len(tbl.foreign) >= tbl.max_foreign:
            self._drop(tbl.name)
            return
        tbl.foreign.append((row, rn, rid))

    def _request_id(self, rn: int) -> str | None:
        """The id of `rn` (None for -1; None and counted when unknown)."""
        if rn == -1:
            return None
        rid = self._ids.get(rn)
        if rid is None:
            self._count_unknown()
        return rid

    def activity(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        *,
        request_num: int = -1,
        tier: str | None = None,
        layer: int = -1,
        tokens: int = -1,
        nbytes: int = -1,
        transfer_id: int = -1,
        clock: int = CLOCK_CPU,
    ) -> None:
        """An activity span (a transfer, a store, a lookup against a tier): may overlap anything.

        `-1` means "not applicable" for the integer fields (null in the run store). An unknown
        `request_num` is counted and the span kept without a request id.
        """
        try:
            code = self._names.get(name)
            if code is None:
                code = self.intern(name)
            tcode = -1 if tier is None else TIER_CODE[tier]
            if not -1 <= layer <= I32_MAX:
                raise ValueError(f"layer out of range: {layer}")
            if clock not in CLOCK_CODES:
                raise ValueError(f"clock must be CLOCK_CPU or CLOCK_CUDA, got {clock!r}")
            row = (request_num, code, start_ns, end_ns, tcode, layer, tokens, nbytes,
                   transfer_id, clock, KIND_ACTIVITY, -1)
            self._put_activity(row, request_num)
        except Exception:
            self._error()

    def _put_activity(self, row: tuple[int, ...], request_num: int) -> None:
        if threading.get_ident() == self._owner:
            self._request_id(request_num)
            self._append(self._act, row)
        else:
            # Resolve the id now: the request may be retired before the drain.
            self._append_foreign(self._act, row, request_num, self._request_id(request_num))

    def ledger(self, name: str, request_num: int, *, t: int | None = None,
               tier: str | None = None, tokens: int = -1, nbytes: int = -1, block: int = -1,
               transfer_id: int = -1, layer: int = -1) -> None:
        """One ledger row (kind `ledger`): a physical operation behind a request's accounting
        — a tier's lookup, a load by origin tier, a failure, a computed chunk, a write — with
        its tokens, bytes and first chain position (`block`). Any thread.

        The accounting columns can be recomputed from these rows alone
        (`analyzers.consistency`), so they are recorded where the operation happens, never
        copied from the accounting counters.
        """
        try:
            code = self._names.get(name)
            if code is None:
                code = self.intern(name)
            tcode = -1 if tier is None else TIER_CODE[tier]
            if not -1 <= block <= I32_MAX:
                raise ValueError(f"block out of range: {block}")
            t = self._clock() if t is None else _index(t)
            if not -1 <= layer <= I32_MAX:
                raise ValueError(f"layer out of range: {layer}")
            row = (request_num, code, t, t, tcode, layer, tokens, nbytes, transfer_id,
                   CLOCK_CPU, KIND_LEDGER, block)
            self._put_activity(row, request_num)
        except Exception:
            self._error()

    def step_span(
        self,
        step_id: int,
        phase: str,
        start_ns: int,
        end_ns: int,
        *,
        batch_requests: int = -1,
        tokens: int = -1,
        clock: int = CLOCK_CPU,
    ) -> None:
        """One engine step phase (schedule, prepare, forward, sample) with the batch
        composition: requests in the batch and tokens scheduled."""
        try:
            code = self._names.get(phase)
            if code is None:
                code = self.intern(phase)
            if not -1 <= batch_requests <= I32_MAX:
                raise ValueError(f"batch_requests out of range: {batch_requests}")
            if clock not in CLOCK_CODES:
                raise ValueError(f"clock must be CLOCK_CPU or CLOCK_CUDA, got {clock!r}")
            row = (step_id, code, start_ns, end_ns, batch_requests, tokens, clock)
            if threading.get_ident() == self._owner:
                self._append(self._step, row)
            else:
                self._append_foreign(self._step, row, -1, None)
        except Exception:
            self._error()

    def push_phase(self, phase: str, step_id: int) -> None:
        """NVTX push for a nested step phase (pair with `pop_phase`). Like the stage ranges,
        skipped when no NVTX tool is attached (the domain is nvtx's no-op dummy)."""
        if self.nvtx is not None and self.nvtx.real:
            try:
                self.nvtx.push(phase, step_id)
            except Exception:
                self._error()

    def pop_phase(self) -> None:
        """NVTX pop of the innermost step phase."""
        if self.nvtx is not None and self.nvtx.real:
            try:
                self.nvtx.pop()
            except Exception:
                self._error()

    def layer(self, rn: int, layer: int, hit_tokens: int, loaded_tokens: int,
              recomputed_tokens: int, prompt_tokens: int, load_ns: int = 0,
              wait_ns: int = 0, skipped_tokens: int = 0) -> None:
        """One row of the per-layer table for request `rn` (skipped and counted when `rn` is
        unknown: the table's request_id is never null)."""
        try:
            if not 0 <= layer <= I32_MAX:
                raise ValueError(f"layer out of range: {layer}")
            rid = self._request_id(rn)
            if rid is None:
                return
            row = (rn, layer, hit_tokens, loaded_tokens, recomputed_tokens, prompt_tokens,
                   load_ns, wait_ns, skipped_tokens)
            if threading.get_ident() == self._owner:
                self._append(self._layers, row)
            else:
                self._append_foreign(self._layers, row, rn, rid)
        except Exception:
            self._error()

    def layers(self, rn: int, rows: Sequence[tuple[int, int, int, int, int, int, int]]) -> None:
        """Every per-layer row of request `rn` in one call: `rows[i]` is layer i's
        (hit_tokens, loaded_tokens, recomputed_tokens, prompt_tokens, load_ns, wait_ns,
        skipped_tokens). Same rows as `layer` once per layer, for one call's overhead."""
        try:
            rid = self._request_id(rn)
            if rid is None:
                return
            if len(rows) > I32_MAX:
                raise ValueError(f"too many layers: {len(rows)}")
            if any(len(r) != 7 for r in rows):
                raise ValueError("each layer row has 7 values")
            # Column by column, in C: building the arrays validates every value first (a bad
            # one records none of the rows).
            n = len(rows)
            cols = [array("q", [rn]) * n, array("q", range(n)),
                    *(array("q", c) for c in zip(*rows, strict=True))] if n else []
            tbl = self._layers
            if threading.get_ident() != self._owner:
                for layer, r in enumerate(rows):
                    self._append_foreign(tbl, (rn, layer, *r), rn, rid)
                return
            done = 0
            while done < n:
                seg = tbl.active
                i = seg.n
                if i == seg.cap:
                    seg = tbl.rotate()
                    i = 0
                    if seg is None:
                        self._drop(tbl.name)
                        return
                k = min(n - done, seg.cap - i)
                for dst, src in zip(seg.cols, cols, strict=True):
                    dst[i:i + k] = src[done:done + k]
                seg.n = i + k
                done += k
        except Exception:
            self._error()

    def event(self, name: str, *, t: int | None = None, source: str = "engine",
              request_num: int = -1, detail: dict[str, Any] | None = None) -> None:
        """A discrete event (eviction, preemption, fault, circuit_open, ...). Any thread.

        `detail` is stored as JSON text (values that JSON cannot hold are written with str()).
        """
        try:
            if not isinstance(name, str) or not isinstance(source, str):
                raise TypeError("event name and source must be str")
            if not (detail is None or isinstance(detail, dict)):
                raise TypeError("event detail must be a dict or None")
            t = self._clock() if t is None else _index(t)
            rid = self._request_id(request_num)
            if len(self._events) >= self._max_rows:
                self._drop("events")
                return
            self._events.append((t, source, name, rid, detail))
        except Exception:
            self._error()

    def sample(self, source: str, metric: str, value: float, *, entity: str | None = None,
               unit: str | None = None, t: int | None = None) -> None:
        """A time-series sample (pool gauges, collector readings). Any thread."""
        try:
            if not isinstance(source, str) or not isinstance(metric, str):
                raise TypeError("sample source and metric must be str")
            if not ((entity is None or isinstance(entity, str))
                    and (unit is None or isinstance(unit, str))):
                raise TypeError("sample entity and unit must be str or None")
            value = float(value)
            t = self._clock() if t is None else _index(t)
            if len(self._samples) >= self._max_rows:
                self._drop("samples")
                return
            self._samples.append((t, source, entity, metric, value, unit))
        except Exception:
            self._error()
