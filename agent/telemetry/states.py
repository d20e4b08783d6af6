"""The per-request state machine of the recorder: the TTFT partition helper.

A request enters its first state at arrival and every later call moves it from one state to the
next at a single instant, so the state spans of a request tile [arrival, finish] with no gap and
no overlap by construction. All methods run on the recorder's owner thread (the engine loop)
without locks; `Recorder` mixes this class in.
"""

from __future__ import annotations

import hashlib
import operator
import sys
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from agent.schema import DECODE_STAGE, STATE_CODE, STATES, STATUSES
from agent.telemetry.accounting import _INT64S, RequestAccounting, _fields
from agent.telemetry.buffers import SegmentedTable
from agent.telemetry.codes import NO_RANGE

_DECODE = STATE_CODE[DECODE_STAGE]
_index = operator.index  # ints (and numpy ints) pass; floats, str and None raise TypeError


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
        self.nvtx = NO_RANGE
        self.extra: list[int] | None = None
        self.waits: list[int] | None = None
        self.tenant = tenant
        self.wclass = wclass


class RequestStates:
    """Request-state recording (mixed into `Recorder`, which defines the attributes below and
    the `_error`, `_drop` and `_count_unknown` bookkeeping)."""

    _clock: Any
    _open: dict[int, _Open]
    _ids: dict[int, str]
    _retired: deque[int]
    _requests: deque[tuple[Any, ...]]
    _max_rows: int
    _nums: Iterator[int]
    _state: SegmentedTable
    _states: dict[int, tuple[int, Any]]
    _nv_start: Any
    _nv_end: Any
    annotators: list[Any]
    stats: Any

    def _error(self) -> None: ...
    def _drop(self, table: str, n: int = 1) -> None: ...
    def _count_unknown(self) -> None: ...

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
            if not isinstance(request_id, str):
                raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
            if not (tenant is None or isinstance(tenant, str)):
                raise TypeError("tenant must be a str or None")
            if not (workload_class is None or isinstance(workload_class, str)):
                raise TypeError("workload_class must be a str or None")
            code, attrs = self._states[STATE_CODE[state]]
            t = self._clock() if arrival_ns is None else _index(arrival_ns)
            op = _Open(request_id, t, code, tenant, workload_class)
            rn = next(self._nums)  # atomic: a request may be begun on an API thread
            self._ids[rn] = request_id
            self._open[rn] = op
        except Exception:
            self._error()
            return -1
        try:
            if self._nv_start is not None:
                attrs.payload = rn  # what start_range(attrs, payload=rn) sets, minus its kwargs
                op.nvtx = self._nv_start(attrs)
            if self.annotators:
                op.extra = [ann.start(state, rn) for ann in self.annotators]
        except Exception:
            self._error()  # the request is open and recorded; only its annotation failed
        return rn

    def stage(self, rn: int, state: int, t: int | None = None) -> None:
        """Move request `rn` into `state` (a `STATE_CODE`) at `t` (now if None).

        The current state's span ends exactly where the new one starts. A `t` earlier than the
        current state's start is clamped to it and counted as a clock regression.
        """
        try:
            if t is None:
                t = self._clock()
            try:
                op = self._open[rn]  # a subscript is cheaper than .get() when the key exists
            except KeyError:
                self._count_unknown()
                return
            state, attrs = self._states[state]
            start = op.start
            if t < start:
                t = start
                self.stats.clock_regressions += 1  # owner thread only: no race
            # NOTE: `_write_state` (request_end's) is the same write, inline here: `stage` is hot.
            seg = self._state.active
            i = seg.n
            if i == seg.cap:
                seg = self._state.rotate()
                i = 0
            waits = op.waits
            if seg is not None:
                # One packed store of the whole row; a non-int t fails here, before the row
                # is published.
                seg.pack(seg.buf, i * seg.row_bytes, rn, op.state, start, t)
                if waits is not None:
                    if seg.waits is None:
                        seg.waits = {}
                    seg.waits[i] = tuple(waits)
                    op.waits = None
                seg.n = i + 1  # publish the row
            else:
                self._drop("spans")
                op.waits = None  # the dropped span's waits are not the next state's
            # Commit before annotating: if an NVTX call fails the state machine has still
            # moved on (otherwise the next boundary would rewrite an overlapping span).
            op.state = state
            op.start = t
            nv_end = self._nv_end
            if nv_end is not None:
                nv_end(op.nvtx)
                # The payload set on the state's cached attributes directly: nvtx's
                # start_range(attrs, payload=rn) does the same through two more Python calls
                # and a keyword dict (a third of a boundary's NVTX cost).
                attrs.payload = rn
                op.nvtx = self._nv_start(attrs)
            if self.annotators:
                self._annotate(op, STATES[state], rn)
        except Exception:
            self._error()

    def _write_state(self, op: _Open, rn: int, t: int) -> None:
        """(Owner) close `op`'s current state at `t` (>= op.start): the row of `stage()`."""
        tbl = self._state
        seg = tbl.active
        i = seg.n
        if i == seg.cap:
            seg = tbl.rotate()
            i = 0
        if seg is None:
            self._drop("spans")
        else:
            seg.pack(seg.buf, i * seg.row_bytes, rn, op.state, op.start, t)
            if op.waits is not None:
                if seg.waits is None:
                    seg.waits = {}
                seg.waits[i] = tuple(op.waits)
            seg.n = i + 1
        op.waits = None
        op.start = t

    def _annotate(self, op: _Open, name: str, rn: int) -> None:
        for ann, rid in zip(self.annotators, op.extra or (), strict=False):
            ann.end(rid)
        op.extra = [ann.start(name, rn) for ann in self.annotators]

    def wait_for(self, rn: int, transfer_id: int) -> None:
        """Note that request `rn`'s current state waits on `transfer_id` (its `waits_on`)."""
        try:
            op = self._open.get(rn)
            if op is None:
                self._count_unknown()
                return
            transfer_id = _index(transfer_id)
            if op.waits is None:
                op.waits = [transfer_id]
            elif transfer_id not in op.waits:
                op.waits.append(transfer_id)
        except Exception:
            self._error()

    def first_token(self, rn: int, t: int | None = None) -> None:
        """The first token was sampled: TTFT ends here and the request enters `decode`.

        TTFT ends once: a second call for the same request is counted as an error and ignored.
        """
        try:
            op = self._open.get(rn)
            if op is None:
                self._count_unknown()
                return
            if op.first_token >= 0:
                raise ValueError(f"first_token called twice for request_num {rn}")
            t = self._clock() if t is None else _index(t)
            self.stage(rn, _DECODE, t)
            if op.state == _DECODE and op.start >= t:  # stage() succeeded (t maybe clamped)
                op.first_token = op.start
        except Exception:
            self._error()

    def request_end(
        self,
        rn: int,
        accounting: RequestAccounting,
        *,
        status: str = "ok",
        t: int | None = None,
        output_digest: str | None = None,
        output_token_ids: Sequence[int] | None = None,
    ) -> None:
        """Close the request's last state at `t` and record its accounting row.

        Args:
            output_digest: the digest of its output token ids (`output_digest()`), if any.
            output_token_ids: the ids themselves, only when the run records them.

        Invalid arguments (accounting fields that are not non-negative ints, an unknown status)
        are counted and leave the request open.
        """
        try:
            op = self._open.get(rn)
            if op is None:
                self._count_unknown()
                return
            # `RequestAccounting.checked_values` inlined (one C-level type/range check of
            # every field); a negative field goes through it for its error.
            acct = _INT64S.unpack(_INT64S.pack(*_fields(accounting)))
            if min(acct) < 0:
                accounting.checked_values()
            if status not in STATUSES:
                raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
            if not (output_digest is None or isinstance(output_digest, str)):
                raise TypeError("output_digest must be a str or None")
            ids = None if output_token_ids is None else array("q", output_token_ids)
            t = self._clock() if t is None else _index(t)
            if t < op.start:
                t = op.start
                self.stats.clock_regressions += 1
            self._write_state(op, rn, t)  # the request's last state span
            del self._open[rn]
            if len(self._requests) < self._max_rows:
                self._requests.append(
                    (op.request_id, rn, op.tenant, op.wclass, op.arrival,
                     op.first_token if op.first_token >= 0 else None, op.start, status, *acct,
                     output_digest, ids)
                )
            else:
                self._drop("requests")
            # Retire after every row naming the request is published (see drain()).
            self._retired.append(rn)
        except Exception:
            self._error()
            return
        try:
            if self._nv_end is not None:
                self._nv_end(op.nvtx)
            for ann, rid in zip(self.annotators, op.extra or (), strict=False):
                ann.end(rid)
        except Exception:
            self._error()

    def open_requests(self) -> int:
        """Requests begun and not yet ended."""
        return len(self._open)


def output_digest(token_ids: Sequence[int]) -> str:
    """The digest the requests table carries for a request's output token ids: hex
    BLAKE2b-128 over them as little-endian int64 (equal outputs, equal digests)."""
    data = array("q", token_ids)
    if sys.byteorder != "little":
        data.byteswap()
    h = _DIGEST.copy()  # the keyed state built once; the array hashed in place (no copy)
    h.update(data)
    return h.hexdigest()


_DIGEST = hashlib.blake2b(digest_size=16, person=b"kvscope.output")
