"""The batched recorder calls (`engine_step`, `lookups`) record exactly the rows of the calls
they stand for, in the same order, and the status they publish is built when it is read."""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa

from agent.clock import ClockAnchor
from agent.telemetry import CLOCK_CPU, EngineStatus, PoolStatus, Recorder

ANCHOR = ClockAnchor(wall_ns=1_700_000_000_000_000_000, mono_ns=5_000)
STEP = (7, 100, 110, 130, 170, 180)  # step_id, t0 .. t4


def make() -> Recorder:
    return Recorder(anchor=ANCHOR, clock=lambda: 1_000, nvtx=False)


def rows(tables: dict[str, pa.Table], name: str) -> list[dict[str, Any]]:
    return tables[name].to_pylist() if name in tables else []


def one_by_one(rec: Recorder, forward: tuple[int, int] | None,
               host: tuple[int, int, int] | None, extra: list[Any]) -> None:
    sid, t0, t1, t2, t3, t4 = STEP
    spans = [("schedule", t0, t1, CLOCK_CPU), ("prepare", t1, t2, CLOCK_CPU),
             ("sample", t3, t4, CLOCK_CPU)]
    if forward is not None:
        spans.append(("forward", *forward, CLOCK_CPU))
    rec.step_spans(sid, spans, batch_requests=3, tokens=40)
    pools = [("device", (5, 6, 7)), ("host", host)]
    rec.samples("pool", [(m, v, tier, "blocks") for tier, c in pools if c is not None
                         for m, v in zip(("in_use", "cached_free", "empty"), c, strict=True)]
                + extra, t=t4)


def batched(rec: Recorder, forward: tuple[int, int] | None,
            host: tuple[int, int, int] | None, extra: list[Any]) -> None:
    rec.engine_step(*STEP, forward, 3, 40, (5, 6, 7), host, extra)


def test_engine_step_records_the_rows_of_step_spans_and_samples() -> None:
    for forward in ((130, 165), None):
        for host in ((1, 2, 3), None):
            for extra in ([], [("remote_read_ok", 4, "remote", "operations")]):
                a, b = make(), make()
                one_by_one(a, forward, host, extra)
                batched(b, forward, host, extra)
                ta, tb = a.drain(), b.drain()
                assert rows(ta, "spans") == rows(tb, "spans")
                assert rows(ta, "samples") == rows(tb, "samples")
                assert b.stats.recording_errors == 0


def test_engine_step_off_the_owner_thread_records_the_same_rows() -> None:
    a, b = make(), make()
    one_by_one(a, (130, 165), (1, 2, 3), [])
    t = threading.Thread(target=batched, args=(b, (130, 165), (1, 2, 3), []))
    t.start()
    t.join()
    ta, tb = a.drain(), b.drain()
    assert rows(ta, "spans") == rows(tb, "spans")
    assert rows(ta, "samples") == rows(tb, "samples")


def test_samples_recorded_between_steps_keep_their_place() -> None:
    rec = make()
    rec.engine_step(1, 10, 11, 12, 13, 14, (12, 13), 1, 1, (1, 1, 1))
    rec.sample("pool", "between", 1.0, entity="x", t=20)
    rec.engine_step(2, 30, 31, 32, 33, 34, (32, 33), 1, 1, (2, 2, 2))
    rec.sample("pool", "last", 2.0, entity="x", t=40)
    metrics = [r["metric"] for r in rows(rec.drain(), "samples")]
    states = ["in_use", "cached_free", "empty"]
    assert metrics == [*states, "between", *states, "last"]


def test_a_bad_engine_step_records_nothing_and_is_counted() -> None:
    rec = make()
    rec.engine_step(1, 10, 11, 12, "x", 14, None, 1, 1, (1, 1, 1))  # type: ignore[arg-type]
    assert rec.drain() == {} and rec.stats.recording_errors == 1


def test_engine_step_rows_rotate_across_segments() -> None:
    rec = Recorder(anchor=ANCHOR, clock=lambda: 1_000, nvtx=False, segment_rows=2)
    for i in range(5):
        rec.engine_step(i, 10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4, None, 1, 1,
                        (i, 0, 0))
    spans = rows(rec.drain(), "spans")
    assert [r["step_id"] for r in spans] == [i for i in range(5) for _ in range(3)]


def test_the_published_status_is_built_when_read() -> None:
    rec = make()
    built: list[int] = []

    def build(running: int) -> EngineStatus:
        built.append(running)
        return EngineStatus(running=running, pools=(PoolStatus("device", 1, 2, 3),))

    rec.engine_step(*STEP, None, 3, 40, (1, 2, 3), status=(build, (4,)))
    assert built == []
    st = rec.status
    assert st is not None and st.running == 4 and rec.status is st and built == [4]
    rec.publish(EngineStatus(running=1))
    assert rec.status == EngineStatus(running=1)


def test_lookups_records_the_rows_of_activity_and_ledger() -> None:
    probes = [("device", 10, 12, 0, 2), ("host", 12, 15, 2, 1), ("remote", 15, 19, 3, 0)]
    a, b = make(), make()
    for r in (a, b):
        r.request_begin("r0", 5)
    for tier, t0, t1, first, blocks in probes:
        a.activity("lookup", t0, t1, request_num=0, tier=tier, tokens=blocks * 16)
        a.ledger("lookup", 0, t=t1, tier=tier, tokens=blocks * 16, block=first)
    b.lookups(0, probes, 16)
    assert rows(a.drain(), "spans") == rows(b.drain(), "spans")
    bad = make()
    bad.lookups(0, [("nowhere", 1, 2, 0, 1)], 16)
    assert bad.drain() == {} and bad.stats.recording_errors == 1
