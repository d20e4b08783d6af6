"""The exporters' shared helpers: deterministic trace ids and the request/span assembler."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest

from agent.exporters.assembly import RequestAssembler
from agent.exporters.ids import span_id_for, span_id_hex, trace_id_for, trace_id_hex
from agent.schema import STATE_CODE
from agent.telemetry import RequestAccounting
from tests.agent.exporters.common import MS, make_recorder, record_workload, split_batch


def test_trace_ids_are_deterministic_and_distinct() -> None:
    a = trace_id_for("req-a", "run-1")
    assert a == trace_id_for("req-a", "run-1")
    assert a != trace_id_for("req-a", "run-2")
    assert trace_id_for("ab", "c") != trace_id_for("a", "bc")  # separator in the digest
    assert 0 < a < 1 << 128 and 0 < span_id_for("req-a", "run-1") < 1 << 64
    assert len(trace_id_hex(a)) == 32 and int(trace_id_hex(a), 16) == a
    assert span_id_hex(1) == "0000000000000001"


def test_assembler_holds_spans_until_the_request_row_arrives() -> None:
    rec = make_recorder()
    asm = RequestAssembler()
    rn = rec.request_begin("r1", 10 * MS)
    rec.stage(rn, STATE_CODE["queue"], 12 * MS)
    rec.stage(rn, STATE_CODE["prefill"], 15 * MS)
    out = asm.feed(rec.drain())
    assert out.num_requests == 0 and asm.pending_spans == 2
    rec.first_token(rn, 20 * MS)
    rec.request_end(rn, RequestAccounting(prompt_tokens=8, recomputed_tokens=8), t=30 * MS)
    out = asm.feed(rec.drain())
    assert out.requests["request_id"].to_pylist() == ["r1"]
    assert out.spans["name"].to_pylist() == ["lookup", "queue", "prefill", "decode"]
    assert out.lo.tolist() == [0] and out.hi.tolist() == [4]
    assert out.complete.tolist() == [True]
    assert asm.pending_spans == 0 and asm.pending_requests == 0


def test_assembler_waits_for_a_span_that_comes_after_the_row() -> None:
    rec = make_recorder()
    exp = record_workload(rec)
    first, late = split_batch(rec.drain(), "req-a", "decode")
    asm = RequestAssembler()
    out = asm.feed(first)
    assert sorted(out.requests["request_id"].to_pylist()) == ["req-b", "req-c", "req-d"]
    assert out.complete.all()
    out = asm.feed(late)
    assert out.requests["request_id"].to_pylist() == ["req-a"]
    assert out.complete.tolist() == [True]
    got = list(zip(out.spans["name"].to_pylist(), out.spans["start_ns"].to_pylist(),
                   out.spans["end_ns"].to_pylist(), strict=True))
    assert got == exp.states["req-a"]


def test_assembler_hands_over_incomplete_requests_after_max_wait_and_bounds_spans() -> None:
    rec = make_recorder()
    record_workload(rec)
    first, _lost = split_batch(rec.drain(), "req-a", "decode")
    asm = RequestAssembler(max_wait=1)
    assert asm.feed(first).num_requests == 3
    out = asm.feed({})  # the lost span never comes: handed over on the next drain
    assert out.requests["request_id"].to_pylist() == ["req-a"]
    assert out.complete.tolist() == [False] and asm.incomplete == 1

    small = RequestAssembler(max_pending_spans=2)
    rn = rec.request_begin("r9", 0)
    for k, s in enumerate(("queue", "prefill", "sync", "prefill")):
        rec.stage(rn, STATE_CODE[s], (k + 1) * MS)
    small.feed(rec.drain())
    assert small.pending_spans == 2 and small.dropped_spans == 2


def test_assembler_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="max_pending_spans"):
        RequestAssembler(max_pending_spans=0)
    with pytest.raises(ValueError, match="max_wait"):
        RequestAssembler(max_wait=-1)


def test_workload_fixture_is_what_the_recorder_drains() -> None:
    rec = make_recorder()
    exp = record_workload(rec)
    batch = rec.drain()
    req = batch["requests"]
    assert req["request_id"].to_pylist() == ["req-a", "req-b", "req-c", "req-d"]
    assert req["finish_ns"].to_pylist() == [exp.finish_ns[r] for r in exp.states]
    state = batch["spans"].filter(pc.equal(batch["spans"]["kind"], "state"))
    assert state.num_rows == sum(len(v) for v in exp.states.values())
    dur = np.asarray(state["end_ns"]) - np.asarray(state["start_ns"])
    assert int(dur.sum()) == sum(exp.e2e_ns.values())
