"""Activity spans, step spans, layer rows, events and samples.

Unlike request states these may come from any thread: the owner thread writes the columnar
segments directly, other threads queue rows validated in C (`array('q')`) for the drain, with
the request id resolved at record time. `Recorder` mixes this class in.
"""

from __future__ import annotations

import operator
import struct
import threading
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Any

from agent.schema import BLOCK_STATES
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
_get_ident = threading.get_ident
#: A queued engine step row (`Recorder.step_rows`): the `tables.ENGINE_STEP_COLS` values
#: packed as native int64s (the pack checks every value in C when the step is recorded).
STEP_ROW = struct.Struct("16q")


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
    _pub: Any
    step_rows: deque[bytes]
    max_step_rows: int
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
        if seg.pack is not None:  # row-major: one packed store checks and writes the row
            seg.pack(seg.buf, i * seg.row_bytes, *values)
            seg.n = i + 1
            return
        # Rows are built here with one value per column: zip without strict=True (a third of
        # this loop's time).
        for col, v in zip(seg.cols, values):  # noqa: B905
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
        if _get_ident() == self._owner:
            if request_num != -1 and request_num not in self._ids:
                self._count_unknown()
            # `_append` inlined (activity and ledger rows are the most frequent after states):
            # the table is row-major, one packed store checks every value and writes the row.
            tbl = self._act
            seg = tbl.active
            i = seg.n
            if i == seg.cap:
                self._append(tbl, row)
                return
            seg.pack(seg.buf, i * seg.row_bytes, *row)
            seg.n = i + 1
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
            t = self._clock() if t is None else _index(t)
            self._put_activity(self._ledger_row(name, request_num, t, tier, tokens, nbytes,
                                                block, transfer_id, layer), request_num)
        except Exception:
            self._error()

    def _ledger_row(self, name: str, rn: int, t: int, tier: str | None, tokens: int,
                    nbytes: int, block: int, transfer_id: int, layer: int) -> tuple[int, ...]:
        """The activity-buffer row (`_ACT_COLS`) of one ledger row at `t`; raises on a bad
        value."""
        code = self._names.get(name)
        if code is None:
            code = self.intern(name)
        tcode = -1 if tier is None else TIER_CODE[tier]
        if not -1 <= block <= I32_MAX:
            raise ValueError(f"block out of range: {block}")
        if not -1 <= layer <= I32_MAX:
            raise ValueError(f"layer out of range: {layer}")
        return (rn, code, t, t, tcode, layer, tokens, nbytes, transfer_id, CLOCK_CPU,
                KIND_LEDGER, block)

    def ledgers(self, rows: Sequence[tuple[str, int, int | None, str | None, int, int, int, int,
                                            int]]) -> None:
        """Several ledger rows in one call (a transfer's or a step's): `rows[i]` is `ledger`'s
        arguments in order, (name, request_num, t, tier, tokens, nbytes, block, transfer_id,
        layer), `t` None for now (read once for the call). The same rows as `ledger` once per
        row, in order; a bad row records none of them (every row is checked before the first
        is published)."""
        try:
            t_now = -1
            seg = self._act.active
            i = seg.n
            # On the engine loop with room: packed straight into the active segment past its
            # published rows, then published together (`_put_rows` without its row list).
            fast = _get_ident() == self._owner and i + len(rows) <= seg.cap
            pack, buf, size = seg.pack, seg.buf, seg.row_bytes
            at = i * size
            packed = []
            ledger_row = self._ledger_row
            for name, rn, t, tier, tokens, nbytes, block, transfer_id, layer in rows:
                if t is None:
                    if t_now < 0:
                        t_now = self._clock()
                    t = t_now
                else:
                    t = _index(t)
                row = ledger_row(name, rn, t, tier, tokens, nbytes, block, transfer_id, layer)
                if fast:
                    pack(buf, at, *row)  # a bad value raises before any row is published
                    at += size
                else:
                    packed.append(row)
            if fast:
                seg.n = i + len(rows)
                ids = self._ids
                for row in rows:
                    if row[1] != -1 and row[1] not in ids:
                        self._count_unknown()
                return
            self._put_rows(packed)
        except Exception:
            self._error()

    def _put_rows(self, rows: list[tuple[int, ...]]) -> None:
        """Activity-buffer rows (`_ACT_COLS`), published together: as `_put_activity` once per
        row, but a bad value raises before any of them is published."""
        if _get_ident() != self._owner:
            array("q", [v for row in rows for v in row])  # checked before the first is queued
            for row in rows:
                self._put_activity(row, row[0])
            return
        tbl = self._act
        seg = tbl.active
        i = seg.n
        k = len(rows)
        if i + k > seg.cap:
            array("q", [v for row in rows for v in row])  # checked before the first store
            for row in rows:
                self._append(tbl, row)
        else:
            pack, buf, size = seg.pack, seg.buf, seg.row_bytes
            for j, row in enumerate(rows):
                pack(buf, (i + j) * size, *row)  # a bad value raises before any is published
            seg.n = i + k
        ids = self._ids
        for row in rows:
            if row[0] != -1 and row[0] not in ids:
                self._count_unknown()

    def lookups(self, rn: int, probes: Sequence[tuple[str, int, int, int, int]],
                block_size: int) -> None:
        """A request's arrival lookup, one call for every tier it asked: `probes[i]` is
        (tier, start_ns, end_ns, first block, blocks promised). Per probe the rows of
        `activity("lookup", start, end, request_num=rn, tier=tier, tokens=blocks * block_size)`
        then `ledger("lookup", rn, t=end, tier=tier, tokens=blocks * block_size, block=first)`,
        in that order."""
        try:
            code = self._names.get("lookup")
            if code is None:
                code = self.intern("lookup")
            rows = []
            for tier, t0, t1, first, blocks in probes:
                tcode = TIER_CODE[tier]
                if not -1 <= first <= I32_MAX:
                    raise ValueError(f"block out of range: {first}")
                tokens = blocks * block_size
                rows.append((rn, code, t0, t1, tcode, -1, tokens, -1, -1, CLOCK_CPU,
                             KIND_ACTIVITY, -1))
                rows.append((rn, code, t1, t1, tcode, -1, tokens, -1, -1, CLOCK_CPU,
                             KIND_LEDGER, first))
            if _get_ident() != self._owner:
                for row in rows:
                    self._put_activity(row, rn)
                return
            if rn != -1 and rn not in self._ids:
                for _ in rows:
                    self._count_unknown()
            tbl = self._act
            seg = tbl.active
            i = seg.n
            k = len(rows)
            if i + k > seg.cap:
                for row in rows:
                    self._append(tbl, row)
                return
            pack, buf, size = seg.pack, seg.buf, seg.row_bytes
            for j, row in enumerate(rows):
                pack(buf, (i + j) * size, *row)  # a bad value raises before any is published
            seg.n = i + k
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
            if _get_ident() == self._owner:
                self._append(self._step, row)
            else:
                self._append_foreign(self._step, row, -1, None)
        except Exception:
            self._error()

    def step_spans(self, step_id: int, spans: Sequence[tuple[str, int, int, int]], *,
                   batch_requests: int = -1, tokens: int = -1) -> None:
        """Several phases of one step in one call: `spans[i]` is (phase, start_ns, end_ns,
        clock). The same rows as `step_span` once per phase; a bad value records none of
        them (every row is checked before the first is stored)."""
        try:
            if not -1 <= batch_requests <= I32_MAX:
                raise ValueError(f"batch_requests out of range: {batch_requests}")
            names = self._names
            rows = []
            ints = [step_id, tokens]
            for phase, start, end, clock in spans:
                code = names.get(phase)
                if code is None:
                    code = self.intern(phase)
                if clock not in CLOCK_CODES:
                    raise ValueError(f"clock must be CLOCK_CPU or CLOCK_CUDA, got {clock!r}")
                ints += (start, end)
                rows.append((step_id, code, start, end, batch_requests, tokens, clock))
            array("q", ints)  # every value an int64, checked in C before the first store
            tbl = self._step
            if _get_ident() != self._owner:
                for row in rows:
                    self._append_foreign(tbl, row, -1, None)
                return
            seg = tbl.active
            for row in rows:
                i = seg.n
                if i == seg.cap:
                    self._append(tbl, row)  # rotates (or drops and counts)
                    seg = tbl.active
                    continue
                for col, v in zip(seg.cols, row):  # noqa: B905 - one value per column
                    col[i] = v
                seg.n = i + 1
        except Exception:
            self._error()

    def engine_step(self, step_id: int, t0: int, t1: int, t2: int, t3: int, t4: int,
                    forward: tuple[int, int] | None, batch_requests: int, tokens: int,
                    device: tuple[int, int, int], host: tuple[int, int, int] | None = None,
                    extra: Sequence[tuple[str, float, str | None, str | None]] = (), *,
                    status: tuple[Any, tuple[Any, ...]] | None = None,
                    evicted: int = 0) -> None:
        """Everything one engine step records, in one call, stored as one row of
        `step_rows` that the drain expands (`tables.spans_table`, `tables.engine_samples_table`):

        - step spans `schedule` [t0, t1], `prepare` [t1, t2], `sample` [t3, t4] and, when
          `forward` (start_ns, end_ns) is given (a CPU clock: resolved already), `forward`,
          in that order: the rows of `step_spans` with these phases;
        - the device pool's (in_use, cached_free, empty) and the host tier's, when given, as
          `pool` samples in blocks at t4, then the `extra` pool samples (metric, value,
          entity, unit) at t4: the rows of `samples("pool", ...)`;
        - `status`: (builder, args), the engine's status as `builder(*args)` builds it when it
          is read (`Recorder.status`); None leaves the published one;
        - `evicted`: the device's evictions since the last step, when any, as the event of
          `event("eviction", t=t4, detail={"tier": "device", "blocks": evicted})` (recorded
          whatever happens to the rest, as that call would be).

        A bad value records none of the step's rows (the packed store checks every value
        first).
        """
        try:
            if not -1 <= batch_requests <= I32_MAX:
                raise ValueError(f"batch_requests out of range: {batch_requests}")
            f0, f1 = (-1, -1) if forward is None else forward
            d0, d1, d2 = device
            if host is None:
                h0 = h1 = h2 = -1
                if d0 < 0 or d1 < 0 or d2 < 0:
                    raise ValueError("pool counts must be >= 0")
            else:
                h0, h1, h2 = host
                if min(d0, d1, d2, h0, h1, h2) < 0:
                    raise ValueError("pool counts must be >= 0")
            if _get_ident() != self._owner:
                self._engine_step_foreign(step_id, t0, t1, t2, t3, t4, forward,
                                          batch_requests, tokens, device, host)
            else:
                # Every value an int64, checked in C before the store.
                row = STEP_ROW.pack(step_id, t0, t1, t2, t3, t4, f0, f1, batch_requests, tokens,
                                    d0, d1, d2, h0, h1, h2)
                q = self.step_rows
                if len(q) >= self.max_step_rows:
                    self._drop("spans", 3 if forward is None else 4)
                    self._drop("samples", 3 if host is None else 6)
                else:
                    q.append(row)
            if extra:
                self.samples("pool", extra, t=t4)
            if status is not None:
                self._pub = status
        except Exception:
            self._error()
        if evicted:  # whatever happened to the step's rows
            self.event("eviction", t=t4, detail={"tier": "device", "blocks": evicted})

    def _engine_step_foreign(self, step_id: int, t0: int, t1: int, t2: int, t3: int, t4: int,
                             forward: tuple[int, int] | None, batch_requests: int, tokens: int,
                             device: tuple[int, int, int], host: tuple[int, int, int] | None
                             ) -> None:
        """`engine_step` off the owner thread: the same rows through the general calls."""
        spans = [("schedule", t0, t1, CLOCK_CPU), ("prepare", t1, t2, CLOCK_CPU),
                 ("sample", t3, t4, CLOCK_CPU)]
        if forward is not None:
            spans.append(("forward", forward[0], forward[1], CLOCK_CPU))
        self.step_spans(step_id, spans, batch_requests=batch_requests, tokens=tokens)
        rows = [(m, v, tier, "blocks") for tier, counts in (("device", device), ("host", host))
                if counts is not None for m, v in zip(BLOCK_STATES, counts, strict=True)]
        self.samples("pool", rows, t=t4)

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
            rid = None if rn == -1 else self._ids.get(rn)  # `_request_id`, inlined
            if rid is None:
                if rn != -1:
                    self._count_unknown()
                return
            if len(rows) > I32_MAX:
                raise ValueError(f"too many layers: {len(rows)}")
            tbl = self._layers
            n = len(rows)
            seg = tbl.active
            i = seg.n
            if i + n <= seg.cap and _get_ident() == self._owner:
                # Row-major: one packed store per row checks its values (and their number:
                # rn, the layer and 7); the rows are published together, so a bad one
                # records none of them.
                pack, buf, size = seg.pack, seg.buf, seg.row_bytes
                at = i * size
                for layer, r in enumerate(rows):
                    pack(buf, at, rn, layer, *r)
                    at += size
                seg.n = i + n
                return
            if any(len(r) != 7 for r in rows):
                raise ValueError("each layer row has 7 values")
            full = [(rn, layer, *r) for layer, r in enumerate(rows)]
            if _get_ident() != self._owner:
                for row in full:
                    self._append_foreign(tbl, row, rn, rid)
                return
            array("q", [v for row in full for v in row])  # checked before the first store
            for row in full:
                seg = tbl.active
                i = seg.n
                if i == seg.cap:
                    seg = tbl.rotate()
                    i = 0
                    if seg is None:
                        self._drop(tbl.name)
                        return
                seg.pack(seg.buf, i * seg.row_bytes, *row)
                seg.n = i + 1
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
            rid = None if request_num == -1 else self._request_id(request_num)
            if len(self._events) >= self._max_rows:
                self._drop("events")
                return
            self._events.append((t, source, name, rid, detail))
        except Exception:
            self._error()

    def samples(self, source: str, rows: Sequence[tuple[str, float, str | None, str | None]],
                *, t: int | None = None) -> None:
        """Several samples of one source at one time in one call: `rows[i]` is (metric, value,
        entity, unit). The same rows as `sample` once per row; a bad row records none."""
        try:
            if not isinstance(source, str):
                raise TypeError("sample source and metric must be str")
            t = self._clock() if t is None else _index(t)
            out = []
            for metric, value, entity, unit in rows:
                if not (isinstance(metric, str) and (entity is None or isinstance(entity, str))
                        and (unit is None or isinstance(unit, str))):
                    raise TypeError("sample metric must be str, entity and unit str or None")
                out.append((t, source, entity, metric, float(value), unit))
            room = self._max_rows - len(self._samples)
            if room < len(out):
                self._drop("samples", len(out) - max(room, 0))
                out = out[:max(room, 0)]
            self._samples.extend(out)
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
