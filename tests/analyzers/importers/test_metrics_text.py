from __future__ import annotations

import math

import pytest

from analyzers.importers import detect, load
from tests.analyzers.importers.fixtures import vllm_v1_prom
from tests.conftest import shared_data


def _dist(run, metric: str) -> dict:
    rows = run.distributions[run.distributions["metric"] == metric]
    assert len(rows) == 1, metric
    return rows.iloc[0].to_dict()


def _ratio(run, name: str) -> dict:
    (r,) = [r for r in run.ratios if r["name"] == name]
    return r


def test_vllm_v1_distributions_and_quantiles(tmp_path):
    p = vllm_v1_prom(tmp_path)
    assert detect(p) == "prometheus"
    run = load(p)
    assert run.source == "vllm-prometheus-v1"
    assert len(run.requests) == 0 and len(run.spans) == 0
    assert not run.partition_derived
    ttft = _dist(run, "vllm:time_to_first_token_seconds")
    assert ttft["stage"] == "ttft" and ttft["count"] == 4 and ttft["sum_s"] == 1.6
    assert ttft["complete"] and ttft["mean"] == pytest.approx(0.4)
    # rank 2 in (0.1, 0.5] holding counts 1..3 → 0.1 + 0.4 * (2 - 1) / 2
    assert ttft["p50"] == pytest.approx(0.3)
    assert ttft["p90"] == pytest.approx(0.8)
    assert ttft["p99"] == pytest.approx(0.98)
    queue = _dist(run, "vllm:request_queue_time_seconds")
    assert queue["stage"] == "queue"
    assert queue["p50"] == pytest.approx(0.1)  # first bucket interpolates from 0
    assert queue["p90"] == pytest.approx(0.42)
    prefill = _dist(run, "vllm:request_prefill_time_seconds")
    assert prefill["stage"] == "prefill" and prefill["p50"] == pytest.approx(0.3)


def test_vllm_v1_aggregate_other_is_explicit(tmp_path):
    run = load(vllm_v1_prom(tmp_path))
    other = run.distributions[run.distributions["stage"] == "other"].iloc[0]
    assert other["sum_s"] == pytest.approx(1.6 - 0.4 - 1.0)
    assert other["count"] == 4
    assert math.isnan(other["p50"])  # a difference of histograms has no quantiles
    assert any("aggregate other" in d for d in run.derived)
    assert any("linear interpolation" in d for d in run.derived)


def test_vllm_v1_ratios_carry_their_denominators(tmp_path):
    run = load(vllm_v1_prom(tmp_path))
    hit = _ratio(run, "prefix_cache_hit")
    assert (hit["numerator"], hit["denominator"]) == (6144.0, 8191.0)
    assert hit["denominator_unit"].startswith("queried prompt tokens")
    assert hit["value"] == pytest.approx(6144 / 8191)
    ext = _ratio(run, "external_prefix_cache_hit")
    assert (ext["numerator"], ext["denominator"]) == (1024.0, 2047.0)
    assert "after the local hit" in ext["denominator_unit"]
    src = _ratio(run, "prompt_tokens_local_cache_hit")
    assert (src["numerator"], src["denominator"]) == (3000.0, 4000.0)
    assert run.summary["gauges_and_counters"]['vllm:kv_cache_usage_perc{model_name="m"}'] == 0.25


def test_shared_vllm_v0_truncated_histogram_is_imported_with_a_note():
    run = load(shared_data("prometheus/aibrix_runtime_vllm_metrics.prom"))
    assert run.source == "vllm-prometheus-v0"
    it = _dist(run, "vllm:iteration_tokens_total")
    assert not it["complete"]
    assert it["sum"] == 1103.0 and math.isnan(it["count"]) and math.isnan(it["p50"])
    assert "no +Inf bucket" in it["note"] and "no _count" in it["note"]
    assert "at least 998 observations" in it["note"]
    assert any("iteration_tokens_total" in c and "+Inf" in c for c in run.cannot)
    gpu = _ratio(run, "gpu_prefix_cache_hit_rate")
    assert gpu["denominator"] is None and gpu["denominator_unit"] == "unknown"
    assert gpu["value"] is None and "-1" in gpu["note"]  # caching off in this scrape
    assert any("v0 names have no queue" in c for c in run.cannot)


def test_shared_sglang_scrape():
    run = load(shared_data("prometheus/sglang_production_metrics_loaded.prom"))
    assert run.source == "sglang-prometheus"
    ttft = _dist(run, "sglang:time_to_first_token_seconds")
    assert ttft["stage"] == "ttft" and ttft["count"] == 11008.0 and ttft["complete"]
    # more than half the requests are above the last finite bound (30 s): capped there
    assert ttft["p50"] == 30.0
    rate = _ratio(run, "cache_hit_rate")
    assert rate["value"] == pytest.approx(0.007507552643049313)
    # The scrape has time_per_output_token_seconds and none of the names added in 0.4.4+:
    # written by sglang 0.3.6 .. 0.4.3, whose cache_hit_rate is cumulative since start.
    assert rate["semantics"] == "cumulative" and rate["versions"] == "0.3.6 .. 0.4.3"
    assert rate["denominator_unit"] == ("prompt tokens looked up in the radix cache since "
                                        "server start")
    assert run.summary["sglang_semantics"]["cache_hit_rate"] == "cumulative"
    assert any("read as cumulative (sglang 0.3.6 .. 0.4.3" in d for d in run.derived)
    assert any("queue time" in c for c in run.cannot)
