"""The Prometheus exporter: exposition lint (real promtool), exact values, catalogue names,
privacy of labels, exemplars and the HTTP endpoint."""

from __future__ import annotations

import subprocess
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import DuplicateTimeseries
from prometheus_client.samples import Timestamp

from agent.exporters.ids import span_id_for, span_id_hex, trace_id_for, trace_id_hex
from agent.exporters.prometheus import PrometheusExporter, serve_metrics
from agent.schema import LATENCY_BUCKETS_S, TTFT_STAGES, catalogued_series
from agent.telemetry import EngineStatus, PoolStatus, RemoteStatus
from tests.agent.exporters.common import (
    MODEL,
    RUN_ID,
    Expected,
    make_recorder,
    record_workload,
    split_batch,
)
from tests.conftest import require_binary

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def exporter_with_workload() -> tuple[PrometheusExporter, Expected]:
    rec = make_recorder()
    exp = record_workload(rec)
    prom = PrometheusExporter(rec, model=MODEL, run_id=RUN_ID)
    prom.export(rec.drain())
    return prom, exp


def samples(registry: CollectorRegistry) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def get(smp: Samples, metric: str, /, **labels: str) -> float:
    return smp[(metric, frozenset(labels.items()))]


def cumulative(values_ns: list[int], bounds_s: tuple[float, ...]) -> list[int]:
    return [sum(v <= round(b * 1e9) for v in values_ns) for b in bounds_s]


def test_exposition_passes_promtool_check_metrics() -> None:
    promtool = require_binary("promtool")
    prom, _ = exporter_with_workload()
    text = generate_latest(prom.registry)
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          timeout=30, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"", b"")


def test_every_exposed_name_is_catalogued_and_no_label_names_a_request() -> None:
    prom, exp = exporter_with_workload()
    smp = samples(prom.registry)
    names = {name for name, _ in smp}
    assert names <= catalogued_series()
    assert "kvscope_build_info" in names
    values = {v for _, labels in smp for _, v in labels}
    for rid in exp.states:
        assert rid not in values
    assert not {k for _, labels in smp for k, _ in labels} & {"request_id", "trace_id"}


def test_ttft_e2e_and_itl_histograms_are_exact() -> None:
    prom, exp = exporter_with_workload()
    smp = samples(prom.registry)
    ttft = list(exp.ttft_ns.values())
    assert ttft == [62 * 10**6, 38 * 10**6, 2503 * 10**6]
    for le, want in zip(LATENCY_BUCKETS_S, cumulative(ttft, LATENCY_BUCKETS_S), strict=True):
        got = get(smp, "kvscope_request_ttft_seconds_bucket", model=MODEL, le=str(le))
        assert got == want, le
    assert get(smp, "kvscope_request_ttft_seconds_count", model=MODEL) == 3
    assert get(smp, "kvscope_request_ttft_seconds_sum", model=MODEL) == sum(ttft) / 1e9
    e2e = list(exp.e2e_ns.values())
    assert get(smp, "kvscope_request_e2e_seconds_count", model=MODEL) == 4
    assert get(smp, "kvscope_request_e2e_seconds_sum", model=MODEL) == sum(e2e) / 1e9
    assert exp.itl_s == {"req-a": 0.01, "req-d": 0.03}
    assert get(smp, "kvscope_request_inter_token_latency_seconds_count", model=MODEL) == 2
    assert get(smp, "kvscope_request_inter_token_latency_seconds_sum", model=MODEL) == (
        pytest.approx(0.04, abs=1e-15))
    assert get(smp, "kvscope_request_inter_token_latency_seconds_bucket", model=MODEL,
               le="0.01") == 1


def test_stage_histogram_sums_each_requests_visits_and_adds_up_to_ttft() -> None:
    prom, exp = exporter_with_workload()
    smp = samples(prom.registry)
    per_stage: dict[str, list[int]] = defaultdict(list)
    for rid, spans in exp.states.items():
        if rid not in exp.ttft_ns:  # no first token: no TTFT to split
            continue
        visits: dict[str, int] = defaultdict(int)
        for name, start, end in spans:
            if name != "decode":
                visits[name] += end - start
        for name, ns in visits.items():
            per_stage[name].append(ns)
    assert per_stage["queue"] == [5 * 10**6, 10 * 10**6, 2 * 10**6]  # req-b queued twice
    total_ns = 0
    for stage in TTFT_STAGES:
        values = per_stage.get(stage, [])
        total_ns += sum(values)
        assert get(smp, "kvscope_request_stage_seconds_count", model=MODEL, stage=stage) == (
            len(values))
        assert get(smp, "kvscope_request_stage_seconds_sum", model=MODEL, stage=stage) == (
            sum(values) / 1e9)
        for le, want in zip(LATENCY_BUCKETS_S, cumulative(values, LATENCY_BUCKETS_S),
                            strict=True):
            assert get(smp, "kvscope_request_stage_seconds_bucket", model=MODEL, stage=stage,
                       le=str(le)) == want
    assert total_ns == sum(exp.ttft_ns.values())


