"""vLLM OpenTelemetry spans (OTLP JSON) → requests and a queue / prefill / other partition.

vLLM emits one `llm_request` span per finished request, starting at the request's arrival, with
latencies as attributes in seconds (REFERENCE.md). Stages are laid end to end from those
durations: ``other`` from arrival (frontend, tokenization, engine input queue — what vLLM does
not time), then ``queue`` (QUEUED → first SCHEDULED), then ``prefill`` ending at the first token;
the three sum to `gen_ai.latency.time_to_first_token` exactly. Decode follows until the span ends.

A file without any `llm_request` span is imported empty, with a ``cannot`` line saying so
(decision: the OTLP example in shared/data is a valid trace, just not a vLLM one, and `analyze`
can still print what was found; an unreadable file is an InputError instead).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from agent.errors import InputError
from analyzers.importers.base import (
    ImportedRun,
    concat_spans,
    parse_json,
    read_bytes,
    requests_frame,
    spans_frame,
)

SPAN_NAME = "llm_request"
A_QUEUE = "gen_ai.latency.time_in_queue"
A_TTFT = "gen_ai.latency.time_to_first_token"
A_E2E = "gen_ai.latency.e2e"
A_PREFILL = "gen_ai.latency.time_in_model_prefill"
A_DECODE = "gen_ai.latency.time_in_model_decode"
A_PROMPT = "gen_ai.usage.prompt_tokens"
A_COMPLETION = "gen_ai.usage.completion_tokens"
A_REQUEST_ID = "gen_ai.request.id"
_STATUS_ERROR = 2  # OTLP Status.code STATUS_CODE_ERROR


def attr_value(v: dict[str, Any]) -> Any:
    """An OTLP/JSON AnyValue → Python (intValue arrives as a string per the proto3 JSON map)."""
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [attr_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def iter_spans(doc: Any, path: Path) -> list[dict[str, Any]]:
    """Every span of an OTLP/JSON trace document. Not OTLP → InputError."""
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
        raise InputError(f"{path}: not an OTLP/JSON trace (no resourceSpans list)")
    out = []
    for rs in doc["resourceSpans"]:
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
            out.extend(ss.get("spans") or [])
    return out


def load_otlp(path: Path) -> ImportedRun:
    """Import vLLM `llm_request` spans from an OTLP/JSON file.

    Args:
        path: an OTLP/JSON export (`{"resourceSpans": [...]}`), optionally gzipped.
    Returns:
        An ImportedRun with one requests row per `llm_request` span and state spans
        other → queue → prefill summing to TTFT, then decode.
    Raises:
        InputError: unreadable, cut or non-OTLP JSON, or a span missing its timestamps.
    """
    spans = iter_spans(parse_json(read_bytes(path), path), path)
    rows = []
    for sp in spans:
        if sp.get("name") != SPAN_NAME:
            continue
        attrs = {a["key"]: attr_value(a.get("value") or {}) for a in sp.get("attributes") or []}
        try:
            start = int(sp["startTimeUnixNano"])
            end = int(sp["endTimeUnixNano"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: span {sp.get('spanId', '?')}: bad or missing "
                             "startTimeUnixNano/endTimeUnixNano") from None
        rows.append((sp, attrs, start, end))
    run = ImportedRun.empty("vllm-otlp", path)
    if not rows:
        names = sorted({str(s.get("name")) for s in spans})[:5]
        run.cannot.append(
            f"no {SPAN_NAME} spans: not a vLLM trace ({len(spans)} span(s): "
            f"{', '.join(names) or 'none'}); nothing to partition")
        return run
    _build(run, rows)
    return run


def _seconds_ns(attrs: list[dict[str, Any]], key: str) -> np.ndarray:
    """Attribute in seconds → int64 ns; -1 where absent."""
    vals = [a.get(key) for a in attrs]
    return np.array([-1 if v is None else round(float(v) * 1e9) for v in vals], dtype=np.int64)


def _build(run: ImportedRun, rows: list[tuple[dict[str, Any], dict[str, Any], int, int]]) -> None:
    n = len(rows)
    attrs = [r[1] for r in rows]
    arrival = np.array([r[2] for r in rows], dtype=np.int64)
    finish = np.array([r[3] for r in rows], dtype=np.int64)
    ttft = _seconds_ns(attrs, A_TTFT)
    queue = _seconds_ns(attrs, A_QUEUE)
    prefill = _seconds_ns(attrs, A_PREFILL)
    has_ttft = ttft >= 0
    first = np.where(has_ttft, arrival + ttft, -1)
    q = np.where(has_ttft, np.maximum(queue, 0), 0)
    p = np.where(has_ttft, np.maximum(prefill, 0), 0)
    # Durations are rounded separately (and vLLM's frontend and engine clocks differ slightly):
    # prefill keeps its length, queue is trimmed so the parts never exceed TTFT.
    p = np.minimum(p, np.maximum(ttft, 0))
    excess = np.maximum(q + p - np.maximum(ttft, 0), 0)
    q = q - excess
    other = np.maximum(ttft, 0) - q - p

    ids = [str(a.get(A_REQUEST_ID) or r[0].get("spanId") or f"otlp-{i}")
           for i, (r, a) in enumerate(zip(rows, attrs, strict=True))]
    status = ["error" if ((r[0].get("status") or {}).get("code") in (_STATUS_ERROR,
                                                                       "STATUS_CODE_ERROR"))
              else "ok" for r in rows]
    prompt = [a.get(A_PROMPT) for a in attrs]
    output = [a.get(A_COMPLETION) for a in attrs]
    run.requests = requests_frame({
        "request_id": ids, "request_num": np.arange(n), "arrival_ns": arrival,
        "first_token_ns": [None if f < 0 else int(f) for f in first],
        "finish_ns": finish, "status": status,
        "prompt_tokens": prompt, "output_tokens": output,
    }, n)

    t0 = arrival
    t1 = t0 + other
    t2 = t1 + q
    frames = []
    for name, s, e, ok in (("other", t0, t1, has_ttft), ("queue", t1, t2, has_ttft),
                           ("prefill", t2, first, has_ttft),
                           ("decode", first, finish, has_ttft & (finish > first))):
        m = ok & (e > s)
        idx = np.flatnonzero(m)
        frames.append(spans_frame({
            "request_id": [ids[i] for i in idx], "request_num": idx, "kind": ["state"] * len(idx),
            "name": [name] * len(idx), "start_ns": s[m], "end_ns": e[m],
            "clock": ["cpu"] * len(idx)}, len(idx)))
    spans = concat_spans(frames)
    run.spans = spans.sort_values(["request_num", "start_ns"], kind="stable",
                                  ignore_index=True)
    run.partition_derived = True
    missing = {k: int((v < 0).sum()) for k, v in
               ((A_TTFT, ttft), (A_QUEUE, queue), (A_PREFILL, prefill)) if (v < 0).any()}
    run.derived.append(
        "stages laid end to end from llm_request latency attributes: other (arrival → queued, "
        "not timed by vLLM) + queue + prefill = time_to_first_token; decode to span end")
    run.summary = {"llm_request_spans": n,
                   "other_ns_total": int(other.sum()), "queue_ns_total": int(q.sum()),
                   "prefill_ns_total": int(p.sum())}
    if excess.any():
        run.derived.append(f"{int((excess > 0).sum())} request(s) had queue + prefill > TTFT "
                           f"(by up to {int(excess.max())} ns); queue trimmed to fit")
    for k, c in missing.items():
        run.cannot.append(f"{c} of {n} request(s) lack {k}"
                          + ("; no partition for them" if k == A_TTFT else
                             "; that time is in `other`"))
    run.can.append(f"per-request TTFT partition into other / queue / prefill for {n} request(s)")
    run.can.append("prompt and output tokens per request")
    run.cannot.append("lookup, remote_read, h2d and sync: vLLM spans hide KV loads inside "
                      "prefill")
    run.cannot.append("token sources (hits, loads, recompute): accounting columns left <NA>")
