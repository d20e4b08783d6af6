"""The engine loop's step record (`EngineInstrumentation.step_done`: one packed row appended
to `Recorder.step_rows`, checked when recorded and expanded by the drain) records exactly what
the general `Recorder.engine_step` records for the same step, and what the step's values are;
a bad step is counted when recorded and records nothing; anything else found in `step_rows` is
counted by the drain and left out; the drain's shared-encoder JSON and sliced integer columns
equal what they stand for."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from agent.clock import ClockAnchor
from agent.telemetry import Recorder, tables
from instrumented_engine.instrumentation import EngineInstrumentation, _engine_status

ANCHOR = ClockAnchor(wall_ns=1_700_000_000_000_000_000, mono_ns=5_000)


def make(**kw: Any) -> Recorder:
    return Recorder(anchor=ANCHOR, clock=lambda: 1_000, nvtx=False, **kw)


class _Stats:
    def __init__(self) -> None:
        self.outcomes: dict[tuple[str, str], int] = {}

    def outcome_counts(self) -> dict[tuple[str, str], int]:
        return dict(self.outcomes)


class _Remote:
    def __init__(self) -> None:
        self.stats = _Stats()

    def breaker_states(self) -> dict[str, str]:
        return {"s": "closed"}

    def breaker_open_ns(self) -> dict[str, int]:
        return {}


class _Host:
    def __init__(self) -> None:
        self.counts = (1, 2, 3)

    def state_counts(self) -> tuple[int, int, int]:
        return self.counts


class _Flow:
    def __init__(self, host: bool, remote: bool) -> None:
        self.host = _Host() if host else None
        self.remote = _Remote() if remote else None

    def remote_status(self) -> Any:
        from agent.telemetry import RemoteStatus

        r = self.remote
        if r is None:
            return None
        return RemoteStatus(r.breaker_states(), r.stats.outcome_counts(), r.breaker_open_ns())


def _general(rec: Recorder, ei: EngineInstrumentation, flow: _Flow | None, device: Any,
             args: tuple[Any, ...]) -> None:
    """The step as the engine recorded it before `step_done` appended its own row: one
    `engine_step` with the remote's changed counts and the status builder."""
    step_id, t0, t1, t2, t3, t4, forward, batch, tokens, running, waiting, pre, evicted = args
    host = flow.host.state_counts() if flow is not None and flow.host is not None else None
    extra: Any = ()
    if flow is not None and flow.remote is not None:
        extra = ei._remote_changes(flow.remote)
    rec.engine_step(step_id, t0, t1, t2, t3, t4, forward, batch, tokens, device, host, extra,
                    status=(_engine_status, (running, waiting, pre, device, host, flow)),
                    evicted=evicted)