def test_transfer_and_step_phase_histograms() -> None:
    prom, exp = exporter_with_workload()
    smp = samples(prom.registry)
    for (tier, name), durs in exp.transfers.items():
        lbl = {"model": MODEL, "tier": tier, "name": name}
        assert get(smp, "kvscope_kv_transfer_seconds_count", **lbl) == len(durs)
        assert get(smp, "kvscope_kv_transfer_seconds_sum", **lbl) == sum(durs) / 1e9
        assert get(smp, "kvscope_kv_transfer_seconds_bucket", **lbl, le="0.001") == sum(
            d <= 10**6 for d in durs)
    names = {dict(lbl).get("name") for n, lbl in smp if n.startswith("kvscope_kv_transfer")}
    assert "hash" not in names  # activity without a tier is no KV transfer
    for phase, durs in exp.steps.items():
        assert get(smp, "kvscope_step_phase_seconds_count", model=MODEL, phase=phase) == 2
        assert get(smp, "kvscope_step_phase_seconds_sum", model=MODEL, phase=phase) == (
            sum(durs) / 1e9)


def test_counters_from_request_rows_and_events() -> None:
    prom, exp = exporter_with_workload()
    smp = samples(prom.registry)
    acc = exp.accounting.values()

    def total(col: str) -> int:
        return sum(getattr(a, col) for a in acc)

    m = {"model": MODEL}
    assert get(smp, "kvscope_requests_total", **m, status="ok") == 2
    assert get(smp, "kvscope_requests_total", **m, status="error") == 1
    assert get(smp, "kvscope_requests_total", **m, status="aborted") == 1
    assert get(smp, "kvscope_prompt_tokens_total", **m) == total("prompt_tokens") == 5484
    assert get(smp, "kvscope_generation_tokens_total", **m) == total("output_tokens")
    assert get(smp, "kvscope_lookup_tokens_total", **m) == total("lookup_tokens")
    for src in ("device_hit", "host_loaded", "remote_loaded", "recomputed"):
        assert get(smp, "kvscope_prompt_tokens_by_source_total", **m, source=src) == total(
            f"{src}_tokens")
    assert get(smp, "kvscope_kv_hit_tokens_total", **m, tier="device") == 2304
    assert get(smp, "kvscope_kv_hit_tokens_total", **m, tier="remote") == 800
    assert get(smp, "kvscope_kv_found_tokens_total", **m, tier="host") == total(
        "host_found_tokens") == 64
    assert get(smp, "kvscope_kv_found_tokens_total", **m, tier="remote") == 0
    assert get(smp, "kvscope_kv_load_failed_tokens_total", **m, reason="timeout") == 128
    assert get(smp, "kvscope_kv_load_failed_tokens_total", **m, reason="circuit_open") == 288
    assert get(smp, "kvscope_kv_load_failed_tokens_total", **m, reason="evicted") == 0
    assert get(smp, "kvscope_preempted_tokens_total", **m) == 64
    assert get(smp, "kvscope_preemptions_total", **m) == 1
    assert get(smp, "kvscope_kv_read_bytes_total", **m, tier="remote") == 3 << 19
    assert get(smp, "kvscope_kv_written_bytes_total", **m, tier="host") == 1 << 18
    assert get(smp, "kvscope_h2d_bytes_total", **m) == 5 << 19
    for (source, name), n in exp.events.items():
        assert get(smp, "kvscope_events_total", **m, source=source, name=name) == n


def test_engine_status_becomes_the_live_series() -> None:
    rec = make_recorder()
    record_workload(rec)  # publishes running 2, waiting 1, 1 preemption, the device pool
    prom = PrometheusExporter(rec, model=MODEL)
    prom.export(rec.drain())
    smp = samples(prom.registry)
    assert get(smp, "kvscope_requests_running", model=MODEL) == 2
    assert get(smp, "kvscope_requests_waiting", model=MODEL) == 1
    for state, v in (("in_use", 100), ("cached_free", 28), ("empty", 0)):
        assert get(smp, "kvscope_block_pool_blocks", model=MODEL, tier="device",
                   state=state) == v
    # No remote tier: no remote series at all.
    assert not any(n.startswith("kvscope_remote_") for n, _ in smp)
    rec.publish(EngineStatus(
        running=0, waiting=0, preemptions=4,
        pools=(PoolStatus("device", 0, 120, 8), PoolStatus("host", 1, 30, 33)),
        remote=RemoteStatus({"lookup": "closed", "read": "open", "write": "half_open"},
                            {("read", "timeout"): 7, ("lookup", "ok"): 2})))
    smp = samples(prom.registry)
    assert get(smp, "kvscope_block_pool_blocks", model=MODEL, tier="host", state="empty") == 33
    assert [get(smp, "kvscope_remote_breaker_open", model=MODEL, op=op)
            for op in ("lookup", "read", "write")] == [0, 1, 0]
    ops = {(dict(lbl)["op"], dict(lbl)["outcome"]): v for (n, lbl), v in smp.items()
           if n == "kvscope_remote_operations_total"}
    assert len(ops) == 14 and ops[("read", "timeout")] == 7 and ops[("lookup", "ok")] == 2
    assert ops[("write", "error")] == 0 and ("write", "checksum") not in ops


