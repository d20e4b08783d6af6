"""Fixture files written from the documented formats (REFERENCE.md), with known values.

Each builder writes one small file under a test's tmp_path and returns its path; the tests assert
exact values derived from the numbers here.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
from pathlib import Path
from typing import Any

M = 'model_name="m"'


def vllm_v1_prom(tmp: Path) -> Path:
    """A vLLM v1 scrape: TTFT, queue and prefill histograms over the same 4 requests."""
    text = f"""\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{{M}}} 8191.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{{M}}} 6144.0
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{{{M}}} 2047.0
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{{{M}}} 1024.0
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{{{M},source="local_compute"}} 1000.0
vllm:prompt_tokens_by_source_total{{{M},source="local_cache_hit"}} 3000.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{M}}} 0.25
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="0.1",{M}}} 1.0
vllm:time_to_first_token_seconds_bucket{{le="0.5",{M}}} 3.0
vllm:time_to_first_token_seconds_bucket{{le="1.0",{M}}} 4.0
vllm:time_to_first_token_seconds_bucket{{le="+Inf",{M}}} 4.0
vllm:time_to_first_token_seconds_count{{{M}}} 4.0
vllm:time_to_first_token_seconds_sum{{{M}}} 1.6
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{le="0.1",{M}}} 2.0
vllm:request_queue_time_seconds_bucket{{le="0.5",{M}}} 4.0
vllm:request_queue_time_seconds_bucket{{le="+Inf",{M}}} 4.0
vllm:request_queue_time_seconds_count{{{M}}} 4.0
vllm:request_queue_time_seconds_sum{{{M}}} 0.4
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{{le="0.1",{M}}} 0.0
vllm:request_prefill_time_seconds_bucket{{le="0.5",{M}}} 4.0
vllm:request_prefill_time_seconds_bucket{{le="+Inf",{M}}} 4.0
vllm:request_prefill_time_seconds_count{{{M}}} 4.0
vllm:request_prefill_time_seconds_sum{{{M}}} 1.0
"""
    p = tmp / "vllm_v1.txt"  # no .prom extension: detection goes by content
    p.write_text(text)
    return p


def _attr(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        return {"key": key, "value": {"stringValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}  # proto3 JSON: int64 as string
    return {"key": key, "value": {"doubleValue": value}}


T0 = 1_700_000_000_000_000_000


def llm_request(rid: str, start_ns: int, ttft: float, queue: float | None, prefill: float | None,
                e2e_ns: int, prompt: int = 100, completion: int = 10) -> dict[str, Any]:
    """One vLLM `llm_request` span in OTLP/JSON form."""
    attrs = [_attr("gen_ai.request.id", rid), _attr("gen_ai.latency.time_to_first_token", ttft),
             _attr("gen_ai.latency.e2e", e2e_ns / 1e9),
             _attr("gen_ai.usage.prompt_tokens", prompt),
             _attr("gen_ai.usage.completion_tokens", completion)]
    if queue is not None:
        attrs.append(_attr("gen_ai.latency.time_in_queue", queue))
    if prefill is not None:
        attrs.append(_attr("gen_ai.latency.time_in_model_prefill", prefill))
    return {"traceId": "0" * 32, "spanId": rid.encode().hex()[:16].ljust(16, "0"),
            "name": "llm_request", "kind": 2, "startTimeUnixNano": str(start_ns),
            "endTimeUnixNano": str(start_ns + e2e_ns), "attributes": attrs}


def vllm_otlp(tmp: Path, spans: list[dict[str, Any]], gz: bool = False) -> Path:
    doc = {"resourceSpans": [{"resource": {"attributes": [_attr("service.name", "vllm")]},
                              "scopeSpans": [{"scope": {"name": "vllm.llm_engine"},
                                              "spans": spans}]}]}
    data = json.dumps(doc).encode()
    p = tmp / ("spans.otlp.gz" if gz else "spans.otlp")
    p.write_bytes(gzip.compress(data) if gz else data)
    return p


def kineto_trace(tmp: Path, events: list[dict[str, Any]], base_ns: int | None = None,
                 gz: bool = True, name: str = "trace") -> Path:
    doc: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": [],
                           "distributedInfo": {"rank": 0}, "traceEvents": events}
    if base_ns is not None:
        doc["baseTimeNanoseconds"] = base_ns
    data = json.dumps(doc).encode()
    p = tmp / (f"{name}.pt.trace.json.gz" if gz else f"{name}.pt.trace.json")
    p.write_bytes(gzip.compress(data) if gz else data)
    return p


def ann(name: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    """A CPU user_annotation (record_function) event; ts/dur in µs."""
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": ts,
            "dur": dur, "args": {"External id": 1, **args}}


def nsys_db(tmp: Path, *, with_session: bool = True, text_ids: bool = True,
            memcpy_bytes_col: bool = True) -> Path:
    """A minimal nsys export: kvscope NVTX start/end ranges with payloads, push/pop phases,
    one HtoD and one DtoH copy, a kernel. Times are ns since session start."""
    p = tmp / "profile.sqlite"
    con = sqlite3.connect(p)
    con.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
            rangeId INTEGER, text TEXT, globalTid INTEGER, textId INTEGER, domainId INTEGER,
            int64Value INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER);
    """)
    cols = "start, end, copyKind, correlationId" + (", bytes" if memcpy_bytes_col else "")
    con.execute(f"CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY ({cols})")
    if with_session:
        con.execute("CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, "
                    "utcTime TEXT, localTime TEXT)")
        con.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, '', '')", (T0,))
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(1, "queue"), (2, "prefill")])
    rows = [
        (0, None, 75, None, "kvscope", None, None, 7, None),  # domain create
        (0, None, 75, None, "other.lib", None, None, 8, None),
        # request 5: lookup [100,150), queue [150,400), prefill [400,1000), decode [1000,1500)
        (100, 150, 60, 1, "lookup", 1, None, 7, 5),
        (150, 400, 60, 2, None if text_ids else "queue", 1, 1 if text_ids else None, 7, 5),
        (400, 1000, 60, 3, None if text_ids else "prefill", 1, 2 if text_ids else None, 7, 5),
        (1000, 1500, 60, 4, "decode", 1, None, 7, 5),
        # request 6: queue [200,600), nothing in [600,680) → other, sync [680,720) overlapping
        # prefill [700,900), which wins by STAGE_PRIORITY
        (200, 600, 60, 5, "queue", 1, None, 7, 6),
        (700, 900, 60, 6, "prefill", 1, None, 7, 6),
        (680, 720, 60, 7, "sync", 1, None, 7, 6),
        # a step phase (push/pop, payload = step id) and a foreign-domain range named "queue"
        (400, 900, 59, None, "forward", 1, None, 7, 3),
        (0, 50, 59, None, "queue", 1, None, 8, None),
    ]
    con.executemany("INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,?,?,?,?)", rows)
    copies = [(300, 380, 1, 11, 4096), (950, 990, 2, 12, 64)]
    if not memcpy_bytes_col:
        copies = [c[:4] for c in copies]
    con.executemany(f"INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES "
                    f"({','.join('?' * len(copies[0]))})", copies)
    con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (410, 890, 0)")
    con.commit()
    con.close()
    return p
