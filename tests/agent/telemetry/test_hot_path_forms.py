"""The hot path's shortcuts record exactly what the calls they stand for record: the eviction
event folded into `engine_step`, `ledgers`, `lookups` and `layers` packed straight into the
active segment, and the drain's dense request-id lookup and sparse `waits_on` column."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from agent.clock import ClockAnchor
from agent.telemetry import CLOCK_CPU, Recorder, tables
from agent.telemetry.buffers import Segment

ANCHOR = ClockAnchor(wall_ns=1_700_000_000_000_000_000, mono_ns=5_000)


def make(**kw: Any) -> Recorder:
    return Recorder(anchor=ANCHOR, clock=lambda: 1_000, nvtx=False, **kw)


def rows(t: dict[str, pa.Table], name: str) -> list[dict[str, Any]]:
    return t[name].to_pylist() if name in t else []


def equal_drains(a: Recorder, b: Recorder) -> None:
    ta, tb = a.drain(), b.drain()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].schema == tb[k].schema
        assert ta[k].equals(tb[k]), k
    assert a.stats == b.stats


# ---------------------------------------------------------------- eviction in engine_step
@pytest.mark.parametrize("evicted", [0, 3])
def test_engine_step_evicted_is_the_eviction_event(evicted: int) -> None:
    a, b = make(), make()
    for rec in (a, b):
        rec.event("fault", source="remote", detail={"kind": "x"})
    a.engine_step(1, 10, 11, 12, 13, 14, (12, 13), 2, 20, (1, 2, 3), (4, 5, 6))
    if evicted:
        a.event("eviction", t=14, detail={"tier": "device", "blocks": evicted})
    b.engine_step(1, 10, 11, 12, 13, 14, (12, 13), 2, 20, (1, 2, 3), (4, 5, 6),
                  evicted=evicted)
    for rec in (a, b):
        rec.event("fault", source="remote", detail={"kind": "y"})
    equal_drains(a, b)


def test_engine_step_evicted_is_recorded_when_the_step_row_fails() -> None:
    a, b = make(), make()
    a.engine_step(1, 10, 11, 12, "x", 14, None, 1, 1, (1, 1, 1))  # type: ignore[arg-type]
    a.event("eviction", t=14, detail={"tier": "device", "blocks": 2})
    b.engine_step(1, 10, 11, 12, "x", 14, None, 1, 1, (1, 1, 1),  # type: ignore[arg-type]
                  evicted=2)
    assert b.stats.recording_errors == 1
    equal_drains(a, b)


def test_engine_step_evicted_off_the_owner_thread() -> None:
    a, b = make(), make()
    a.engine_step(1, 10, 11, 12, 13, 14, None, 1, 1, (1, 1, 1))
    a.event("eviction", t=14, detail={"tier": "device", "blocks": 5})
    th = threading.Thread(target=lambda: b.engine_step(1, 10, 11, 12, 13, 14, None, 1, 1,
                                                       (1, 1, 1), evicted=5))
    th.start()
    th.join()
    equal_drains(a, b)


def test_engine_step_evicted_counts_a_full_events_buffer() -> None:
    rec = make(segment_rows=1, max_segments=1)  # room for one event
    rec.event("fault")
    rec.engine_step(1, 10, 11, 12, 13, 14, None, 1, 1, (1, 1, 1), evicted=1)
    assert rec.stats.dropped.get("events") == 1
    assert rows(rec.drain(), "events")[0]["name"] == "fault"


@pytest.mark.parametrize("device", [(-1, 0, 0), (0, 0, 0, 0)])
def test_engine_step_bad_pool_counts_record_no_step_row(device: tuple[int, ...]) -> None:
    rec = make()
    rec.engine_step(1, 10, 11, 12, 13, 14, None, 1, 1, device)  # type: ignore[arg-type]
    rec.engine_step(1, 10, 11, 12, 13, 14, None, 1, 1, (1, 1, 1), (0, -1, 0))
    assert rec.stats.recording_errors == 2
    assert rec.drain() == {}


# ---------------------------------------------------------------- ledgers / lookups / layers
def ledger_rows(rn: int) -> list[tuple[Any, ...]]:
    return [("load", rn, 5, "host", 32, 4096, 0, 7, -1),
            ("write", rn, None, "remote", 16, 100, 2, -1, -1),
            ("failed_timeout", rn, np.int64(9), "remote", 16, -1, 3, -1, 4),
            ("brand_new_name", rn, None, None, -1, -1, -1, -1, -1)]


@pytest.mark.parametrize("segment_rows", [2, 3, 64])
def test_ledgers_are_the_rows_of_ledger(segment_rows: int) -> None:
    a, b = make(segment_rows=segment_rows), make(segment_rows=segment_rows)
    for rec in (a, b):
        rec.request_begin("r0", 1)
    for rn in (0, 7):  # 7: unknown, counted per row
        for row in ledger_rows(rn):
            name, r, t, tier, tokens, nbytes, block, tid, layer = row
            a.ledger(name, r, t=t, tier=tier, tokens=tokens, nbytes=nbytes, block=block,
                     transfer_id=tid, layer=layer)
        b.ledgers(ledger_rows(rn))
    equal_drains(a, b)


@pytest.mark.parametrize("bad", [
    ("load", 0, 5, "nowhere", 1, 1, 0, -1, -1),  # unknown tier
    ("load", 0, 5, "host", 1, 1, 2 ** 31, -1, -1),  # block out of range
    ("load", 0, 5, "host", 1, 1, 0, -1, -2),  # layer out of range
    ("load", 0, 5, "host", 2 ** 63, 1, 0, -1, -1),  # not an int64
    ("load", 0, 5.5, "host", 1, 1, 0, -1, -1),  # t not an int
    (3, 0, 5, "host", 1, 1, 0, -1, -1),  # name not a str
    ("load", 0, 5, "host"),  # too short
])
def test_a_bad_ledgers_row_records_none(bad: tuple[Any, ...]) -> None:
    rec = make()
    rec.request_begin("r0", 1)
    rec.ledgers([ledger_rows(0)[0], bad, ledger_rows(0)[1]])
    rec.ledger("device_hit", 0, tier="device", tokens=1, block=0)
    assert rec.stats.recording_errors == 1
    spans = rows(rec.drain(), "spans")
    assert [s["name"] for s in spans if s["kind"] == "ledger"] == ["device_hit"]


@pytest.mark.parametrize("segment_rows", [3, 64])
@pytest.mark.parametrize("rn_known", [True, False])
def test_lookups_are_the_rows_of_activity_and_ledger(segment_rows: int,
                                                     rn_known: bool) -> None:
    probes = [("device", 10, 12, 0, 2), ("host", 12, 15, 2, 1), ("remote", 15, 30, 3, 4)]
    a, b = make(segment_rows=segment_rows), make(segment_rows=segment_rows)
    for rec in (a, b):
        rec.request_begin("r0", 1)
    rn = 0 if rn_known else 9
    for tier, t0, t1, first, blocks in probes:
        a.activity("lookup", t0, t1, request_num=rn, tier=tier, tokens=blocks * 16)
        a.ledger("lookup", rn, t=t1, tier=tier, tokens=blocks * 16, block=first)
    b.lookups(rn, probes, 16)
    equal_drains(a, b)


@pytest.mark.parametrize("bad", [("nowhere", 1, 2, 0, 1), ("host", 1, 2, -2, 1),
                                 ("host", 1.5, 2, 0, 1), ("host", 1, 2, 0)])
def test_a_bad_lookup_probe_records_none(bad: tuple[Any, ...]) -> None:
    for rn in (0, 9):  # 9: unknown
        rec = make()
        rec.request_begin("r0", 1)
        rec.lookups(rn, [("device", 1, 2, 0, 1), bad], 16)  # type: ignore[list-item]
        assert rec.stats.recording_errors == 1
        assert "spans" not in rec.drain() or all(
            s["kind"] == "state" for s in rows(rec.drain(), "spans"))


def test_a_lookup_failing_in_its_store_counts_an_unknown_request_as_before() -> None:
    # Checked values pass, the store fails (t not an int64): the unknown request is counted
    # once per row, as `lookups` always did, and nothing is recorded.
    rec = make()
    rec.lookups(9, [("device", 2 ** 63, 2 ** 63, 0, 1)], 16)
    assert rec.stats.recording_errors == 1
    assert rec.stats.unknown_requests == 2
    assert rec.drain() == {}


@pytest.mark.parametrize("segment_rows", [3, 64])
def test_layers_fast_path_is_the_rows_of_layer(segment_rows: int) -> None:
    a, b = make(segment_rows=segment_rows), make(segment_rows=segment_rows)
    layer_rows = [(i, 2 * i, 3, 100, 10 * i, 5, 0) for i in range(5)]
    for rec in (a, b):
        rec.request_begin("r0", 1)
    for layer, r in enumerate(layer_rows):
        a.layer(0, layer, *r)
    b.layers(0, layer_rows)
    a.layer(5, 0, *layer_rows[0])  # unknown: counted, skipped
    b.layers(5, layer_rows)
    equal_drains(a, b)


@pytest.mark.parametrize("bad", [(1, 2, 3), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 5, 6, "x"),
                                 5])
def test_a_bad_layers_row_records_none(bad: Any) -> None:
    rec = make()
    rec.request_begin("r0", 1)
    rec.layers(0, [(1, 2, 3, 4, 5, 6, 7), bad])
    assert rec.stats.recording_errors == 1
    assert "layers" not in rec.drain()


# ---------------------------------------------------------------- the drain's builders
def reference_words(nums: np.ndarray, ids: dict[int, str]) -> tuple[np.ndarray, list[str]]:
    uniq, inverse = np.unique(nums, return_inverse=True)
    words: list[str] = []
    remap = np.empty(len(uniq), dtype=np.int64)
    for j, u in enumerate(uniq.tolist()):
        rid = ids.get(u) if u >= 0 else None
        remap[j] = -1 if rid is None else len(words)
        if rid is not None:
            words.append(rid)
    return remap[inverse.reshape(-1)], words


@pytest.mark.parametrize("seed", range(5))
def test_request_words_dense_and_sparse_equal_the_sorting_lookup(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n = int(rng.integers(0, 60))
        span = int(rng.choice([2, 40, 10 ** 7, 2 ** 62]))
        nums = rng.integers(-3, span, n, dtype=np.int64)
        ids = {int(u): f"r{u}" for u in nums if u >= 0 and rng.random() < 0.8}
        codes, words = tables._request_words(nums, ids)
        ref_codes, ref_words = reference_words(nums, ids)
        assert words == ref_words
        assert codes.dtype == np.int64 and codes.tolist() == ref_codes.tolist()


def test_waits_column_equals_the_padded_list() -> None:
    rnd = random.Random(0)
    for _ in range(200):
        chunks = []
        padded: list[Any] = []
        for _ in range(rnd.randrange(1, 4)):
            seg = Segment(("a",), 64, row_major=True)
            lo = rnd.randrange(0, 10)
            hi = lo + rnd.randrange(1, 20)
            if rnd.random() < 0.7:
                seg.waits = {i: tuple(rnd.randrange(1, 99) for _ in range(rnd.randrange(1, 4)))
                             for i in rnd.sample(range(hi + 5), rnd.randrange(0, 6))}
            chunks.append((seg, lo, hi))
            padded += [(seg.waits or {}).get(i) for i in range(lo, hi)]
        extra = rnd.randrange(0, 30)  # the other span rows
        got = tables._waits_column(chunks, len(padded) + extra)
        if all(w is None for w in padded):
            assert got is None
        else:
            want = pa.array(padded + [None] * extra, pa.list_(pa.int64()))
            assert got is not None and got.type == want.type and got.equals(want)


def test_waits_column_takes_and_refuses_what_pa_array_does() -> None:
    seg = Segment(("a",), 8, row_major=True)
    seg.waits = {1: (1, 2), 2: (2 ** 63 - 1,)}
    got = tables._waits_column([(seg, 0, 3)], 4)
    assert got is not None
    assert got.equals(pa.array([None, (1, 2), (2 ** 63 - 1,), None], pa.list_(pa.int64())))
    seg.waits = {1: (True, 2)}
    with pytest.raises(pa.ArrowTypeError):
        pa.array([None, (True, 2), None], pa.list_(pa.int64()))
    with pytest.raises(pa.ArrowTypeError):
        tables._waits_column([(seg, 0, 3)], 3)


def test_spans_carry_waits_on_through_the_drain() -> None:
    rec = make()
    rn = rec.request_begin("r0", 1)
    rec.wait_for(rn, 4)
    rec.wait_for(rn, 6)
    rec.stage(rn, 2, 5)
    rec.activity("h2d", 1, 2, request_num=rn, tier="host", clock=CLOCK_CPU)
    rec.stage(rn, 3, 9)
    spans = rows(rec.drain(), "spans")
    assert [s["waits_on"] for s in spans] == [[4, 6], None, None]


# ---------------------------------------------------------------- the tier flow's ledger rows
def test_flow_admission_ledger_rows_are_the_runs_of_each_blocks_origin() -> None:
    from types import SimpleNamespace

    from instrumented_engine.tiers.flow import TierFlow
    from instrumented_engine.tiers.plan import TierPlan

    class Capture:
        def __init__(self) -> None:
            self.rows: list[Any] = []

        def ledgers(self, rows: list[Any]) -> None:
            self.rows += rows

    def oracle(flow: Any, req: Any, plan: TierPlan, hit: int, n: int, t: int,
               tid: int) -> list[Any]:
        """The rows as `_ledger` built them before: block by block through `_origin`."""
        rn, bs, pb = req.request_num, flow.bs, flow.layout.payload_bytes
        out: list[Any] = []
        if n:
            tiers = [TierFlow._origin(flow, plan, i) for i in range(hit, hit + n)]
            start = 0
            for j in range(1, n + 1):
                if j == n or tiers[j] != tiers[start]:
                    k = j - start
                    tier = tiers[start]
                    out.append(("load", rn, t, tier, k * bs, k * pb if tier == "host" else 0,
                                hit + start, tid, -1))
                    start = j
        failed, reason = TierFlow._failure(flow, plan, hit + n)
        if failed:
            first = max(hit + n, plan.promised_dev)
            lo, hi = plan.remote_lo, plan.remote_hi
            for tier, a, b in (("host", first, min(lo, hi)), ("remote", max(first, lo), hi)):
                if b > a:
                    out.append((f"failed_{reason}", rn, t, tier, (b - a) * bs, -1, a, -1, -1))
        return out

    rnd = random.Random(1)
    for _ in range(500):
        dev, host_n, remote_n = (rnd.randrange(0, 4) for _ in range(3))
        plan = TierPlan(promised_dev=dev, promised_host=host_n, promised_remote=remote_n)
        if remote_n and rnd.random() < 0.8:
            plan.statuses = [rnd.choice([None, None, "timeout", "checksum"])
                             for _ in range(remote_n)]
        hit = rnd.randrange(0, dev + 1)
        n = rnd.randrange(0, dev + host_n + remote_n - hit + 2)
        cap = Capture()
        flow = SimpleNamespace(rec=cap, bs=16, layout=SimpleNamespace(payload_bytes=100),
                               host=None if rnd.random() < 0.3 else object())
        flow._failure = lambda plan, used, f=flow: TierFlow._failure(f, plan, used)
        req = SimpleNamespace(request_num=3)
        TierFlow._ledger(flow, req, plan, hit, n, 77, 5)  # type: ignore[arg-type]
        assert cap.rows == oracle(flow, req, plan, hit, n, 77, 5)


# ---------------------------------------------------------------- the lifecycle's layer rows
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("timed", [False, True])
def test_first_token_layer_rows(split: bool, timed: bool) -> None:
    from types import SimpleNamespace

    from agent.telemetry import RequestAccounting
    from instrumented_engine.lifecycle import RequestLifecycle

    def layer_split(hit: int, loaded: int) -> list[tuple[int, int, int]]:
        return [(hit, loaded, 0), (hit // 2, 0, hit - hit // 2), (0, loaded, 3)]

    def layer_times(req: Any, layer: int) -> tuple[int, int]:
        return 10 + layer, 20 + layer

    rec = make()
    life = RequestLifecycle(rec, block_size=16, num_layers=3, clock=rec.now,
                            layer_split=layer_split if split else None)
    acct = RequestAccounting(prompt_tokens=100, device_hit_tokens=48, host_loaded_tokens=16,
                             remote_loaded_tokens=16, recomputed_tokens=20)
    req = SimpleNamespace(acct=acct, request_num=rec.request_begin("r0", 1),
                          first_token_ns=None, state=None)
    life.first_token(req, 50, layer_times if timed else None)  # type: ignore[arg-type]
    got = [tuple(r[k] for k in tables.LAYER_COLS[2:]) for r in rows(rec.drain(), "layers")]
    want = []
    for layer in range(3):
        load_ns, wait_ns = layer_times(req, layer) if timed else (0, 0)
        hit, loaded, skipped = layer_split(48, 32)[layer] if split else (48, 32, 0)
        want.append((hit, loaded, 20, 100, load_ns, wait_ns, skipped))
    assert got == want
