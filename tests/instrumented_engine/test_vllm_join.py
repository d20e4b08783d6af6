"""The vLLM observer's join (spool records → partition and accounting), without vLLM: the same
records the plug-ins write, with chosen times, so every boundary is known."""

from __future__ import annotations

import itertools
from pathlib import Path

import pyarrow as pa
import pytest

from agent.telemetry import Recorder
from instrumented_engine.vllm.join import build
from instrumented_engine.vllm.spool import SpoolWriter, read_spools

MS = 1_000_000


def _write(tmp: Path, sched: list[list], frontend: list[list] | None = None) -> list:
    w = SpoolWriter(tmp, "scheduler", {"block_size": 32, "vllm_version": "test",
                                       "num_layers": 2})
    base = w.anchor.mono_ns
    wall = w.anchor.wall_ns
    for r in sched:
        w.add([x(base, wall) if callable(x) else x for x in r])
    w.close()
    if frontend is not None:
        f = SpoolWriter(tmp, "frontend")
        for r in frontend:
            f.add(r)
        f.close()
    return read_spools(tmp)


def _t(ms: float):
    return lambda base, wall: base + int(ms * MS)


def _wall(ms: float):
    return lambda base, wall: wall + int(ms * MS)


def _states(rec: Recorder) -> dict[str, list[tuple[str, int, int]]]:
    spans: pa.Table = rec.drain()["spans"]
    d = spans.to_pydict()
    out: dict[str, list[tuple[str, int, int]]] = {}
    for rid, kind, name, s, e in zip(d["request_id"], d["kind"], d["name"], d["start_ns"],
                                     d["end_ns"], strict=True):
        if kind == "state":
            out.setdefault(rid, []).append((name, s, e))
    return {k: sorted(v, key=lambda x: x[1]) for k, v in out.items()}


def _durations(states: list[tuple[str, int, int]]) -> list[tuple[str, float]]:
    return [(n, round((e - s) / MS, 3)) for n, s, e in states]


def test_sync_load_is_remote_read_inside_the_step_and_waits_are_sync(tmp_path: Path) -> None:
    spools = _write(tmp_path, [
        ["new", "a-12345678", _t(1), _wall(0), 100],
        ["lookup", "a-12345678", _t(3), _t(4), 32, 64, 0],
        ["alloc", "a-12345678", _t(4.5), 64],
        ["sched", 1, _t(5), [["a-12345678", 100, 1]]],
        ["load", 1, _t(6), _t(16), 1],
        ["wait", 1, 0, _t(17), _t(18)],
        ["fwd", 1, _t(5.5), _t(20)],
        ["out", 1, _t(21)],
        ["fin", "a-12345678", _t(30), 4, "d"],
    ], [["vstats", "a", 0, {"queued_time": 0.004, "prefill_time": 0.017,
                             "num_cached_tokens": 96}]])
    rec = Recorder(nvtx=False, anchor=spools[0].anchor)
    res = build(spools, rec)
    assert res.requests == 1 and res.identity_violations == 0 and res.cached_mismatches == 0
    assert res.vllm_stats == 1 and res.unmatched_stats == 0
    st = _states(rec)["a"]
    assert _durations(st) == [("queue", 3.0), ("lookup", 1.0), ("prefill", 2.0),
                              ("remote_read", 10.0), ("prefill", 1.0), ("sync", 1.0),
                              ("prefill", 3.0), ("decode", 9.0)]
    assert all(a[2] == b[1] for a, b in itertools.pairwise(st))  # no gap, no overlap
    rec2 = Recorder(nvtx=False, anchor=spools[0].anchor)
    build(spools, rec2)
    layers = rec2.drain()["layers"].to_pylist()
    assert [(r["layer"], r["wait_ns"]) for r in layers] == [(0, 1 * MS), (1, 0)]
    assert {(r["hit_tokens"], r["loaded_tokens"], r["recomputed_tokens"]) for r in layers} == {
        (32, 64, 4)}


def test_async_load_is_remote_read_then_queue_until_scheduled(tmp_path: Path) -> None:
    spools = _write(tmp_path, [
        ["new", "b-abcdefgh", _t(0), _wall(0), 65],
        ["lookup", "b-abcdefgh", _t(1), _t(2), 0, 64, 1],
        ["alloc", "b-abcdefgh", _t(2), 64],
        ["load", 1, _t(3), _t(4), 0],  # submitted after the forward: nothing waits on it here
        ["recv", "b-abcdefgh", _t(50), 0],
        ["sched", 2, _t(60), [["b-abcdefgh", 1, 1]]],
        ["out", 2, _t(70)],
        ["fin", "b-abcdefgh", _t(71), 1, "d"],
    ])
    rec = Recorder(nvtx=False, anchor=spools[0].anchor)
    build(spools, rec)
    assert _durations(_states(rec)["b"]) == [("queue", 1.0), ("lookup", 1.0),
                                            ("remote_read", 48.0),
                                            ("queue", 10.0), ("prefill", 10.0),
                                            ("decode", 1.0)]
    req = rec.drain()
    assert "requests" not in req  # drained once already: rows come out exactly once


def test_accounting_failed_receive_is_recomputed_and_deferred_lookup_is_queue(
        tmp_path: Path) -> None:
    spools = _write(tmp_path, [
        ["new", "c-00000000", _t(0), _wall(0), 70],
        ["lookup", "c-00000000", _t(1), _t(2), 0, -1, 0],   # not decided yet
        ["lookup", "c-00000000", _t(5), _t(6), 0, 64, 1],
        ["alloc", "c-00000000", _t(6), 64],
        ["recv", "c-00000000", _t(9), 1],                    # the receive failed
        ["sched", 1, _t(10), [["c-00000000", 70, 1]]],
        ["out", 1, _t(12)],
        ["fin", "c-00000000", _t(12), 1, "d"],
    ])
    rec = Recorder(nvtx=False, anchor=spools[0].anchor)
    build(spools, rec)
    assert _durations(_states(rec)["c"]) == [("queue", 1.0), ("lookup", 1.0), ("queue", 3.0),
                                            ("lookup", 1.0), ("remote_read", 3.0),
                                            ("queue", 1.0), ("prefill", 2.0), ("decode", 0.0)]
    # accounting: promised 64, failed 64, so everything is recomputed
    rec2 = Recorder(nvtx=False, anchor=spools[0].anchor)
    build(spools, rec2)
    reqs = rec2.drain()["requests"].to_pylist()[0]
    assert reqs["remote_hit_tokens"] == 64 and reqs["remote_loaded_tokens"] == 0
    assert reqs["load_failed_error_tokens"] == 64 and reqs["recomputed_tokens"] == 70
    assert reqs["lookup_tokens"] == 64


def test_spool_reader_skips_a_torn_line_and_needs_a_scheduler(tmp_path: Path) -> None:
    f = SpoolWriter(tmp_path, "frontend")
    f.add(["vstats", "x", 0, {}])
    f.close()
    with open(f.path, "a") as fh:
        fh.write('["vstats", "y"')  # killed mid-write
    spools = read_spools(tmp_path)
    assert spools[0].bad_lines == 1 and len(spools[0].records) == 1
    with pytest.raises(ValueError, match="no scheduler spool"):
        build(spools, Recorder(nvtx=False))
    (tmp_path / "spool" / "junk.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"junk\.jsonl: first line is not"):
        read_spools(tmp_path)
