from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from agent.telemetry.partition import check_partition
from analyzers.importers import detect, load
from analyzers.importers.base import us_to_ns
from analyzers.importers.kineto import load_kineto, split_name
from tests.analyzers.importers.fixtures import T0, ann, kineto_trace
from tests.conftest import shared_data

US = 1000


def _events(**req) -> list[dict]:
    return [
        ann("kvscope.lookup", 0, 10, **req),
        ann("kvscope.queue", 10, 40, **req),
        ann("kvscope.h2d", 30, 30, **req),  # overlaps queue: h2d wins (DESIGN priority)
        ann("kvscope.prefill", 60, 40, **req),
        ann("kvscope.decode", 100, 50, **req),
        ann("kvscope.forward", 60, 40),  # a step phase
        ann("ProfilerStep#1", 0, 200),  # not ours
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0,
         "tid": 7, "ts": 35.5, "dur": 20, "args": {"bytes": 8192, "correlation": 99}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "pid": 0,
         "tid": 7, "ts": 120, "dur": 2, "args": {"bytes": 64, "correlation": 100}},
        {"ph": "X", "cat": "kernel", "name": "k1", "pid": 0, "tid": 7, "ts": 61, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": 70, "dur": 7},
        {"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": 0, "tid": 7, "ts": 58,
         "dur": 3},
        {"ph": "s", "cat": "ac2g", "id": 1, "pid": 1, "tid": 1, "ts": 60},
        {"ph": "f", "cat": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 61},
        {"ph": "f", "cat": "ac2g", "id": 2, "pid": 0, "tid": 7, "ts": 70},
        {"ph": "M", "name": "process_name", "pid": "Spans", "tid": "", "args": {"name": "x"}},
    ]


def test_annotations_become_a_partition_with_request_from_args(tmp_path):
    p = kineto_trace(tmp_path, _events(request_num=7), base_ns=T0)
    assert detect(p) == "kineto"
    run = load(p)
    assert run.source == "kineto" and run.partition_derived
    (req,) = run.requests.itertuples()
    assert (req.request_id, req.request_num) == ("7", 7)
    assert (req.arrival_ns, req.first_token_ns, req.finish_ns) == (T0, T0 + 100 * US,
                                                                   T0 + 150 * US)
    st = run.spans[run.spans["kind"] == "state"]
    got = [(n, int(a) - T0, int(b) - T0) for n, a, b in
           zip(st["name"], st["start_ns"], st["end_ns"], strict=True)]
    assert got == [("lookup", 0, 10 * US), ("queue", 10 * US, 30 * US), ("h2d", 30 * US, 60 * US),
                   ("prefill", 60 * US, 100 * US), ("decode", 100 * US, 150 * US)]
    assert "20.0 µs of overlap resolved, 0 ns uncovered" in run.derived[0]
    cols = ["request_id", "kind", "name", "start_ns", "end_ns"]
    assert check_partition(pa.Table.from_pandas(st[cols]), pa.Table.from_pandas(
        run.requests[["request_id", "arrival_ns", "first_token_ns"]])) == []
    step = run.spans[run.spans["kind"] == "step"]
    assert list(step["name"]) == ["forward"]


def test_h2d_copies_and_summary(tmp_path):
    run = load(kineto_trace(tmp_path, _events(request_num=7), base_ns=T0, gz=False))
    h2d = run.spans[run.spans["name"] == "h2d"]
    h2d = h2d[h2d["kind"] == "activity"]
    assert len(h2d) == 1
    row = h2d.iloc[0]
    assert (row["start_ns"] - T0, row["end_ns"] - T0) == (35_500, 55_500)
    assert (row["bytes"], row["transfer_id"], row["tier"]) == (8192, 99, "host")
    s = run.summary
    assert s["kernels"] == {"count": 2, "total_ns": 12_000}
    assert s["cuda_sync"] == {"count": 1, "total_ns": 3_000}
    assert s["memcpy"]["HtoD"] == {"count": 1, "bytes": 8192, "with_bytes": 1,
                                   "without_bytes": 0, "total_ns": 20_000}
    assert s["memcpy"]["DtoH"] == {"count": 1, "bytes": 64, "with_bytes": 1,
                                   "without_bytes": 0, "total_ns": 2_000}
    assert s["flows"] == {"starts": 1, "finishes": 2, "finishes_without_start": 1}