def _equal(a: Recorder, b: Recorder) -> None:
    ta, tb = a.drain(), b.drain()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].schema == tb[k].schema
        assert ta[k].equals(tb[k]), k
    assert a.stats == b.stats


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("remote", [False, True])
def test_step_done_records_the_rows_of_engine_step(host: bool, remote: bool) -> None:
    a, b = make(), make()
    flow_a, flow_b = _Flow(host, remote), _Flow(host, remote)
    counts = [(4, 5, 6)]
    fast = EngineInstrumentation(a, device="cpu", device_counts=lambda: counts[0],
                                 flow=flow_a)  # type: ignore[arg-type]
    slow = EngineInstrumentation(b, device="cpu")
    for i in range(6):
        counts[0] = (4 + i, 5, 6 - i % 3)
        for f in (flow_a, flow_b):
            if f.host is not None:
                f.host.counts = (i, 2 * i, 3)
            if f.remote is not None and i % 2:
                key = ("get", "ok" if i % 3 else "timeout")
                f.remote.stats.outcomes[key] = f.remote.stats.outcomes.get(key, 0) + i
        t = 100 * i
        args = (i, t, t + 1, t + 2, t + 3, t + 4, None if i == 2 else (t + 2, t + 3), i + 1,
                10 * i, i, 2, i // 2, i % 3)
        fast.step_done(*args)
        _general(b, slow, flow_b, counts[0], args)
        a.sample("pool", "between", float(i), entity="x", t=t + 4)
        b.sample("pool", "between", float(i), entity="x", t=t + 4)
        assert a.status == b.status
    _equal(a, b)


def test_step_done_off_the_owner_thread_is_the_same_row() -> None:
    import threading

    a, b = make(), make()
    fast = EngineInstrumentation(a, device="cpu", device_counts=lambda: (1, 2, 3))
    args = (0, 10, 11, 12, 13, 14, (12, 13), 1, 5, 1, 0, 0, 0)
    th = threading.Thread(target=fast.step_done, args=args)
    th.start()
    th.join()
    _general(b, EngineInstrumentation(b, device="cpu"), None, (1, 2, 3), args)
    _equal(a, b)


def test_step_done_counts_a_full_queue_as_engine_step_does() -> None:
    a, b = make(segment_rows=1, max_segments=1), make(segment_rows=1, max_segments=1)
    flow_a, flow_b = _Flow(True, True), _Flow(True, True)
    fast = EngineInstrumentation(a, device="cpu", device_counts=lambda: (1, 2, 3),
                                 flow=flow_a)  # type: ignore[arg-type]
    slow = EngineInstrumentation(b, device="cpu")
    for i in range(4):
        for f in (flow_a, flow_b):
            assert f.remote is not None
            f.remote.stats.outcomes[("get", "ok")] = i + 1
            f.remote.stats.outcomes[("put", f"e{i % 2}")] = i + 1
        args = (i, i, i, i, i, i, None if i % 2 else (i, i), 1, 1, 0, 0, 0, 0)
        fast.step_done(*args)
        _general(b, slow, flow_b, (1, 2, 3), args)
    assert a.stats.dropped == b.stats.dropped
    assert a.stats.dropped.get("spans") and a.stats.dropped.get("samples")
    _equal(a, b)


def _wall(t: int) -> int:
    return ANCHOR.wall_ns + t - ANCHOR.mono_ns


def test_a_drained_step_holds_the_steps_values() -> None:
    """Checked against the step's own values (not against `engine_step`, which shares the
    drain with `step_done`)."""
    rec = make()
    ei = EngineInstrumentation(rec, device="cpu", device_counts=lambda: (4, 5, 6),
                               flow=_Flow(True, False))  # type: ignore[arg-type]
    ei.step_done(7, 100, 101, 102, 103, 104, (102, 103), 3, 30, 1, 0, 0, 0)
    t = rec.drain()
    spans = t["spans"].to_pylist()
    assert [(r["kind"], r["name"], r["start_ns"], r["end_ns"], r["step_id"],
             r["batch_requests"], r["tokens"], r["clock"]) for r in spans] == [
        ("step", "schedule", _wall(100), _wall(101), 7, 3, 30, "cpu"),
        ("step", "prepare", _wall(101), _wall(102), 7, 3, 30, "cpu"),
        ("step", "sample", _wall(103), _wall(104), 7, 3, 30, "cpu"),
        ("step", "forward", _wall(102), _wall(103), 7, 3, 30, "cpu")]
    samples = t["samples"].to_pylist()
    assert [(r["ts_ns"], r["source"], r["entity"], r["metric"], r["value"], r["unit"])
            for r in samples] == [
        (_wall(104), "pool", tier, metric, float(v), "blocks")
        for tier, counts in (("device", (4, 5, 6)), ("host", (1, 2, 3)))
        for metric, v in zip(("in_use", "cached_free", "empty"), counts, strict=True)]
    assert rec.stats.recording_errors == 0


_GOOD = (2, 20, 21, 22, 23, 24, (22, 23), 1, 1, 4, 5, 6, 0)


@pytest.mark.parametrize("bad", [
    {"t": "x"}, {"t": 13.0}, {"t": 2**63}, {"batch": 2**31}, {"batch": -2},
    {"device": (1, -1, 1)}, {"host": (0, -1, 0)}, {"host": (-1, -1, -1)},
    {"device": (1, 1.5, 1)}, {"forward": (1, None)},
])
def test_a_bad_step_is_counted_when_recorded_and_records_nothing(bad: dict[str, Any]) -> None:
    a, b = make(), make()
    device = [(1, 1, 1)]
    flow = _Flow(True, False)
    ei = EngineInstrumentation(a, device="cpu", device_counts=lambda: device[0],
                               flow=flow)  # type: ignore[arg-type]
    ref = EngineInstrumentation(b, device="cpu", device_counts=lambda: (1, 1, 1),
                                flow=_Flow(True, False))  # type: ignore[arg-type]
    ei.step_done(*_GOOD)
    ref.step_done(*_GOOD)
    before = a.status
    args = [3, 30, 31, 32, 33, 34, (32, 33), 1, 1, 0, 0, 0, 0]
    if "t" in bad:
        args[4] = bad["t"]
    if "batch" in bad:
        args[7] = bad["batch"]
    if "forward" in bad:
        args[6] = bad["forward"]
    if "device" in bad:
        device[0] = bad["device"]
    if "host" in bad:
        assert flow.host is not None
        flow.host.counts = bad["host"]
    ei.step_done(*args)  # type: ignore[arg-type]
    assert a.stats.recording_errors == 1  # counted at the call, not at the next drain
    assert a.status == before  # the last good step's status stays published
    assert len(a.step_rows) == 1
    ta, tb = a.drain(), b.drain()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].equals(tb[k]), k
    assert a.stats.rows == b.stats.rows and a.stats.recording_errors == 1


