"""The executable contract: metric catalogue rules, docs/METRICS.md, accounting columns."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from agent.schema import (
    ACCOUNTING_COLUMNS,
    LATENCY_BUCKETS_S,
    METRICS,
    METRICS_BY_NAME,
    REQUESTS_SCHEMA,
    STATE_CODE,
    STATES,
    TABLES,
    TTFT_STAGES,
    MetricSpec,
    metrics_markdown,
)
from agent.telemetry import RequestAccounting

REPO = Path(__file__).resolve().parents[2]

#: Every label the catalogue may use; each has a small, code-defined set of values. A new label
#: must be added here on purpose (and must not be an id, a prompt or anything per request).
BOUNDED_LABELS = {
    "model", "status", "stage", "source", "tier", "reason", "name", "phase", "state", "table",
    "exporter", "gpu", "kind", "xid", "device", "port", "process", "collector", "version",
    "schema_version", "python", "op", "outcome",
}
BASE_UNIT_SUFFIXES = {"seconds": "_seconds", "bytes": "_bytes", "tokens": "_tokens",
                      "ratio": "_ratio", "watts": "_watts", "joules": "_joules",
                      "celsius": "_celsius", "hertz": "_hertz",
                      "bytes_per_second": "_bytes_per_second"}


@pytest.mark.parametrize("m", METRICS, ids=[m.name for m in METRICS])
def test_every_metric_follows_the_naming_rules(m: MetricSpec) -> None:
    assert m.name.startswith("kvscope_")
    assert (m.type == "counter") == m.name.endswith("_total")
    assert set(m.labels) <= BOUNDED_LABELS, set(m.labels) - BOUNDED_LABELS
    assert len(set(m.labels)) == len(m.labels)
    assert m.help and m.help.endswith(".")
    if m.type == "info":
        assert m.name.endswith("_info")
    if m.unit:  # the base unit is named (kvscope_prompt_tokens_by_source_total: a qualifier
        # after the unit is allowed)
        base = m.name.removesuffix("_total")
        assert BASE_UNIT_SUFFIXES[m.unit] + "_" in base + "_", (m.name, m.unit)
    if m.type == "histogram":
        assert list(m.buckets) == sorted(set(m.buckets)) and m.buckets[0] > 0
        assert m.unit == "seconds"


def test_names_are_unique_and_build_info_exists() -> None:
    assert len({m.name for m in METRICS}) == len(METRICS) == len(METRICS_BY_NAME)
    assert METRICS_BY_NAME["kvscope_build_info"].type == "info"


def test_latency_buckets_cover_1ms_to_60s() -> None:
    assert LATENCY_BUCKETS_S[0] == 0.001 and LATENCY_BUCKETS_S[-1] == 60.0


@pytest.mark.parametrize("kw,msg", [
    ({"name": "vllm_x"}, "must start with kvscope_"),
    ({"name": "kvscope_x", "type": "counter"}, "counters end in _total"),
    ({"name": "kvscope_x_total", "type": "gauge"}, "only counters end in _total"),
    ({"name": "kvscope_a:b"}, "reserved for recording rules"),
    ({"type": "histogram"}, "histogram without buckets"),
    ({"labels": ("model", "request_id")}, "unbounded or private"),
    ({"labels": ("prompt",)}, "unbounded or private"),
])
def test_metric_spec_rejects_bad_entries(kw: dict, msg: str) -> None:
    base = {"name": "kvscope_x", "type": "gauge", "unit": "", "labels": (), "help": "x."}
    with pytest.raises(ValueError, match=msg):
        MetricSpec(**{**base, **kw})


def test_docs_metrics_md_is_generated_from_the_catalogue() -> None:
    doc = (REPO / "docs" / "METRICS.md").read_text()
    assert doc == metrics_markdown()
    proc = subprocess.run([sys.executable, "-m", "agent.schema", "--metrics-md"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0 and proc.stdout == doc
    for m in METRICS:
        assert f"| `{m.name}` |" in doc


def test_accounting_fields_are_the_accounting_columns() -> None:
    names = tuple(f.name for f in dataclasses.fields(RequestAccounting))
    assert names == ACCOUNTING_COLUMNS
    n = len(ACCOUNTING_COLUMNS)
    start = REQUESTS_SCHEMA.names.index("prompt_tokens")
    assert REQUESTS_SCHEMA.names[start:start + n] == list(ACCOUNTING_COLUMNS)
    acct = RequestAccounting(prompt_tokens=10, device_hit_tokens=4, host_loaded_tokens=3,
                             remote_loaded_tokens=2, recomputed_tokens=1)
    assert acct.identity_holds()
    assert acct.values() == (10, 0, 0, 4, 0, 0, 0, 0, 3, 2, 1) + (0,) * 15
    assert not RequestAccounting(prompt_tokens=1).identity_holds()


def test_state_codes_and_tables() -> None:
    assert STATES[: len(TTFT_STAGES)] == TTFT_STAGES and STATES[-1] == "decode"
    assert all(STATES[c] == s for s, c in STATE_CODE.items())
    assert set(TABLES) == {"requests", "spans", "layers", "samples", "events"}
    for schema in TABLES.values():
        for f in schema:
            if f.name.endswith("_ns"):
                assert str(f.type) == "int64", f.name
