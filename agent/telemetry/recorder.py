"""The hot-path recorder: the one object the engine writes its telemetry into.

Rules (docs/DESIGN.md, "Hot path rules"): recording a stage boundary costs about a
microsecond of Python; appends go into preallocated int64 columns (names interned to small
codes), so a drain hands Arrow whole columns; no I/O, no string formatting, no OTel objects;
recording never raises into the caller. Exporters call `drain()` from their own thread.

The request-state API (`states.RequestStates`) is the partition helper; activity/step/layer
rows, events and samples live in `records.OtherRecords`; this module holds the buffers, the
bookkeeping and the drain.

Failure rule: a recording call that fails (bad arguments, an internal error) is counted in
`stats` and changes nothing: arguments are validated before the first store, and every value a
drain turns into Arrow is checked when it is recorded, so one bad call can never make a later
drain fail.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from agent.clock import ClockAnchor, now_ns, process_anchor
from agent.schema import STATES, STEP_PHASES
from agent.telemetry import tables
from agent.telemetry.accounting import RequestAccounting
from agent.telemetry.annotate import NvtxAnnotator
from agent.telemetry.buffers import Chunk, MatrixBlock, SegmentedTable, pop_all
from agent.telemetry.codes import CLOCK_CPU, CLOCK_CUDA, I32_MAX, TIER_CODE
from agent.telemetry.records import STEP_ROW, OtherRecords
from agent.telemetry.states import RequestStates, _Open
from agent.telemetry.status import EngineStatus

__all__ = ["CLOCK_CPU", "CLOCK_CUDA", "TIER_CODE", "Recorder", "RecorderStats",
           "RequestAccounting"]

log = logging.getLogger(__name__)

_STATE_COLS = ("request_num", "state", "start_ns", "end_ns")
_ACT_COLS = ("request_num", "name", "start_ns", "end_ns", "tier", "layer", "tokens", "bytes",
             "transfer_id", "clock", "kind", "block")
_STEP_COLS = ("step_id", "name", "start_ns", "end_ns", "batch_requests", "tokens", "clock")
_LAYER_COLS = tables.LAYER_COLS


@dataclass(slots=True)
class RecorderStats:
    """Self-telemetry: what the recorder could not record, and why."""

    dropped: dict[str, int] = field(default_factory=dict)
    recording_errors: int = 0
    clock_regressions: int = 0
    unknown_requests: int = 0
    rows: dict[str, int] = field(default_factory=dict)


class _Ids:
    """request_num → request_id for one drain: the live map plus ids resolved at record time."""

    __slots__ = ("ids", "late")

    def __init__(self, ids: dict[int, str], late: dict[int, str]) -> None:
        self.ids = ids
        self.late = late

    def get(self, rn: int) -> str | None:
        rid = self.late.get(rn)
        return self.ids.get(rn) if rid is None else rid


class Recorder(RequestStates, OtherRecords):
    """Columnar telemetry buffers plus the per-request state machine.

    Threading: request states (`stage`, `wait_for`, `first_token`, `request_end`) are recorded
    by one thread, the engine loop, without locks; `request_begin` may also run on another
    thread (an API thread admitting requests). `activity`,
    `step_span`, `layer`, `event` and `sample` may be called from any thread: calls from the
    owner (the thread that created the recorder or called `bind_thread`) write the columnar
    buffers directly, calls from other threads queue validated rows for the drain. `drain` may
    run on any thread (calls are serialised).

    Args:
        segment_rows: rows per preallocated segment.
        max_segments: full segments a table may hold before a drain; beyond it rows are dropped
            and counted (bounded memory when no exporter drains).
        nvtx: emit NVTX ranges (domain ``kvscope``): True, False, or the `NvtxAnnotator` to
            emit them through.
        clock: the monotonic clock in ns (injectable for tests).
        anchor: the process clock anchor used to convert to epoch ns on drain.
        retain_ids: request ids kept after it is safe to forget them, so rows recorded for a
            request shortly after it ended (a write-back, a late event) still carry its id.
    """

    def __init__(
        self,
        *,
        segment_rows: int = 16384,
        max_segments: int = 64,
        nvtx: bool | NvtxAnnotator = True,
        clock: Any = now_ns,
        anchor: ClockAnchor | None = None,
        retain_ids: int = 4096,
    ) -> None:
        if segment_rows < 1:
            raise ValueError(f"segment_rows must be >= 1, got {segment_rows}")
        if max_segments < 1:
            raise ValueError(f"max_segments must be >= 1, got {max_segments}")
        if retain_ids < 0:
            raise ValueError(f"retain_ids must be >= 0, got {retain_ids}")
        self._clock = clock
        # `now` is the clock itself (an engine reads it for every timestamp): one call, not a
        # method calling it.
        self.now = clock  # type: ignore[method-assign]
        self.anchor = anchor or process_anchor()
        self._owner = threading.get_ident()
        self._intern_lock = threading.Lock()
        self._stats_lock = threading.Lock()  # error/drop paths only, never the normal hot path
        self._drain_lock = threading.Lock()
        # Request states are written whole by the owner only: one packed store per row.
        self._state = SegmentedTable("spans", _STATE_COLS, segment_rows, max_segments,
                                     row_major=True)
        # Activity and ledger rows are written whole by the owner too: row-major.
        self._act = SegmentedTable("spans", _ACT_COLS, segment_rows, max_segments,
                                   row_major=True)
        self._step = SegmentedTable("spans", _STEP_COLS, segment_rows, max_segments)
        #: One row per engine step (`engine_step`, or the engine loop's own append through
        #: `EngineInstrumentation.step_done`): `tables.ENGINE_STEP_COLS` as int64s packed by
        #: `step_row_pack` (checked when packed: a bad value raises there, before the store),
        #: expanded into spans and pool samples by the drain (`_take_steps`).
        self.step_rows: deque[bytes] = deque()
        #: Packs one `step_rows` row (a C call; raises on a value that is not an int64).
        self.step_row_pack = STEP_ROW.pack
        # As many rows as a segmented table holds before it drops (its segments + the active).
        self.max_step_rows = segment_rows * (max_segments + 1)
        self._layers = SegmentedTable("layers", _LAYER_COLS, segment_rows, max_segments,
                                      row_major=True)
        self._max_rows = segment_rows * max_segments
        self._requests: deque[tuple[Any, ...]] = deque()
        self._samples: deque[tuple[Any, ...]] = deque()
        self._events: deque[tuple[Any, ...]] = deque()
        self._open: dict[int, _Open] = {}
        self._ids: dict[int, str] = {}
        self._retired: deque[int] = deque()  # appended by request_end, popped by drain
        self._retire_next: list[int] = []  # drain side only
        self._forgettable: deque[int] = deque()  # drain side only
        self._retain_ids = retain_ids
        self._nums = itertools.count()  # request_num: 0, 1, ...
        self._transfer_ids = itertools.count(1)  # next() is atomic: safe from any thread
        # `new_transfer_id` is the counter's own __next__ (as `now` is the clock): no Python
        # frame per transfer.
        self.new_transfer_id = self._transfer_ids.__next__  # type: ignore[method-assign]
        self._names: dict[str, int] = {}
        self._name_list: list[str] = []
        for n in (*STATES, *STEP_PHASES):
            self.intern(n)
        self.stats = RecorderStats()
        # The engine's latest self-report (`status`): an `EngineStatus`, or what builds one
        # when it is read (`engine_step`'s `status`), or None until the engine publishes one.
        self._pub: Any = None
        self._pub_built: tuple[Any, EngineStatus] | None = None
        #: Extra range annotators (the torch profiler under --profile): slow path only.
        self.annotators: list[Any] = []
        self.nvtx: NvtxAnnotator | None = None
        self._nv_start: Any = None
        self._nv_end: Any = None
        attrs: list[Any] = [None] * len(STATES)
        if nvtx:
            ann = (nvtx if isinstance(nvtx, NvtxAnnotator)
                   else NvtxAnnotator((*STATES, *STEP_PHASES)))
            if ann.available:
                self.nvtx = ann
                attrs = [ann.attributes(s) for s in STATES]
                # Whether a tool (Nsight Systems, ...) is attached is fixed at process start.
                # Without one the domain is nvtx's no-op dummy: skip its calls on the hot path
                # (~150 ns per boundary) instead of making calls that cannot record anything.
                # With a tool, the bound real-domain methods are called directly.
                if ann.real:
                    self._nv_start = ann.domain.start_range
                    self._nv_end = ann.domain.end_range
        # code → (code, NVTX attributes). One lookup on the hot path both rejects an invalid
        # state code (KeyError, before any store) and canonicalises it to a plain int.
        self._states: dict[int, tuple[int, Any]] = {c: (c, a) for c, a in enumerate(attrs)}
        self.closed = False

    def bind_thread(self) -> None:
        """Make the calling thread the recorder's owner (the engine loop's thread)."""
        self._owner = threading.get_ident()

    def publish(self, status: EngineStatus) -> None:
        """(Any thread) the engine's status now; replaces the previous one in one store, so a
        reader (an exporter's scrape) always sees one whole snapshot."""
        self._pub = status

    def publish_deferred(self, builder: Any, args: tuple[Any, ...]) -> None:
        """(Any thread) the engine's status as `builder(*args)`, built only when a reader
        asks for it (`status`): one store a step, as `publish`."""
        self._pub = (builder, args)

    def count_error(self) -> None:
        """Count a failed recording (for engine-side code that stores its rows itself, as
        `EngineInstrumentation.step_done` does into `step_rows`)."""
        self._error()

    def count_dropped(self, table: str, n: int = 1) -> None:
        """Count `n` rows of `table` dropped because its buffer was full (as above)."""
        self._drop(table, n)

    @property
    def status(self) -> EngineStatus | None:
        """The engine's latest self-report (`publish`, or `engine_step`'s `status`, built here
        on first read); None until it publishes one. Any thread."""
        pub = self._pub
        if pub is None or type(pub) is EngineStatus:
            return pub
        built = self._pub_built
        if built is not None and built[0] is pub:
            return built[1]
        st = pub[0](*pub[1])  # (builder, args): the step's counts, one reference store
        self._pub_built = (pub, st)
        return st

    @status.setter
    def status(self, status: EngineStatus | None) -> None:
        self._pub = status

    def add_annotator(self, annotator: Any) -> None:
        """Also emit request-stage ranges to `annotator` (start(name, payload)/end(id))."""
        self.annotators.append(annotator)

    # ------------------------------------------------------------------ names and ids
    def intern(self, name: str) -> int:
        """The small integer code of a span name (stable for this recorder).

        Raises:
            TypeError: `name` is not a str.
        """
        code = self._names.get(name)
        if code is not None:
            return code
        if not isinstance(name, str):
            raise TypeError(f"span name must be a str, got {type(name).__name__}")
        # Rare (first sighting of a name) and reachable from several threads: without the lock
        # two threads could hand out the same code for different names.
        with self._intern_lock:
            code = self._names.get(name)
            if code is None:
                code = len(self._name_list)
                # List first: a code visible in _names always has its name in the list.
                self._name_list.append(name)
                self._names[name] = code
        return code

    def new_transfer_id(self) -> int:  # replaced by the counter's __next__ in __init__
        """A fresh transfer id (links activity spans to the states that waited on them)."""
        return next(self._transfer_ids)

    def now(self) -> int:  # replaced by the clock itself in __init__
        """The recorder's clock (monotonic ns)."""
        return self._clock()

    # ------------------------------------------------------------------ request states
    # ------------------------------------------------------------------ bookkeeping
    def _error(self) -> None:
        with self._stats_lock:
            self.stats.recording_errors += 1
            first = self.stats.recording_errors == 1
        if first:
            log.warning("kvscope telemetry: a recording call failed; counting further failures",
                        exc_info=True)

    def _drop(self, table: str, n: int = 1) -> None:
        with self._stats_lock:
            d = self.stats.dropped
            d[table] = d.get(table, 0) + n

    def _count_unknown(self) -> None:
        with self._stats_lock:
            self.stats.unknown_requests += 1

    # ------------------------------------------------------------------ drain
    def drain(self) -> dict[str, pa.Table]:
        """Everything recorded since the last drain, as Arrow tables of the run-store schemas
        (times converted to epoch ns). Tables with no new rows are omitted.

        Safe to call from any thread while the engine records; concurrent calls are
        serialised. Never raises for recorded data: a table that cannot be built is counted in
        `stats.dropped` and `stats.recording_errors`.
        """
        with self._drain_lock:
            # Every row naming these requests was published before they were retired, so the
            # take() below delivers it, except rows of a segment the writer rotated while
            # take() ran: those come with the next drain. Their ids are forgotten after it.
            retired_now = pop_all(self._retired)
            late: dict[int, str] = {}
            state = self._state.take(late)
            act = self._act.take(late)
            step = self._step.take(late)
            steps = self._take_steps()
            layers = self._layers.take(late)
            requests = pop_all(self._requests)
            samples = pop_all(self._samples)
            events = pop_all(self._events)
            ids: Any = _Ids(self._ids, late) if late else self._ids
            names = list(self._name_list)  # after take(): holds every code the rows use
            off = self.anchor.offset_ns
            out: dict[str, pa.Table | None] = {}
            if state or act or step or steps:
                # One table for the three span buffers (a drain's cost is its Arrow calls).
                out["spans"] = self._build(
                    "spans", _rows(state) + _rows(act) + _rows(step) + _rows(steps) * 4,
                    tables.spans_table, state, act, step, steps, ids, names, off)
            if layers:
                out["layers"] = self._build("layers", _rows(layers), tables.layers_table, layers,
                                            ids)
            if requests:
                out["requests"] = self._build("requests", len(requests), tables.requests_table,
                                              requests, off)
            if samples or steps:
                out["samples"] = self._build("samples", len(samples) + _rows(steps) * 6,
                                             tables.engine_samples_table, steps, samples, off)
            if events:
                out["events"] = self._build("events", len(events), tables.events_table, events,
                                            off)
            self._forget_ids(retired_now)
            result = {k: v for k, v in out.items() if v is not None}
            for name, tbl in result.items():
                self.stats.rows[name] = self.stats.rows.get(name, 0) + tbl.num_rows
            return result

    def _take_steps(self) -> list[Chunk]:
        """(Drain) the queued engine step rows as one chunk of `tables.ENGINE_STEP_COLS`
        columns. Rows come packed and checked (`engine_step`, `step_done`); anything else
        found in `step_rows` (not a packed row, or breaking `engine_step`'s rules: batch
        within int32, pool counts >= 0, the host's all -1 or all >= 0) is counted as a
        recording error and left out."""
        raw = pop_all(self.step_rows)
        if not raw:
            return []
        size = STEP_ROW.size
        try:
            if set(map(type, raw)) != {bytes} or set(map(len, raw)) != {size}:
                raise ValueError("a step row of another type or size")
            buf = b"".join(raw)
        except Exception:
            good = [r for r in raw if type(r) is bytes and len(r) == size]
            self._count_bad_rows(len(raw) - len(good))
            if not good:
                return []
            buf = b"".join(good)
        m = np.frombuffer(buf, dtype=np.int64).reshape(-1, len(tables.ENGINE_STEP_COLS))
        batch, dev, host = m[:, 8], m[:, 10:13], m[:, 13:16]
        ok = ((batch >= -1) & (batch <= I32_MAX) & (dev >= 0).all(axis=1)
              & ((host == -1).all(axis=1) | (host >= 0).all(axis=1)))
        if not ok.all():
            self._count_bad_rows(int((~ok).sum()))
            m = m[ok]
            if not len(m):
                return []
        return [(MatrixBlock(np.array(m)), 0, len(m))]

    def _count_bad_rows(self, n: int) -> None:
        """(Drain) count `n` malformed `step_rows` entries as recording errors (logged once,
        as `_error` logs, without a traceback: nothing raised)."""
        if n <= 0:
            return
        with self._stats_lock:
            first = self.stats.recording_errors == 0
            self.stats.recording_errors += n
        if first:
            log.warning("kvscope telemetry: %d malformed engine step row(s) dropped by the "
                        "drain; counting further failures", n)

    def _build(self, table: str, n: int, fn: Any, *args: Any) -> pa.Table | None:
        try:
            return fn(*args)
        except Exception:  # a bug, not bad input (inputs are checked when recorded)
            self._error()
            self._drop(table, n)
            return None

    def _forget_ids(self, retired_now: list[int]) -> None:
        """(Drain) forget the ids retired before the previous drain, keeping `retain_ids`."""
        self._forgettable.extend(self._retire_next)
        self._retire_next = retired_now
        for _ in range(len(self._forgettable) - self._retain_ids):
            self._ids.pop(self._forgettable.popleft(), None)


def _rows(chunks: list[Chunk]) -> int:
    return sum(hi - lo for _, lo, hi in chunks)