def test_a_bad_status_value_keeps_the_steps_rows() -> None:
    """running / waiting / preemptions only reach the status: a value there the tables would
    refuse does not cost the step its spans and samples."""
    a, b = make(), make()
    ea = EngineInstrumentation(a, device="cpu", device_counts=lambda: (1, 2, 3))
    eb = EngineInstrumentation(b, device="cpu", device_counts=lambda: (1, 2, 3))
    ea.step_done(0, 10, 11, 12, 13, 14, (12, 13), 1, 5, 1, 0, 1.5, 0)  # type: ignore[arg-type]
    eb.step_done(0, 10, 11, 12, 13, 14, (12, 13), 1, 5, 1, 0, 1, 0)
    assert a.stats.recording_errors == 0
    _equal(a, b)


@pytest.mark.parametrize("junk", [b"short", None, (1, 2, 3), b"x" * 129, bytearray(128)])
def test_junk_in_step_rows_is_counted_by_the_drain(junk: Any) -> None:
    a, b = make(), make()
    a.engine_step(2, 20, 21, 22, 23, 24, (22, 23), 1, 1, (1, 1, 1))
    a.step_rows.append(junk)
    b.engine_step(2, 20, 21, 22, 23, 24, (22, 23), 1, 1, (1, 1, 1))
    ta, tb = a.drain(), b.drain()
    assert a.stats.recording_errors == 1
    for k in tb:
        assert ta[k].equals(tb[k]), k
    a.step_rows.append(junk)
    assert a.drain() == {} and a.stats.recording_errors == 2


def test_a_packed_row_breaking_the_rules_is_counted_by_the_drain() -> None:
    a = make()
    a.step_rows.append(a.step_row_pack(1, 10, 11, 12, 13, 14, -1, -1, 1, 1, -1, 1, 1,
                                       -1, -1, -1))  # device count < 0
    assert a.drain() == {} and a.stats.recording_errors == 1


def test_engine_step_accepts_what_it_accepted() -> None:
    a, b = make(), make()
    a.engine_step(np.int64(1), 10, 11, 12, 13, 14, (np.int64(12), 13), 1, 1, (1, 2, 3))
    b.engine_step(1, 10, 11, 12, 13, 14, (12, 13), 1, 1, (1, 2, 3))
    _equal(a, b)


@pytest.mark.parametrize("detail", [
    {"tier": "device", "blocks": 3}, {"b": 1, "a": [1, 2], "c": None}, {1: "x", "y": 2},
    {"x": object}, {"f": 1.5, "nan": float("nan"), "u": "\u00fc"}, {}])
def test_detail_json_is_json_dumps(detail: dict[Any, Any]) -> None:
    try:
        want = json.dumps(detail, default=str, sort_keys=True)
    except TypeError:
        want = json.dumps(detail, default=str)
    assert tables.detail_json(detail) == want


@pytest.mark.parametrize("k", [1, 3])
def test_sliced_int_columns_equal_their_own_arrays(k: int) -> None:
    m = np.arange(5 * k, dtype=np.int64).reshape(k, 5) - 2
    got = tables._ints(pa.int64(), m)
    want = [pa.array(m[j].tolist(), pa.int64()) for j in range(k)]
    assert len(got) == k
    for g, w in zip(got, want, strict=True):
        assert g.equals(w) and g.null_count == 0 and g.type == pa.int64()
