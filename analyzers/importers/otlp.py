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
    TIME_NS_MAX,
    ImportedRun,
    concat_spans,
    count_field,
    field_error,
    int_field,
    is_number,
    number_field,
    parse_json,
    read_bytes,
    requests_frame,
    shown,
    spans_frame,
)
from analyzers.units import fmt_ns

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


#: arrays inside arrays deeper than this are not a vLLM attribute (and would recurse)
_MAX_DEPTH = 32
_HEX = frozenset("0123456789abcdefABCDEF")


def attr_value(v: Any, path: Path | str = "?", record: str = "?", name: str = "value",
               depth: int = 0) -> Any:
    """An OTLP/JSON AnyValue → Python (intValue arrives as a string per the proto3 JSON map).

    Raises:
        InputError: ``<file>: <record>: <name>: ...`` for a value that is not an AnyValue
            object, an intValue/doubleValue that is not a number, or arrays nested deeper
            than 32.
    """
    if not isinstance(v, dict):
        raise field_error(path, record, name, f"expected an AnyValue object, got {shown(v)}")
    if "stringValue" in v:
        x = v["stringValue"]
        if not isinstance(x, str):
            raise field_error(path, record, f"{name}.stringValue",
                              f"expected a string, got {shown(x)}")
        return x
    if "intValue" in v:
        return int_field(v["intValue"], path, record, f"{name}.intValue", strings=True)
    if "doubleValue" in v:
        x = v["doubleValue"]
        if isinstance(x, str) and x in ("NaN", "Infinity", "-Infinity"):  # proto3 JSON
            return float(x.replace("Infinity", "inf"))
        if not is_number(x):
            raise field_error(path, record, f"{name}.doubleValue",
                              f"expected a number, got {shown(x)}")
        return float(x)
    if "boolValue" in v:
        x = v["boolValue"]
        if not isinstance(x, bool):
            raise field_error(path, record, f"{name}.boolValue",
                              f"expected true or false, got {shown(x)}")
        return x
    if "arrayValue" in v:
        arr = v["arrayValue"]
        vals = arr.get("values", []) if isinstance(arr, dict) else arr
        if not isinstance(vals, list):
            raise field_error(path, record, f"{name}.arrayValue",
                              f"expected an object with a values list, got {shown(arr)}")
        if depth >= _MAX_DEPTH:
            raise field_error(path, record, f"{name}.arrayValue",
                              f"arrays nested deeper than {_MAX_DEPTH}")
        return [attr_value(x, path, record, f"{name}.arrayValue.values[{i}]", depth + 1)
                for i, x in enumerate(vals)]
    return None


def _list(v: Any, path: Path, record: str, name: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise field_error(path, record, name, f"expected a list, got {shown(v)}")
    return v


def _located_spans(doc: Any, path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, span) for every span, where = ``resourceSpans[i].scopeSpans[j].spans[k]``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
        raise InputError(f"{path}: not an OTLP/JSON trace (no resourceSpans list)")
    out = []
    for i, rs in enumerate(doc["resourceSpans"]):
        at = f"resourceSpans[{i}]"
        if not isinstance(rs, dict):
            raise field_error(path, at, "resourceSpans", f"expected an object, got {shown(rs)}")
        key = "scopeSpans" if rs.get("scopeSpans") is not None else "instrumentationLibrarySpans"
        for j, ss in enumerate(_list(rs.get(key), path, at, key)):
            at2 = f"{at}.{key}[{j}]"
            if not isinstance(ss, dict):
                raise field_error(path, at2, key, f"expected an object, got {shown(ss)}")
            for k, sp in enumerate(_list(ss.get("spans"), path, at2, "spans")):
                if not isinstance(sp, dict):
                    raise field_error(path, f"{at2}.spans[{k}]", "span",
                                      f"expected an object, got {shown(sp)}")
                out.append((f"{at2}.spans[{k}]", sp))
    return out


def iter_spans(doc: Any, path: Path) -> list[dict[str, Any]]:
    """Every span of an OTLP/JSON trace document. Not OTLP, or a resource/scope/span that is
    not an object → InputError."""
    return [sp for _, sp in _located_spans(doc, path)]


def _hex_id(sp: dict[str, Any], key: str, size: int, path: Path, where: str) -> str | None:
    v = sp.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str) or len(v) != size or not set(v) <= _HEX:
        raise field_error(path, where, key, f"expected {size} hex digits, got {shown(v)}")
    return v