def test_without_request_args_one_synthetic_request(tmp_path):
    # no baseTimeNanoseconds: ts are epoch µs already
    events = [ann("kvscope.queue", 1.7e15, 10), ann("kvscope.prefill", 1.7e15 + 15, 5)]
    run = load(kineto_trace(tmp_path, events))
    assert list(run.requests["request_id"]) == ["kineto-0"]
    st = run.spans[run.spans["kind"] == "state"]
    assert list(st["name"]) == ["queue", "other", "prefill"]  # the gap is explicit `other`
    assert int(st["start_ns"].iloc[0]) == 1_700_000_000_000_000_000
    assert any("synthetic request" in c for c in run.cannot)


def test_us_to_ns_keeps_nanoseconds_at_epoch_scale():
    ts = np.array([1695835572943613.25, 12.5])
    assert us_to_ns(ts).tolist() == [1695835572943613250, 12500]
    assert int(ts[0] * 1000) != 1695835572943613250  # the naive conversion loses them


def test_shared_kineto_sampled_rank0():
    run = load(shared_data("kineto/sampled_rank-0.json.gz"))
    s = run.summary
    assert s["events"] == 4855 and s["kernels"]["count"] == 1154
    assert s["memcpy"]["HtoD"]["count"] == 24 and s["memcpy"]["DtoH"]["count"] == 8
    h2d = run.spans[run.spans["name"] == "h2d"]
    assert len(h2d) == 24 and int(h2d["bytes"].sum()) == s["memcpy"]["HtoD"]["bytes"]
    assert len(run.requests) == 0
    assert any("no `kvscope.<stage>` user annotations" in c for c in run.cannot)


def test_shared_kineto_alexnet_flows_and_syncs():
    run = load(shared_data("kineto/benchmark_result_2869224_1695835535_trace.json.gz"))
    s = run.summary
    assert s["events"] == 1408 and s["kernels"]["count"] == 79
    assert s["memcpy"]["HtoD"]["count"] == 16 and s["cuda_sync"]["count"] == 41
    assert s["flows"]["starts"] == 155 and s["flows"]["finishes"] == 345
    assert s["flows"]["finishes_without_start"] > 0
    first = run.spans.iloc[0]
    assert (first["start_ns"], first["bytes"]) == (1695835572943613000, 92928)


def test_stdlib_json_fallback_gives_the_same_import(tmp_path, monkeypatch):
    import analyzers.importers.base as base

    p = kineto_trace(tmp_path, _events(request_num=7), base_ns=T0)
    fast = load(p)
    monkeypatch.setattr(base, "_orjson", None)  # as in an environment without orjson
    slow = load(p)
    assert fast.spans.equals(slow.spans) and fast.summary == slow.summary


def _two_requests() -> list[dict]:
    """Two requests' ranges named `kvscope.<stage>#<request_num>`, interleaved in time."""
    return [
        ann("kvscope.lookup#3", 0, 10), ann("kvscope.queue#3", 10, 20),
        ann("kvscope.lookup#4", 5, 5), ann("kvscope.queue#4", 10, 40),
        ann("kvscope.prefill#3", 30, 30), ann("kvscope.decode#3", 60, 10),
        ann("kvscope.prefill#4", 50, 20),
        ann("kvscope.schedule#1", 29, 1), ann("kvscope.forward#1", 30, 28),
        ann("kvscope.forward#2", 58, 10),
    ]


def _state_rows(run) -> list[tuple[str, int, str, int, int]]:
    st = run.spans[run.spans["kind"] == "state"].sort_values(["request_num", "start_ns"])
    return [(r, int(n), s, (int(a) - T0) // US, (int(b) - T0) // US) for r, n, s, a, b in zip(
        st["request_id"], st["request_num"], st["name"], st["start_ns"], st["end_ns"],
        strict=True)]


