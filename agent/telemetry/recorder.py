"""The hot-path recorder: the one object the engine writes its telemetry into.

Rules (DESIGN.md section 4): recording a stage boundary costs about a microsecond of Python;
appends go into preallocated int64 columns (names interned to small codes), so a drain hands
Arrow whole columns; no I/O, no string formatting, no OTel objects; recording never raises into
the caller. Exporters call `drain()` from their own thread.

The per-request *state* API is the partition helper: a request enters its first state at
arrival and every later call moves it from one state to the next at a single instant, so the
state spans of a request tile [arrival, finish] with no gap and no overlap by construction.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

import pyarrow as pa

from agent.clock import ClockAnchor, now_ns, process_anchor
from agent.schema import (
    ACCOUNTING_COLUMNS,
    DECODE_STAGE,
    STATE_CODE,
    STATES,
    STEP_PHASES,
    TIERS,
)
from agent.telemetry import tables
from agent.telemetry.annotate import NvtxAnnotator
from agent.telemetry.buffers import Chunk, Segment

log = logging.getLogger(__name__)

# Small integer codes used on the hot path.
CLOCK_CPU = 0
CLOCK_CUDA = 1
TIER_CODE: dict[str, int] = {t: i for i, t in enumerate(TIERS)}
_DECODE = STATE_CODE[DECODE_STAGE]
_NO_RANGE = 0

_STATE_COLS = ("request_num", "state", "start_ns", "end_ns")
_ACT_COLS = ("request_num", "name", "start_ns", "end_ns", "tier", "layer", "tokens", "bytes",
             "transfer_id", "clock")
_STEP_COLS = ("step_id", "name", "start_ns", "end_ns", "batch_requests", "tokens", "clock")
_LAYER_COLS = tables.LAYER_COLS


@dataclass(slots=True)
class RequestAccounting:
    """Token, byte and count accounting of one request (DESIGN.md section 2).

    NOTE: prompt_tokens == device_hit_tokens + host_loaded_tokens + remote_loaded_tokens +
    recomputed_tokens must hold when the request has produced its first token.
    """

    prompt_tokens: int = 0
    output_tokens: int = 0
    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    host_loaded_tokens: int = 0
    remote_loaded_tokens: int = 0
    recomputed_tokens: int = 0
    preempted_tokens: int = 0
    load_failed_tokens: int = 0
    load_failed_timeout_tokens: int = 0
    load_failed_checksum_tokens: int = 0
    load_failed_error_tokens: int = 0
    load_failed_circuit_open_tokens: int = 0
    load_failed_evicted_tokens: int = 0
    host_read_bytes: int = 0
    remote_read_bytes: int = 0
    h2d_bytes: int = 0
    host_written_bytes: int = 0
    remote_written_bytes: int = 0
    num_preemptions: int = 0

    def identity_holds(self) -> bool:
        return self.prompt_tokens == (self.device_hit_tokens + self.host_loaded_tokens
                                      + self.remote_loaded_tokens + self.recomputed_tokens)

    def values(self) -> tuple[int, ...]:
        return tuple(getattr(self, c) for c in ACCOUNTING_COLUMNS)


assert tuple(f.name for f in fields(RequestAccounting)) == ACCOUNTING_COLUMNS


class _Open:
    """The open state of one in-flight request."""

    __slots__ = ("arrival", "extra", "first_token", "nvtx", "request_id", "start", "state",
                 "tenant", "waits", "wclass")

    def __init__(self, request_id: str, arrival: int, state: int, tenant: str | None,
                 wclass: str | None) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.state = state
        self.start = arrival
        self.first_token = -1
        self.nvtx = _NO_RANGE
        self.extra: list[int] | None = None
        self.waits: list[int] | None = None
        self.tenant = tenant
        self.wclass = wclass


@dataclass(slots=True)
class RecorderStats:
    """Self-telemetry: what the recorder could not record, and why."""

    dropped: dict[str, int] = field(default_factory=dict)
    recording_errors: int = 0
    clock_regressions: int = 0
    unknown_requests: int = 0
    rows: dict[str, int] = field(default_factory=dict)


class _Table:
    """A segmented columnar buffer written by one thread and drained by another.

    The writer fills `active` and, when it is full, appends it to `full` and starts a new one
    (both GIL-atomic). The drain pops `full` and reads the published rows of `active`. At most
    `max_segments` full segments wait for a drain; beyond that rows are dropped and counted.
    """

    __slots__ = ("active", "cap", "cols", "full", "max_segments", "name")

    def __init__(self, name: str, cols: tuple[str, ...], cap: int, max_segments: int) -> None:
        self.name = name
        self.cols = cols
        self.cap = cap
        self.max_segments = max_segments
        self.active = Segment(cols, cap)
        self.full: deque[Segment] = deque()

    def rotate(self) -> Segment | None:
        """(Writer) hand the full active segment over; None when the bound is reached."""
        if len(self.full) >= self.max_segments:
            return None
        self.full.append(self.active)
        self.active = Segment(self.cols, self.cap)
        return self.active

    def take(self) -> list[Chunk]:
        """(Drain) every published row not drained before, as chunks in write order."""
        out: list[Chunk] = []
        while True:
            try:
                seg = self.full.popleft()
            except IndexError:
                break
            hi = seg.n
            if hi > seg.drained:
                out.append((seg, seg.drained, hi))
                seg.drained = hi
        # NOTE: if the writer rotates `active` after the loop above, the old segment waits in
        # `full` and its remaining rows come with the next drain.
        seg = self.active
        hi = seg.n
        if hi > seg.drained:
            out.append((seg, seg.drained, hi))
            seg.drained = hi
        return out


class Recorder:
    """Columnar telemetry buffers plus the per-request state machine.

    Threading: request states, step spans and layer rows are recorded by one thread (the engine
    loop, the thread that created the recorder or called `bind_thread`), without locks.
    `activity`, `event` and `sample` may be called from any thread (tier I/O threads); calls
    from other threads take a slower, locked path. `drain` may run on any thread.

    Args:
        segment_rows: rows per preallocated segment.
        max_segments: full segments a table may hold before a drain; beyond it rows are dropped
            and counted (bounded memory when no exporter drains).
        nvtx: emit NVTX ranges (domain ``kvscope``).
        force_real_nvtx: use the real NVTX domain even with no tool attached (tests).
        clock: the monotonic clock in ns (injectable for tests).
        anchor: the process clock anchor used to convert to epoch ns on drain.
    """

    def __init__(
        self,
        *,
        segment_rows: int = 16384,
        max_segments: int = 64,
        nvtx: bool = True,
        force_real_nvtx: bool = False,
        clock: Any = now_ns,
        anchor: ClockAnchor | None = None,
    ) -> None:
        if segment_rows < 1 or max_segments < 1:
            raise ValueError("segment_rows and max_segments must be >= 1")
        self._clock = clock
        self.anchor = anchor or process_anchor()
        self._owner = threading.get_ident()
        self._lock = threading.Lock()  # only for calls from non-owner threads
        self._state = _Table("spans", _STATE_COLS, segment_rows, max_segments)
        self._act = _Table("spans", _ACT_COLS, segment_rows, max_segments)
        self._step = _Table("spans", _STEP_COLS, segment_rows, max_segments)
        self._layers = _Table("layers", _LAYER_COLS, segment_rows, max_segments)
        self._max_rows = segment_rows * max_segments
        self._foreign_act: deque[tuple[int, ...]] = deque()
        self._requests: deque[tuple[Any, ...]] = deque()
        self._samples: deque[tuple[Any, ...]] = deque()
        self._events: deque[tuple[Any, ...]] = deque()
        self._open: dict[int, _Open] = {}
        self._ids: dict[int, str] = {}
        self._retired: deque[int] = deque()
        self._retire_next: list[int] = []
        self._next_num = 0
        self._next_transfer = 0
        self._names: dict[str, int] = {}
        self._name_list: list[str] = []
        for n in (*STATES, *STEP_PHASES):
            self.intern(n)
        self.stats = RecorderStats()
        #: Live Prometheus-style instruments, read by the exporters' collectors.
        self.gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        self.counters: dict[tuple[str, tuple[str, ...]], float] = {}
        #: Extra range annotators (the torch profiler under --profile): slow path only.
        self.annotators: list[Any] = []
        self.nvtx: NvtxAnnotator | None = None
        self._nv_start: Any = None
        self._nv_end: Any = None
        self._nv_attrs: list[Any] = []
        if nvtx:
            ann = NvtxAnnotator((*STATES, *STEP_PHASES), force_real=force_real_nvtx)
            if ann.available:
                self.nvtx = ann
                # Bound domain methods, called directly on the hot path: the real domain's
                # start_range(attrs, payload=...) and the no-tool dummy's accept the same call.
                self._nv_attrs = [ann.attributes(s) for s in STATES]
                self._nv_start = ann.domain.start_range
                self._nv_end = ann.domain.end_range
        self.closed = False

    def bind_thread(self) -> None:
        """Make the calling thread the recorder's owner (the engine loop's thread)."""
        self._owner = threading.get_ident()

    def add_annotator(self, annotator: Any) -> None:
        """Also emit request-stage ranges to `annotator` (start(name, payload)/end(id))."""
        self.annotators.append(annotator)

    # ------------------------------------------------------------------ names and ids
    def intern(self, name: str) -> int:
        """The small integer code of a span name (stable for this recorder)."""
        code = self._names.get(name)
        if code is None:
            code = self._names[name] = len(self._name_list)
            self._name_list.append(name)
        return code

    def new_transfer_id(self) -> int:
        """A fresh transfer id (links activity spans to the states that waited on them)."""
        self._next_transfer += 1
        return self._next_transfer

    def now(self) -> int:
        return self._clock()

    # ------------------------------------------------------------------ request states
    def request_begin(
        self,
        request_id: str,
        arrival_ns: int | None = None,
        *,
        state: str = "lookup",
        tenant: str | None = None,
        workload_class: str | None = None,
    ) -> int:
        """Open a request in `state` at its arrival; returns its `request_num` (NVTX payload).

        Returns -1 (and records nothing for it) if recording failed.
        """
        try:
            t = self._clock() if arrival_ns is None else arrival_ns
            rn = self._next_num
            self._next_num = rn + 1
            self._ids[rn] = request_id
            op = _Open(request_id, t, STATE_CODE[state], tenant, workload_class)
            self._open[rn] = op
            if self._nv_start is not None:
                op.nvtx = self._nv_start(self._nv_attrs[op.state], payload=rn)
            if self.annotators:
                op.extra = [ann.start(state, rn) for ann in self.annotators]
            return rn
        except Exception:
            self._error()
            return -1

    def stage(self, rn: int, state: int, t: int | None = None) -> None:
        """Move request `rn` into `state` (a `STATE_CODE`) at `t` (now if None).

        The current state's span ends exactly where the new one starts. A `t` earlier than the
        current state's start is clamped to it and counted as a clock regression.
        """
        try:
            if t is None:
                t = self._clock()
            op = self._open.get(rn)
            if op is None:
                self.stats.unknown_requests += 1
                return
            start = op.start
            if t < start:
                t = start
                self.stats.clock_regressions += 1
            tbl = self._state
            seg = tbl.active
            i = seg.n
            if i == seg.cap:
                seg = tbl.rotate()
                i = 0
            if seg is not None:
                c = seg.cols
                c[0][i] = rn
                c[1][i] = op.state
                c[2][i] = start
                c[3][i] = t
                if op.waits is not None:
                    if seg.waits is None:
                        seg.waits = {}
                    seg.waits[i] = tuple(op.waits)
                    op.waits = None
                seg.n = i + 1  # publish the row
            else:
                self._drop("spans")
            if self._nv_end is not None:
                self._nv_end(op.nvtx)
                op.nvtx = self._nv_start(self._nv_attrs[state], payload=rn)
            if self.annotators:
                self._annotate(op, STATES[state], rn)
            op.state = state
            op.start = t
        except Exception:
            self._error()

    def _annotate(self, op: _Open, name: str, rn: int) -> None:
        for ann, rid in zip(self.annotators, op.extra or (), strict=False):
            ann.end(rid)
        op.extra = [ann.start(name, rn) for ann in self.annotators]

    def wait_for(self, rn: int, transfer_id: int) -> None:
        """Note that request `rn`'s current state waits on `transfer_id` (its `waits_on`)."""
        op = self._open.get(rn)
        if op is None:
            return
        if op.waits is None:
            op.waits = [transfer_id]
        elif transfer_id not in op.waits:
            op.waits.append(transfer_id)

    def first_token(self, rn: int, t: int | None = None) -> None:
        """The first token was sampled: TTFT ends here and the request enters `decode`."""
        if t is None:
            t = self._clock()
        op = self._open.get(rn)
        if op is not None:
            self.stage(rn, _DECODE, t)
            op.first_token = op.start  # after stage(): the clamped time

    def current_state(self, rn: int) -> str | None:
        op = self._open.get(rn)
        return None if op is None else STATES[op.state]

    def request_end(
        self,
        rn: int,
        accounting: RequestAccounting,
        *,
        status: str = "ok",
        t: int | None = None,
    ) -> None:
        """Close the request's last state at `t` and record its accounting row."""
        try:
            if t is None:
                t = self._clock()
            op = self._open.get(rn)
            if op is None:
                self.stats.unknown_requests += 1
                return
            self.stage(rn, op.state, t)  # closes the open span at t
            if self._nv_end is not None:
                self._nv_end(op.nvtx)
            for ann, rid in zip(self.annotators, op.extra or (), strict=False):
                ann.end(rid)
            del self._open[rn]
            self._requests.append(
                (op.request_id, rn, op.tenant, op.wclass, op.arrival,
                 op.first_token if op.first_token >= 0 else None, op.start, status,
                 *accounting.values())
            )
            self._retired.append(rn)
        except Exception:
            self._error()

    # ------------------------------------------------------------------ other records
    def _append(self, tbl: _Table, values: tuple[int, ...]) -> None:
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
            col[i] = v
        seg.n = i + 1

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

        `-1` means "not applicable" for the integer fields (null in the run store).
        """
        try:
            code = self._names.get(name)
            if code is None:
                with self._lock:
                    code = self.intern(name)
            row = (request_num, code, start_ns, end_ns, -1 if tier is None else TIER_CODE[tier],
                   layer, tokens, nbytes, transfer_id, clock)
            if threading.get_ident() == self._owner:
                self._append(self._act, row)
            elif len(self._foreign_act) < self._max_rows:
                self._foreign_act.append(row)
            else:
                self._drop("spans")
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
        """(Owner thread) one engine step phase (schedule, prepare, forward, sample) with the
        batch composition: requests in the batch and tokens scheduled."""
        try:
            code = self._names.get(phase)
            if code is None:
                code = self.intern(phase)
            self._append(self._step, (step_id, code, start_ns, end_ns, batch_requests, tokens,
                                      clock))
        except Exception:
            self._error()

    def push_phase(self, phase: str, step_id: int) -> None:
        """NVTX push for a nested step phase (pair with `pop_phase`)."""
        if self.nvtx is not None:
            try:
                self.nvtx.push(phase, step_id)
            except Exception:
                self._error()

    def pop_phase(self) -> None:
        if self.nvtx is not None:
            try:
                self.nvtx.pop()
            except Exception:
                self._error()

    def layer(self, rn: int, layer: int, hit_tokens: int, loaded_tokens: int,
              recomputed_tokens: int, prompt_tokens: int, load_ns: int = 0,
              wait_ns: int = 0) -> None:
        """(Owner thread) one row of the per-layer table for request `rn`."""
        try:
            self._append(self._layers, (rn, layer, hit_tokens, loaded_tokens, recomputed_tokens,
                                        prompt_tokens, load_ns, wait_ns))
        except Exception:
            self._error()

    def event(self, name: str, *, t: int | None = None, source: str = "engine",
              request_num: int = -1, detail: dict[str, Any] | None = None) -> None:
        """A discrete event (eviction, preemption, fault, circuit_open, ...). Any thread."""
        try:
            if t is None:
                t = self._clock()
            if len(self._events) >= self._max_rows:
                self._drop("events")
                return
            self._events.append((t, source, name, request_num, detail))
        except Exception:
            self._error()

    def sample(self, source: str, metric: str, value: float, *, entity: str | None = None,
               unit: str | None = None, t: int | None = None) -> None:
        """A time-series sample (pool gauges, collector readings). Any thread."""
        try:
            if t is None:
                t = self._clock()
            if len(self._samples) >= self._max_rows:
                self._drop("samples")
                return
            self._samples.append((t, source, entity, metric, float(value), unit))
        except Exception:
            self._error()

    def set_gauge(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """A live gauge for the Prometheus exporter (a catalogued name, label values in order)."""
        self.gauges[(name, labels)] = value

    def count(self, name: str, n: float = 1, labels: tuple[str, ...] = ()) -> None:
        """(Owner thread) increase a live counter for the Prometheus exporter."""
        key = (name, labels)
        self.counters[key] = self.counters.get(key, 0) + n

    # ------------------------------------------------------------------ bookkeeping
    def _error(self) -> None:
        self.stats.recording_errors += 1
        if self.stats.recording_errors == 1:
            log.warning("kvscope telemetry: a recording call failed; counting further failures",
                        exc_info=True)

    def _drop(self, table: str) -> None:
        d = self.stats.dropped
        d[table] = d.get(table, 0) + 1

    def open_requests(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------------ drain
    def drain(self) -> dict[str, pa.Table]:
        """Everything recorded since the last drain, as Arrow tables of the run-store schemas
        (times converted to epoch ns). Tables with no new rows are omitted.

        Safe to call from another thread while the engine records; not from two threads at once.
        """
        # Request ids retired one drain ago are safe to forget now: every row that names them
        # was published before they retired, and any row a racing rotation held back was
        # delivered by the previous drain at the latest.
        for rn in self._retire_next:
            self._ids.pop(rn, None)
        self._retire_next = _pop_all(self._retired)
        state = self._state.take()
        act = self._act.take()
        step = self._step.take()
        layers = self._layers.take()
        foreign = _pop_all(self._foreign_act)
        if foreign:
            seg = Segment(_ACT_COLS, len(foreign))
            for i, row in enumerate(foreign):
                for col, v in zip(seg.cols, row, strict=True):
                    col[i] = v
            seg.n = len(foreign)
            act.append((seg, 0, seg.n))
        requests = _pop_all(self._requests)
        samples = _pop_all(self._samples)
        events = _pop_all(self._events)
        ids = self._ids
        names = list(self._name_list)
        off = self.anchor.offset_ns
        out: dict[str, pa.Table] = {}
        spans = []
        if state:
            spans.append(tables.state_table(state, ids, off))
        if act:
            spans.append(tables.activity_table(act, ids, names, off))
        if step:
            spans.append(tables.step_table(step, names, off))
        if spans:
            out["spans"] = spans[0] if len(spans) == 1 else pa.concat_tables(spans)
        if layers:
            out["layers"] = tables.layers_table(layers, ids)
        if requests:
            out["requests"] = tables.requests_table(requests, off)
        if samples:
            out["samples"] = tables.samples_table(samples, off)
        if events:
            out["events"] = tables.events_table(events, ids, off)
        for name, tbl in out.items():
            self.stats.rows[name] = self.stats.rows.get(name, 0) + tbl.num_rows
        return out


def _pop_all(dq: deque[Any]) -> list[Any]:
    """Pop what `dq` holds now (each popleft is atomic; appends may continue meanwhile)."""
    return [dq.popleft() for _ in range(len(dq))]