def load_otlp(path: Path) -> ImportedRun:
    """Import vLLM `llm_request` spans from an OTLP/JSON file.

    Args:
        path: an OTLP/JSON export (`{"resourceSpans": [...]}`), optionally gzipped.
    Returns:
        An ImportedRun with one requests row per `llm_request` span and state spans
        other → queue → prefill summing to TTFT, then decode.
    Raises:
        InputError: unreadable, cut or non-OTLP JSON, or an `llm_request` span whose fields
            are not what OTLP/JSON and vLLM write (``<file>: <span>: <field>: ...``).
    """
    located = _located_spans(parse_json(read_bytes(path), path), path)
    rows = []
    names: set[str] = set()
    seen: dict[str, str] = {}  # request id → where its span is
    for where, sp in located:
        name = sp.get("name")
        names.add(name if isinstance(name, str) else shown(name))
        if name != SPAN_NAME:
            continue
        row = _read_span(sp, where, path)
        rid = row[1].get(A_REQUEST_ID)
        if rid is not None and rid in seen:  # vLLM emits one llm_request span per request
            raise field_error(path, where, f"attributes[{A_REQUEST_ID}]",
                              f"request {rid!r} has a second llm_request span (the first is "
                              f"{seen[rid]})")
        if rid is not None:
            seen[rid] = where
        rows.append(row)
    run = ImportedRun.empty("vllm-otlp", path)
    if not rows:
        listed = sorted(names)[:5]
        run.cannot.append(
            f"no {SPAN_NAME} spans: not a vLLM trace ({len(located)} span(s): "
            f"{', '.join(listed) or 'none'}); nothing to partition")
        return run
    _build(run, rows)
    return run


#: attributes in seconds, with the largest value taken as a duration (~31 years)
_SECONDS = (A_TTFT, A_QUEUE, A_PREFILL, A_DECODE, A_E2E)
_MAX_S = 1e9


def _read_span(sp: dict[str, Any], where: str, path: Path
               ) -> tuple[dict[str, Any], dict[str, Any], int, int]:
    """One `llm_request` span's fields, checked: (span, attributes, start ns, end ns)."""
    _hex_id(sp, "traceId", 32, path, where)
    sid = _hex_id(sp, "spanId", 16, path, where)
    where_id = f"{where} (spanId {sid})" if sid else where
    attrs: dict[str, Any] = {}
    for i, a in enumerate(_list(sp.get("attributes"), path, where_id, "attributes")):
        if not isinstance(a, dict) or not isinstance(a.get("key"), str):
            raise field_error(path, where_id, f"attributes[{i}]",
                              f"expected an object with a string key, got {shown(a)}")
        key = a["key"]
        attrs[key] = attr_value(a.get("value") or {}, path, where_id, f"attributes[{key}]")
    for key in _SECONDS:
        if attrs.get(key) is not None:
            number_field(attrs[key], path, where_id, f"attributes[{key}]", lo=0, hi=_MAX_S)
    for key in (A_PROMPT, A_COMPLETION):
        if attrs.get(key) is not None:
            count_field(attrs[key], path, where_id, f"attributes[{key}]")
    rid = attrs.get(A_REQUEST_ID)
    if rid is not None and not isinstance(rid, str):
        raise field_error(path, where_id, f"attributes[{A_REQUEST_ID}]",
                          f"expected a string, got {shown(rid)}")
    status = sp.get("status")
    if status is not None and not isinstance(status, dict):
        raise field_error(path, where_id, "status", f"expected an object, got {shown(status)}")
    bounds = []
    for key in ("startTimeUnixNano", "endTimeUnixNano"):
        if sp.get(key) is None:
            raise field_error(path, where_id, key, "missing")
        bounds.append(int_field(sp[key], path, where_id, key, lo=0, hi=TIME_NS_MAX,
                                strings=True))
    start, end = bounds
    if end < start:
        raise field_error(path, where_id, "endTimeUnixNano", f"{end} is before the start "
                          f"{start}")
    ttft = attrs.get(A_TTFT)
    if ttft is not None and start + ttft * 1e9 > TIME_NS_MAX:
        raise field_error(path, where_id, f"attributes[{A_TTFT}]",
                          "start + time to first token is beyond int64 ns")
    return sp, attrs, start, end


def _seconds_ns(attrs: list[dict[str, Any]], key: str) -> np.ndarray:
    """Attribute in seconds (checked by `_read_span`) → int64 ns; -1 where absent."""
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
    prompt = [None if a.get(A_PROMPT) is None else int(a[A_PROMPT]) for a in attrs]
    output = [None if a.get(A_COMPLETION) is None else int(a[A_COMPLETION]) for a in attrs]
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
                           f"(by up to {fmt_ns(int(excess.max()))}); queue trimmed to fit")
    for k, c in missing.items():
        run.cannot.append(f"{c} of {n} request(s) lack {k}"
                          + ("; no partition for them" if k == A_TTFT else
                             "; that time is in `other`"))
    run.can.append(f"per-request TTFT partition into other / queue / prefill for {n} request(s)")
    run.can.append("prompt and output tokens per request")
    run.cannot.append("lookup, remote_read, h2d and sync: vLLM spans hide KV loads inside "
                      "prefill")
    run.cannot.append("token sources (hits, loads, recompute): accounting columns left <NA>")
