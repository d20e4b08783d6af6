"""Deterministic trace and span ids, shared by the OpenTelemetry and Prometheus exporters.

A request's trace id is a digest of (run id, request id), so the exemplar on a TTFT bucket and
the OTLP trace of that request agree without the two exporters talking to each other, and a
trace can be found again from a run store row (`run.json` run_id + `requests.request_id`).
"""

from __future__ import annotations

import hashlib
import uuid

_PROCESS_RUN_ID: str | None = None


def default_run_id() -> str:
    """A random run id taken once per process: the default of every exporter that needs one.

    Pass the run store's `run_id` explicitly instead when there is a run store, so traces can
    be found from its rows.
    """
    global _PROCESS_RUN_ID
    if _PROCESS_RUN_ID is None:
        _PROCESS_RUN_ID = uuid.uuid4().hex[:12]
    return _PROCESS_RUN_ID


def _digest(run_id: str, request_id: str, salt: bytes) -> bytes:
    # NUL-separated so ("a", "bc") and ("ab", "c") differ; blake2b is stable across processes.
    h = hashlib.blake2b(digest_size=16, person=salt)
    h.update(run_id.encode())
    h.update(b"\0")
    h.update(request_id.encode())
    return h.digest()


def trace_id_for(request_id: str, run_id: str) -> int:
    """The 128-bit trace id of a request (never 0, which W3C reserves as invalid).

    Args:
        request_id: the request's id (the run store's `request_id`).
        run_id: the run's id (`run.json` run_id), so equal request ids of two runs differ.

    Returns:
        The trace id as an int; `format(tid, "032x")` is its hex form.
    """
    tid = int.from_bytes(_digest(run_id, request_id, b"kvscope.trace"), "big")
    return tid or 1


def span_id_for(request_id: str, run_id: str) -> int:
    """The 64-bit span id of a request's root span `kvscope.request` (never 0)."""
    sid = int.from_bytes(_digest(run_id, request_id, b"kvscope.root")[:8], "big")
    return sid or 1


def trace_id_hex(trace_id: int) -> str:
    """The W3C / OTLP text form of a trace id: 32 lowercase hex digits."""
    return format(trace_id, "032x")


def span_id_hex(span_id: int) -> str:
    """The W3C / OTLP text form of a span id: 16 lowercase hex digits."""
    return format(span_id, "016x")
