"""`Recorder.ledgers` records exactly the rows of one `ledger` call per row, in order, on the
owner thread, off it and across a segment's end; a bad row records none of them."""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa

from agent.clock import ClockAnchor
from agent.telemetry import Recorder

ANCHOR = ClockAnchor(wall_ns=1_700_000_000_000_000_000, mono_ns=5_000)

#: (name, request_num, t, tier, tokens, nbytes, block, transfer_id, layer)
ROWS: list[tuple[Any, ...]] = [
    ("load", 0, 120, "host", 32, 4096, 2, 7, -1),
    ("load", 0, 120, "remote", 16, 0, 4, 7, -1),
    ("failed_evicted", 0, 120, "remote", 48, -1, 5, -1, -1),
    ("write", 1, None, "host", 16, 2048, 0, -1, -1),
    ("write", 1, None, None, 16, 2048, 0, -1, 3),
    ("group_limited", 99, 130, "device", 16, -1, 1, -1, 2),  # an unknown request: counted
]


def make(segment_rows: int = 16384) -> Recorder:
    rec = Recorder(anchor=ANCHOR, clock=lambda: 1_000, nvtx=False, segment_rows=segment_rows)
    rec.request_begin("r0", 10)
    rec.request_begin("r1", 20)
    return rec


def one_by_one(rec: Recorder, rows: list[tuple[Any, ...]]) -> None:
    for name, rn, t, tier, tokens, nbytes, block, tid, layer in rows:
        rec.ledger(name, rn, t=t, tier=tier, tokens=tokens, nbytes=nbytes, block=block,
                   transfer_id=tid, layer=layer)


def spans(tables: dict[str, pa.Table]) -> list[dict[str, Any]]:
    return tables["spans"].to_pylist() if "spans" in tables else []


def test_ledgers_records_the_rows_of_ledger_in_order() -> None:
    a, b = make(), make()
    one_by_one(a, ROWS)
    b.ledgers(ROWS)
    ta, tb = a.drain(), b.drain()
    assert spans(ta) == spans(tb) and len(spans(tb)) == len(ROWS)
    assert a.stats.unknown_requests == b.stats.unknown_requests == 1
    assert b.stats.recording_errors == 0


def test_ledgers_across_a_segment_end_and_off_the_owner_thread() -> None:
    a = make()
    one_by_one(a, ROWS * 3)
    ref = spans(a.drain())
    b = make(segment_rows=4)  # the rows span several segments
    b.ledgers(ROWS[:3])
    b.ledgers(ROWS * 3)
    assert spans(b.drain())[3:] == ref
    c = make()
    t = threading.Thread(target=c.ledgers, args=(ROWS * 3,))
    t.start()
    t.join()
    assert spans(c.drain()) == ref
    assert b.stats.recording_errors == c.stats.recording_errors == 0


def test_a_bad_row_records_none_of_them_and_is_counted() -> None:
    for bad in (("load", 0, 120, "nowhere", 1, 1, 0, -1, -1),  # unknown tier
                ("load", 0, 120, "host", 1, 1, -2, -1, -1),  # block out of range
                ("load", 0, 120, "host", "1", 1, 0, -1, -1),  # not an int
                ("load", 0, 120, "host", 2**63, 1, 0, -1, -1)):  # not an int64
        rec = make()
        rec.ledgers([ROWS[0], bad, ROWS[1]])
        assert spans(rec.drain()) == []
        assert rec.stats.recording_errors == 1
        other = make(segment_rows=2)
        other.ledgers([ROWS[0], bad, ROWS[1]])
        assert spans(other.drain()) == []
