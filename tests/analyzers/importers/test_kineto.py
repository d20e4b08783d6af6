from __future__ import annotations

import numpy as np
import pyarrow as pa

from agent.telemetry.partition import check_partition
from analyzers.importers import detect, load
from analyzers.importers.base import us_to_ns
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
    assert "20000 ns of overlap resolved, 0 ns uncovered" in run.derived[0]
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
    assert s["memcpy"]["HtoD"] == {"count": 1, "bytes": 8192, "total_ns": 20_000}
    assert s["memcpy"]["DtoH"] == {"count": 1, "bytes": 64, "total_ns": 2_000}
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