def test_range_name_suffix_splits_requests_and_steps(tmp_path):
    run = load(kineto_trace(tmp_path, _two_requests(), base_ns=T0))
    assert _state_rows(run) == [
        ("3", 3, "lookup", 0, 10), ("3", 3, "queue", 10, 30), ("3", 3, "prefill", 30, 60),
        ("3", 3, "decode", 60, 70),
        ("4", 4, "lookup", 5, 10), ("4", 4, "queue", 10, 50), ("4", 4, "prefill", 50, 70)]
    req = run.requests.sort_values("request_num")
    assert req[["request_id", "request_num"]].values.tolist() == [["3", 3], ["4", 4]]
    assert [(int(a) - T0) // US for a in req["arrival_ns"]] == [0, 5]
    assert [(int(f) - T0) // US for f in req["first_token_ns"]] == [60, 70]
    step = run.spans[run.spans["kind"] == "step"]
    assert step[["name", "step_id"]].values.tolist() == [["schedule", 1], ["forward", 1],
                                                         ["forward", 2]]
    assert not any("synthetic" in c for c in run.cannot)


def test_split_name_forms():
    assert split_name("kvscope.queue#12") == ("queue", 12)
    assert split_name("kvscope.queue") == ("queue", None)
    assert split_name("kvscope.queue#") == ("queue#", None)  # no integer: not a payload
    assert split_name("kvscope.queue#x") == ("queue#x", None)


def test_suffix_wins_over_args_and_bare_names_keep_args(tmp_path):
    events = [ann("kvscope.queue#5", 0, 10, request_num=9), ann("kvscope.prefill#5", 10, 5),
              ann("kvscope.queue", 0, 4, request_num=9), ann("kvscope.prefill", 4, 4,
                                                             request_num=9)]
    run = load(kineto_trace(tmp_path, events, base_ns=T0))
    assert sorted(run.requests["request_id"]) == ["5", "9"]


def test_run_directory_maps_request_num_to_request_id(tmp_path):
    from agent.clock import ClockAnchor
    from agent.runstore import RunStoreWriter
    from agent.telemetry import Recorder, RequestAccounting

    rec = Recorder(anchor=ClockAnchor(wall_ns=0, mono_ns=0), nvtx=False)
    for i in range(5):  # request_num 0..4, ids in the engine's format
        rn = rec.request_begin(f"docqa-{i:05d}", 10)
        rec.request_end(rn, RequestAccounting(), t=20)
    run_dir = tmp_path / "run"
    w = RunStoreWriter(run_dir, config={})
    w.write_all(rec.drain())
    w.close()
    (run_dir / "profile").mkdir()
    run = load(kineto_trace(run_dir / "profile", _two_requests(), base_ns=T0))
    assert sorted(run.requests[["request_id", "request_num"]].values.tolist()) == [
        ["docqa-00003", 3], ["docqa-00004", 4]]
    assert {r[0] for r in _state_rows(run)} == {"docqa-00003", "docqa-00004"}
    assert any("from the run store" in d for d in run.derived)
    # a request_num the store lacks keeps its number as the id
    run = load(kineto_trace(run_dir / "profile", [*_two_requests(),
                                                  ann("kvscope.queue#8", 0, 3)], base_ns=T0,
                            name="more"))
    assert "8" in set(run.requests["request_id"])


def test_unreadable_run_json_falls_back_to_numbers(tmp_path):
    (tmp_path / "run.json").write_text("{not json")
    run = load(kineto_trace(tmp_path, _two_requests(), base_ns=T0))
    assert sorted(run.requests["request_id"]) == ["3", "4"]


def test_the_importer_and_the_timeline_read_the_json_array_form_alike(tmp_path: Path) -> None:
    """Chrome's JSON Array Format (a bare list of events) is a trace too, for both users of
    the one reader."""
    from dashboard.timeline.kineto import load_kineto as timeline_events

    events = [{"ph": "X", "cat": "user_annotation", "name": "kvscope.prefill#0",
               "ts": 1_700_000_000_000_000.0, "dur": 50.0, "pid": 1, "tid": 1},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1_700_000_000_000_010.0,
               "dur": 5.0, "pid": 0, "tid": 7}]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(events))
    run = load_kineto(path)
    assert run.summary["kernels"]["count"] == 1 and run.summary["events"] == 2
    assert timeline_events(path) == (events, 0)