def test_preemptions_are_counted_once() -> None:
    """The engine's live count replaces the rows' count; the two are never added (7
    preemptions once exported 14)."""
    rec = make_recorder()
    record_workload(rec)  # one preempted request row, and a status saying 1
    prom = PrometheusExporter(rec, model=MODEL)
    prom.export(rec.drain())
    assert get(samples(prom.registry), "kvscope_preemptions_total", model=MODEL) == 1
    rec.publish(EngineStatus(preemptions=7))
    assert get(samples(prom.registry), "kvscope_preemptions_total", model=MODEL) == 7
    # With no engine publishing (a replayed batch), the rows' count is the counter.
    bare = make_recorder()
    record_workload(bare)
    bare.status = None
    prom = PrometheusExporter(bare, model=MODEL)
    prom.export(bare.drain())
    assert get(samples(prom.registry), "kvscope_preemptions_total", model=MODEL) == 1


def test_late_decode_span_delays_nothing_but_stage_times_stay_exact() -> None:
    rec = make_recorder()
    exp = record_workload(rec)
    first, late = split_batch(rec.drain(), "req-a", "decode")
    prom = PrometheusExporter(rec, model=MODEL, run_id=RUN_ID)
    prom.export(first)
    smp = samples(prom.registry)
    assert get(smp, "kvscope_request_ttft_seconds_count", model=MODEL) == 2
    prom.export(late)
    smp = samples(prom.registry)
    assert get(smp, "kvscope_request_ttft_seconds_count", model=MODEL) == 3
    assert get(smp, "kvscope_request_stage_seconds_count", model=MODEL, stage="remote_read") == 1
    assert get(smp, "kvscope_request_ttft_seconds_sum", model=MODEL) == (
        sum(exp.ttft_ns.values()) / 1e9)


def test_openmetrics_ttft_buckets_carry_the_requests_trace_id() -> None:
    prom, exp = exporter_with_workload()
    text = generate_openmetrics(prom.registry).decode()
    exemplars = {}
    for fam in parse_openmetrics(text):
        for s in fam.samples:
            if s.name == "kvscope_request_ttft_seconds_bucket" and s.exemplar is not None:
                exemplars[s.labels["le"]] = s.exemplar
    # req-b (38 ms) is the last in the 0.05 bucket, req-a (62 ms) in 0.075, req-d in 3.0.
    assert set(exemplars) == {"0.05", "0.075", "3.0"}
    ex = exemplars["0.075"]
    assert ex.labels == {"trace_id": trace_id_hex(trace_id_for("req-a", RUN_ID)),
                         "span_id": span_id_hex(span_id_for("req-a", RUN_ID))}
    assert ex.value == 0.062
    first_ns = exp.arrival_ns["req-a"] + exp.ttft_ns["req-a"]
    assert ex.timestamp == Timestamp(*divmod(first_ns, 10**9))
    assert "# {" not in generate_latest(prom.registry).decode()  # plain text: no exemplars


def test_a_second_exporter_on_the_same_registry_is_refused() -> None:
    prom, _ = exporter_with_workload()
    with pytest.raises(DuplicateTimeseries):
        PrometheusExporter(make_recorder(), model=MODEL, registry=prom.registry)
    with pytest.raises(ValueError, match="model"):
        PrometheusExporter(make_recorder(), model="")


def test_http_endpoint_serves_plain_and_openmetrics_on_localhost() -> None:
    prom, _ = exporter_with_workload()
    server = serve_metrics(prom.registry, port=0)
    try:
        assert server.httpd.server_address[0] == "127.0.0.1"
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            plain = resp.read().decode()
        assert "kvscope_request_ttft_seconds_bucket" in plain and "trace_id" not in plain
        req = urllib.request.Request(
            server.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            om = resp.read().decode()
        want = trace_id_hex(trace_id_for("req-a", RUN_ID))
        assert f'trace_id="{want}"' in om and om.endswith("# EOF\n")
    finally:
        server.shutdown()
    server.shutdown()  # idempotent
    with pytest.raises(ValueError, match="port"):
        serve_metrics(prom.registry, port=70000)
