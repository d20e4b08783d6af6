from __future__ import annotations

import pyarrow as pa

from agent.telemetry.partition import check_partition
from analyzers.importers import detect, load
from tests.analyzers.importers.fixtures import T0, llm_request, vllm_otlp
from tests.conftest import shared_data

S = 1_000_000_000


def _state(run, rid: str) -> list[tuple[str, int, int]]:
    s = run.spans[(run.spans["request_id"] == rid) & (run.spans["kind"] == "state")]
    return [(n, int(a) - T0, int(b) - T0) for n, a, b in
            zip(s["name"], s["start_ns"], s["end_ns"], strict=True)]


def _fixture(tmp_path, gz=False):
    r2 = llm_request("r2", T0, ttft=0.2, queue=None, prefill=0.15, e2e_ns=S // 2)
    r2["status"] = {"code": 2}
    other = {"name": "http_request", "startTimeUnixNano": str(T0), "endTimeUnixNano": str(T0)}
    return vllm_otlp(tmp_path, [
        llm_request("r1", T0, ttft=0.5, queue=0.1, prefill=0.3, e2e_ns=S, prompt=4096),
        r2,
        llm_request("r3", T0, ttft=0.1, queue=0.08, prefill=0.05, e2e_ns=S // 10),
        other,
    ], gz=gz)


def test_llm_request_spans_partition_ttft(tmp_path):
    p = _fixture(tmp_path)
    assert detect(p) == "otlp"
    run = load(p)
    assert run.source == "vllm-otlp" and run.partition_derived
    assert list(run.requests["request_id"]) == ["r1", "r2", "r3"]
    r1 = run.requests.iloc[0]
    assert (r1["arrival_ns"], r1["first_token_ns"], r1["finish_ns"]) == (T0, T0 + S // 2, T0 + S)
    assert r1["prompt_tokens"] == 4096 and r1["output_tokens"] == 10
    assert list(run.requests["status"]) == ["ok", "error", "ok"]
    assert _state(run, "r1") == [("other", 0, S // 10), ("queue", S // 10, 2 * S // 10),
                                 ("prefill", 2 * S // 10, S // 2), ("decode", S // 2, S)]
    # no time_in_queue: that time is in `other`, and we say so
    assert _state(run, "r2") == [("other", 0, S // 20), ("prefill", S // 20, S // 5),
                                 ("decode", S // 5, S // 2)]
    assert any("lack gen_ai.latency.time_in_queue" in c for c in run.cannot)
    # queue + prefill > TTFT by 30 ms: prefill kept, queue trimmed, no negative `other`
    assert _state(run, "r3") == [("queue", 0, S // 20), ("prefill", S // 20, S // 10)]
    assert any("queue trimmed" in d and "30.0 ms" in d for d in run.derived)
    cols = ["request_id", "kind", "name", "start_ns", "end_ns"]
    assert check_partition(pa.Table.from_pandas(run.spans[cols]),
                           pa.Table.from_pandas(run.requests[["request_id", "arrival_ns",
                                                              "first_token_ns"]])) == []


def test_accounting_is_unknown_not_zero(tmp_path):
    run = load(_fixture(tmp_path))
    assert run.requests["device_hit_tokens"].isna().all()
    assert str(run.requests["device_hit_tokens"].dtype) == "Int64"
    assert any("accounting columns left <NA>" in c for c in run.cannot)


def test_gzipped_otlp(tmp_path):
    run = load(_fixture(tmp_path, gz=True))
    assert len(run.requests) == 3


def test_shared_otlp_example_has_no_llm_request_spans():
    run = load(shared_data("otlp/trace.json"))
    assert run.source == "vllm-otlp"
    assert len(run.requests) == 0 and len(run.spans) == 0
    assert run.cannot == ["no llm_request spans: not a vLLM trace (1 span(s): I'm a server "
                          "span); nothing to partition"]
