"""Diagnoses: each rule fires on a run built to trigger it, stays quiet on one that does not,
and says why when the run lacks what it needs."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pandas as pd
import pytest

from agent.clock import ClockAnchor
from agent.runstore.reader import to_pandas
from agent.schema import (
    LAYERS_SCHEMA,
    REQUESTS_SCHEMA,
    SAMPLES_SCHEMA,
    SPANS_SCHEMA,
    STATE_CODE,
)
from agent.telemetry import Recorder, RequestAccounting
from analyzers.costmodel import StepCost
from analyzers.diagnose import (
    RULES,
    DiagnoseConfig,
    Finding,
    NotEvaluated,
    diagnose,
    diagnose_report,
    pcie_bytes_per_s,
    render_markdown,
    render_text,
)
from analyzers.importers.base import requests_frame
from tests.analyzers.diagnose_frames import MS, T0, S, build, events, frame, samples


def one(rule: str, requests: Any, spans: Any, **kw: Any) -> Finding | NotEvaluated | None:
    """Run a single rule; its Finding, its NotEvaluated, or None when it passed."""
    rep = diagnose_report(requests, spans, rules=(rule,), **kw)
    if rep.findings:
        return rep.findings[0]
    if rep.not_evaluated:
        return rep.not_evaluated[0]
    assert rep.passed == (rule,)
    return None


def imported(n: int, ttft_ns: int) -> tuple[Any, Any]:
    """Requests as an importer gives them: timing known, every accounting column <NA>."""
    arrival = [T0 + i * 100 * MS for i in range(n)]
    req = requests_frame({"request_id": [f"i{i}" for i in range(n)], "request_num": list(range(n)),
                          "arrival_ns": arrival, "first_token_ns": [a + ttft_ns for a in arrival],
                          "status": ["ok"] * n}, n)
    spans = frame(SPANS_SCHEMA, [
        {"request_id": f"i{i}", "kind": "state", "name": name, "start_ns": a + lo,
         "end_ns": a + hi, "clock": "cpu"}
        for i, a in enumerate(arrival)
        for name, lo, hi in (("queue", 0, ttft_ns // 2), ("other", ttft_ns // 2, ttft_ns))])
    return req, spans


# --------------------------------------------------------------------------------------------
# remote_load_slower_than_recompute
# --------------------------------------------------------------------------------------------


#: Recomputing costs 100 us per token (10,000 tokens/s at the margin): the step cost model
#: these runs' rules see (they carry no step spans of their own).
COST = StepCost(fixed_ns=2e6, per_token_ns=100_000.0, fixed_ci_ns=(1.9e6, 2.1e6),
                per_token_ci_ns=(95_000.0, 105_000.0), steps=120, token_range=(16, 1000))


def _remote_run(short_read_ms: int) -> tuple[Any, Any]:
    # Recomputing costs 100 us per token (`COST`).
    # r000-r003 load 500 tokens (50 ms to recompute), r004-r009 load 4,000 (400 ms).
    stages = [{"queue": MS, "remote_read": (short_read_ms if i < 4 else 100) * MS,
               "prefill": 100 * MS} for i in range(10)]
    acct = [{"prompt_tokens": 1000 + t, "lookup_tokens": 999 + t, "remote_hit_tokens": t,
             "remote_loaded_tokens": t, "recomputed_tokens": 1000}
            for t in [500] * 4 + [4000] * 6]
    return build(stages, acct)


def test_remote_load_slower_than_recompute_fires_with_break_even() -> None:
    f = one("remote_load_slower_than_recompute", *_remote_run(80), cost=COST)
    assert isinstance(f, Finding)
    assert f.severity == "warning"
    assert f.evidence[0].startswith("4 / 10 requests that loaded remote KV (40.0 %)")
    assert f.evidence[1] == ("step cost model: 2.000 ms per step (95 % CI 1.900 .. 2.100) + "
                             "100.000 us per scheduled token (95 % CI 95.000 .. 105.000; "
                             "10,000 tokens/s), fitted on 120 steps of 16 to 1,000 tokens; "
                             "recomputing a token costs 100.0 us")
    assert f.evidence[2] == ("the 4 losing requests: 320.0 ms loading vs 200.0 ms to recompute "
                             "their 2,000 loaded tokens (120.0 ms / 1,930.0 ms of the loading "
                             "requests' TTFT (6.2 %) lost to loading)")
    assert "at >= 4,000 loaded tokens loading won in 6 / 6 requests (100.0 %)" in f.evidence
    assert f.metrics["requests_lost"] == 4 and f.metrics["requests_loading"] == 10
    assert f.metrics["per_token_ns"] == 100_000.0
    assert f.metrics["break_even_tokens"] == 4000
    assert "shorter than 4,000 tokens" in f.next_step
    assert f.requests == ("r000", "r001", "r002", "r003")


def test_remote_load_slower_than_recompute_quiet_when_loading_wins() -> None:
    assert one("remote_load_slower_than_recompute", *_remote_run(10), cost=COST) is None


def test_remote_load_slower_than_recompute_critical_when_most_lose() -> None:
    stages = [{"remote_read": 80 * MS, "prefill": 100 * MS}] * 4
    acct = {"prompt_tokens": 1500, "remote_loaded_tokens": 500, "recomputed_tokens": 1000}
    f = one("remote_load_slower_than_recompute", *build(stages, acct), cost=COST)
    assert isinstance(f, Finding) and f.severity == "critical"
    assert f.metrics["break_even_tokens"] is None
    assert "Loading lost at every prefix length" in f.next_step


def test_remote_rule_not_evaluated_without_accounting_or_loads() -> None:
    out = one("remote_load_slower_than_recompute", *imported(3, 10 * MS))
    assert out == NotEvaluated("remote_load_slower_than_recompute",
                               "no accounting in this source (remote_loaded_tokens, "
                               "host_loaded_tokens unknown)")
    out = one("remote_load_slower_than_recompute",
              *build([{"prefill": MS}], {"prompt_tokens": 10, "recomputed_tokens": 10}))
    assert isinstance(out, NotEvaluated)
    assert out.reason == "no request loaded KV from the remote tier"


# --------------------------------------------------------------------------------------------
# hit_rate_high_by_requests_low_by_tokens
# --------------------------------------------------------------------------------------------


def _hits(hit_tokens: int) -> tuple[Any, Any]:
    acct = [{"prompt_tokens": 1001, "lookup_tokens": 1000,
             "device_hit_tokens": hit_tokens if i < 8 else 0,
             "recomputed_tokens": 1001 - (hit_tokens if i < 8 else 0)} for i in range(10)]
    return build([{"prefill": 10 * MS}] * 10, acct)


def test_hit_rate_high_by_requests_low_by_tokens_fires() -> None:
    f = one("hit_rate_high_by_requests_low_by_tokens", *_hits(32))
    assert isinstance(f, Finding)
    assert f.evidence[0] == "by requests: 8 / 10 requests (80.0 %) reused some KV"
    assert f.evidence[1] == "by tokens: 256 / 10,000 lookup tokens (2.6 %) were reused"
    assert f.evidence[2] == ("a hitting request reused a median of 32 tokens of a median "
                             "1,000 lookup tokens")
    assert f.metrics["reused_tokens"] == 256 and f.metrics["lookup_tokens"] == 10_000
    assert len(f.requests) == 5


def test_hit_rate_quiet_when_hits_are_long() -> None:
    assert one("hit_rate_high_by_requests_low_by_tokens", *_hits(800)) is None


# --------------------------------------------------------------------------------------------
# queue_dominated_p99
# --------------------------------------------------------------------------------------------


def _tail(queue_ms: int, prefill_ms: int, n: int = 20, slow: int = 5) -> tuple[Any, Any]:
    stages = [{"queue": 10 * MS, "prefill": 90 * MS}] * (n - slow)
    stages += [{"queue": queue_ms * MS, "prefill": prefill_ms * MS}] * slow
    return build(stages)


def test_queue_dominated_p99_fires() -> None:
    f = one("queue_dominated_p99", *_tail(900, 100))
    assert isinstance(f, Finding) and f.severity == "critical"
    # Fifteen 100 ms TTFTs and five 1,000 ms: p99 is 1,000 ms, and the tail is the 5 slowest.
    assert f.evidence[0] == ("queue: 4,500.0 ms / 5,000.0 ms of TTFT (90.0 %) summed over the "
                             "5 / 20 requests (25.0 %) at or above 1,000.0 ms of TTFT (p99, "
                             "or the 5 slowest)")
    assert f.evidence[1] == "whole run: queue 4,650.0 ms / 6,500.0 ms of TTFT (71.5 %)"
    assert f.requests == ("r015", "r016", "r017", "r018", "r019")
    assert f.metrics["p99_ttft_ns"] == 1000 * MS


def test_queue_dominated_p99_is_not_judged_on_one_request() -> None:
    """One slow request among many normal ones: the tail of the 5 slowest is mostly
    prefill, so a single queued outlier is no finding."""
    assert one("queue_dominated_p99", *_tail(900, 100, n=40, slow=1)) is None


def test_queue_dominated_p99_quiet_when_the_tail_computes() -> None:
    assert one("queue_dominated_p99", *_tail(100, 900)) is None


def test_queue_dominated_p99_needs_enough_requests() -> None:
    out = one("queue_dominated_p99", *_tail(900, 100, n=5))
    assert out == NotEvaluated("queue_dominated_p99",
                               "5 requests with a first token; a p99 needs at least 10")


# --------------------------------------------------------------------------------------------
# sync_stalls (also through the real Recorder)
# --------------------------------------------------------------------------------------------


def test_sync_stalls_fires_with_layer_evidence() -> None:
    req, spans = build([{"h2d": 5 * MS, "sync": 20 * MS, "prefill": 75 * MS}] * 10)
    layers = frame(LAYERS_SCHEMA, [
        {"request_id": f"r{i:03d}", "layer": lay, "hit_tokens": 0, "loaded_tokens": 0,
         "recomputed_tokens": 0, "prompt_tokens": 0, "load_ns": 10 * MS,
         "wait_ns": (6 if lay == 0 else 2) * MS} for i in range(10) for lay in (0, 1)])
    f = one("sync_stalls", req, spans, layers=layers)
    assert isinstance(f, Finding) and f.severity == "warning"
    assert f.evidence[0] == "sync: 200.0 ms / 1,000.0 ms of TTFT (20.0 %) summed over 10 requests"
    assert f.evidence[1] == "10 / 10 requests (100.0 %) waited in sync"
    assert f.evidence[2].startswith("load time overlapped with queue (hidden): 0.0 ms / "
                                    "250.0 ms of load time (0.0 %)")
    assert f.evidence[3] == ("layers: wait 80.0 ms / 200.0 ms of layer load time (40.0 %) over "
                             "20 request x layer rows")
    assert f.evidence[4] == "layer 0 carries 60.0 ms / 80.0 ms of layer wait time (75.0 %)"


def test_sync_stalls_quiet_when_sync_is_small() -> None:
    assert one("sync_stalls", *build([{"sync": 5 * MS, "prefill": 95 * MS}] * 10)) is None


def _recorded_run(sync_ms: int) -> tuple[Any, Any]:
    rec = Recorder(anchor=ClockAnchor(wall_ns=T0, mono_ns=0), clock=lambda: 0, nvtx=False)
    for i in range(10):
        t = i * 200 * MS
        rn = rec.request_begin(f"q{i}", t, tenant="a", workload_class="chat")
        rec.stage(rn, STATE_CODE["queue"], t + 2 * MS)
        rec.stage(rn, STATE_CODE["sync"], t + 10 * MS)
        rec.stage(rn, STATE_CODE["prefill"], t + (10 + sync_ms) * MS)
        rec.first_token(rn, t + 100 * MS)
        rec.request_end(rn, RequestAccounting(prompt_tokens=64, output_tokens=2,
                                              recomputed_tokens=64), t=t + 120 * MS)
    tables = rec.drain()
    return (to_pandas(tables["requests"], REQUESTS_SCHEMA),
            to_pandas(tables["spans"], SPANS_SCHEMA))


def test_sync_stalls_on_recorder_frames() -> None:
    f = one("sync_stalls", *_recorded_run(30))
    assert isinstance(f, Finding) and f.severity == "critical"
    assert f.evidence[0] == ("sync: 300.0 ms / 1,000.0 ms of TTFT (30.0 %) summed over 10 "
                             "requests")
    assert one("sync_stalls", *_recorded_run(1)) is None


# --------------------------------------------------------------------------------------------
# recompute_storm
# --------------------------------------------------------------------------------------------


def _storm(fail: bool, spike: bool = True) -> tuple[Any, Any, Any]:
    # 40 requests 100 ms apart, 10 ms TTFT: eight 500 ms windows of five requests; 100
    # recomputed tokens each (1,000 tokens/s) except window 4 (r020-r024) with 2,000 each.
    acct = []
    for i in range(40):
        storm = spike and 20 <= i < 25
        failed = 1900 if storm and fail else 0
        acct.append({"prompt_tokens": 2000 if storm else 100,
                     "recomputed_tokens": 2000 if storm else 100,
                     "remote_hit_tokens": failed, "load_failed_tokens": failed,
                     "load_failed_timeout_tokens": failed})
    req, spans = build([{"prefill": 10 * MS}] * 40, acct)
    ev = events([(T0 + 2100 * MS, "circuit_open")] if fail else [(T0 + 2100 * MS, "eviction")])
    return req, spans, ev


def test_recompute_storm_fires_with_breaker() -> None:
    req, spans, ev = _storm(fail=True)
    cfg = DiagnoseConfig(storm_window_ns=500 * MS)
    f = one("recompute_storm", req, spans, events=ev, config=cfg)
    assert isinstance(f, Finding) and f.severity == "critical"
    # By hand: 5 x 1,900 failed tokens of 5 x 2,000 + 35 x 100 = 13,500 recomputed.
    assert f.evidence[0] == ("over the run, 9,500 / 13,500 recomputed tokens (70.4 %) were "
                             "promised remote tokens that failed to load (timeout 9,500)")
    assert f.evidence[1] == ("window 2.000 s .. 2.500 s after the run's start (first tokens "
                             "in it): 10,000 recomputed tokens / 0.500 s = 20,000 tokens/s vs "
                             "a median of 1,000 tokens/s over 8 windows (20.0x)")
    assert f.evidence[2] == ("in that window 5 / 5 requests (100.0 %) had failed remote loads "
                             "(9,500 / 10,000 recomputed tokens (95.0 %): timeout 9,500)")
    assert f.evidence[3] == "1 remote failure event(s) in that window, 1 of them circuit_open"
    assert f.metrics["storm_windows"] == 1
    assert "--window 2.000:2.500" in f.next_step
    assert "Every failed remote load became prefill work" in f.next_step


def test_recompute_storm_quiet_without_failures_or_without_spike() -> None:
    cfg = DiagnoseConfig(storm_window_ns=500 * MS)
    req, spans, ev = _storm(fail=False)
    assert one("recompute_storm", req, spans, events=ev, config=cfg) is None
    req, spans, _ = _storm(fail=True, spike=False)
    fail_ev = events([(T0 + 2100 * MS, "load_failed")])
    assert one("recompute_storm", req, spans, events=fail_ev, config=cfg) is None


def test_recompute_storm_sustained_failure_driven_recompute_without_a_spike() -> None:
    """Every request loses half its prompt to failed remote loads, evenly: no window spikes
    against the median, yet the recompute is the failure's (the case the spike rule missed)."""
    acct = [{"prompt_tokens": 200, "recomputed_tokens": 200, "remote_hit_tokens": 100,
             "load_failed_tokens": 100, "load_failed_error_tokens": 100} for _ in range(40)]
    req, spans = build([{"prefill": 10 * MS}] * 40, acct)
    f = one("recompute_storm", req, spans, events=events([]),
            config=DiagnoseConfig(storm_window_ns=500 * MS))
    assert isinstance(f, Finding) and f.severity == "warning"
    assert f.title == "Recompute storm: 50.0 % of recomputed tokens were failed remote loads"
    assert f.metrics["failed_tokens"] == 4000 and f.metrics["recomputed_tokens"] == 8000
    assert f.metrics["storm_windows"] == 8


def test_recompute_storm_claims_only_the_failures_it_shows() -> None:
    """Failure events and a spike, but no failed loads (lookups failed, nothing promised):
    the finding says so and never speaks of failed loads."""
    req, spans, _ = _storm(fail=False)
    ev = events([(T0 + 2100 * MS, "fault")])
    f = one("recompute_storm", req, spans, events=ev,
            config=DiagnoseConfig(storm_window_ns=500 * MS))
    assert isinstance(f, Finding)
    assert not any("failed remote loads" in e or "failed to load" in e for e in f.evidence)
    assert "Every failed remote load" not in f.next_step
    assert "no failed loads" in f.next_step


def test_recompute_storm_needs_windows_unless_failures_drive_it() -> None:
    req, spans, ev = _storm(fail=False)
    out = one("recompute_storm", req, spans, events=ev,
              config=DiagnoseConfig(storm_window_ns=2 * S))
    assert out == NotEvaluated("recompute_storm",
                               "the run spans 2 window(s) of 2,000.0 ms; a baseline needs 4")
    req, spans, ev = _storm(fail=True)
    f = one("recompute_storm", req, spans, events=ev,
            config=DiagnoseConfig(storm_window_ns=2 * S))
    assert isinstance(f, Finding) and f.metrics["failed_tokens"] == 9500


# --------------------------------------------------------------------------------------------
# h2d_bandwidth_low
# --------------------------------------------------------------------------------------------


def _nvml(gen: int, width: int, gen_max: int | None = None) -> Any:
    return samples([(T0, "nvml", "gpu0", "gpu_pcie_link_generation_current", gen),
                    (T0, "nvml", "gpu0", "gpu_pcie_link_width_current", width),
                    (T0, "nvml", "gpu0", "gpu_pcie_link_generation_max", gen_max or gen),
                    (T0, "nvml", "gpu0", "gpu_pcie_link_width_max", width)])


def _copies(ms_each: int) -> tuple[Any, Any]:
    # Four 100 MB copies back to back; the second overlaps the first by half (union counts).
    starts = [0, ms_each // 2, 2 * ms_each, 3 * ms_each]
    extra = [{"request_id": "r000", "kind": "activity", "name": "h2d", "tier": "host",
              "start_ns": T0 + s * MS, "end_ns": T0 + (s + ms_each) * MS,
              "bytes": 100_000_000} for s in starts]
    return build([{"h2d": 10 * MS, "prefill": 10 * MS}], extra_spans=extra)


def test_pcie_data_rates() -> None:
    assert pcie_bytes_per_s(1, 1) == pytest.approx(250e6)
    assert pcie_bytes_per_s(3, 16) == pytest.approx(8e9 * 128 / 130 / 8 * 16)
    assert pcie_bytes_per_s(4, 16) == pytest.approx(31.50769e9, rel=1e-6)
    with pytest.raises(ValueError, match="generation: expected 1-7, got 9"):
        pcie_bytes_per_s(9, 16)


def test_h2d_bandwidth_low_fires_against_the_link() -> None:
    req, spans = _copies(20)  # 400 MB over 70 ms of union time
    f = one("h2d_bandwidth_low", req, spans, samples=_nvml(4, 16, gen_max=5))
    assert isinstance(f, Finding) and f.severity == "warning"
    assert f.evidence[0] == ("achieved: 4 h2d copies: 400.00 MB over 70.0 ms with at least one "
                             "copy in flight = 5.71 GB/s")
    assert f.evidence[1] == ("link (gpu0): PCIe gen 4 x16 = 16 GT/s per lane x 16 lanes x "
                             "128b/130b (0.9846) / 8 = 31.51 GB/s per direction")
    assert f.evidence[2] == "achieved / link: 5.71 GB/s / 31.51 GB/s (18.1 %)"
    assert "downtrained" in f.next_step
    assert f.metrics["h2d_busy_ns"] == 70 * MS


def test_h2d_bandwidth_quiet_near_the_link_rate() -> None:
    req, spans = _copies(4)  # 400 MB over 14 ms = 28.6 GB/s
    assert one("h2d_bandwidth_low", req, spans, samples=_nvml(4, 16)) is None


def test_h2d_bandwidth_not_evaluated_without_nvml() -> None:
    req, spans = _copies(20)
    out = one("h2d_bandwidth_low", req, spans)
    assert out == NotEvaluated("h2d_bandwidth_low",
                               "no NVML samples (PCIe link generation and width unknown)")


# --------------------------------------------------------------------------------------------
# nic_imbalance
# --------------------------------------------------------------------------------------------


def _nic(eth1_during_reads: float) -> tuple[Any, Any, Any]:
    extra = [{"request_id": "r000", "kind": "activity", "name": "remote_read", "tier": "remote",
              "start_ns": T0 + a * S, "end_ns": T0 + (a + 1) * S} for a in (1, 5)]
    req, spans = build([{"prefill": 10 * MS}], extra_spans=extra)
    rows = []
    for k in range(9):
        reading = k in (2, 6)  # samples at k cover (k-1, k]: these overlap the reads
        rows += [(T0 + k * S, "nic", "eth0", "nic_receive_bytes_per_second",
                  8e9 if reading else 1e3),
                 (T0 + k * S, "nic", "eth1", "nic_receive_bytes_per_second",
                  eth1_during_reads if reading else 5e8),
                 (T0 + k * S, "nic", "eth2", "nic_receive_bytes_per_second", 10.0),
                 (T0 + k * S, "nic", "lo", "nic_receive_bytes_per_second", 9e10)]
    return req, spans, samples(rows)


def test_nic_imbalance_fires() -> None:
    req, spans, smp = _nic(1e9)
    f = one("nic_imbalance", req, spans, samples=smp)
    assert isinstance(f, Finding)
    assert f.evidence[0] == ("mean receive rate during remote reads: eth0 8.00 GB/s (2 samples), "
                             "eth1 1.00 GB/s (2 samples)")
    assert f.evidence[1] == "max / min: 8.00 GB/s (eth0) / 1.00 GB/s (eth1) = 8.0x"
    assert f.metrics["ratio"] == 8.0


def test_nic_imbalance_quiet_when_balanced() -> None:
    req, spans, smp = _nic(6e9)
    assert one("nic_imbalance", req, spans, samples=smp) is None


def test_nic_imbalance_not_evaluated_without_remote_reads() -> None:
    _, _, smp = _nic(1e9)
    req, spans = build([{"prefill": 10 * MS}])
    out = one("nic_imbalance", req, spans, samples=smp)
    assert out == NotEvaluated("nic_imbalance", "no remote reads in this run")


# --------------------------------------------------------------------------------------------
# promised_hits_evicted
# --------------------------------------------------------------------------------------------


def _promised(evicted: list[int]) -> tuple[Any, Any, Any]:
    acct = []
    for i in range(10):
        e = evicted[i] if i < len(evicted) else 0
        acct.append({"prompt_tokens": 1001, "lookup_tokens": 1000, "remote_hit_tokens": 1000,
                     "remote_loaded_tokens": 1000 - e, "recomputed_tokens": 1 + e,
                     "load_failed_tokens": e, "load_failed_evicted_tokens": e})
    stages = [{"queue": (50 if i < len(evicted) else 5) * MS, "prefill": 10 * MS}
              for i in range(10)]
    req, spans = build(stages, acct)
    return req, spans, events([(T0 + MS, "eviction"), (T0 + 2 * MS, "eviction")])


def test_promised_hits_evicted_fires() -> None:
    req, spans, ev = _promised([500, 500, 500])
    f = one("promised_hits_evicted", req, spans, events=ev)
    assert isinstance(f, Finding)
    assert f.evidence[0] == ("1,500 / 10,000 promised tokens (15.0 %) were evicted between the "
                             "arrival lookup and admission, and recomputed")
    assert f.evidence[1] == ("3 / 10 requests with promised hits (30.0 %) lost some of them")
    assert f.evidence[2] == ("median queue time of those requests (the window the blocks were "
                             "evicted in): 50.0 ms vs 5.0 ms over all requests with promised "
                             "hits")
    assert f.evidence[3] == "2 eviction events in the run"
    assert f.requests == ("r000", "r001", "r002")


def test_promised_hits_evicted_quiet_and_not_evaluated() -> None:
    req, spans, ev = _promised([100])
    assert one("promised_hits_evicted", req, spans, events=ev) is None
    out = one("promised_hits_evicted", *build([{"prefill": MS}], {"prompt_tokens": 5,
                                                                   "recomputed_tokens": 5}))
    assert out == NotEvaluated("promised_hits_evicted",
                               "no host or remote hits were promised at arrival")


# --------------------------------------------------------------------------------------------
# other_share_high, and imported runs
# --------------------------------------------------------------------------------------------


def test_other_share_high_fires_and_stays_quiet() -> None:
    f = one("other_share_high", *build([{"other": 20 * MS, "prefill": 80 * MS}] * 10))
    assert isinstance(f, Finding) and f.severity == "warning"
    assert f.evidence[0] == "other: 200.0 ms / 1,000.0 ms of TTFT (20.0 %) summed over 10 requests"
    assert one("other_share_high", *build([{"prefill": 80 * MS}] * 10)) is None


def test_imported_run_without_accounting() -> None:
    req, spans = imported(12, 40 * MS)
    rep = diagnose_report(req, spans)
    reasons = {n.rule: n.reason for n in rep.not_evaluated}
    for rule in ("remote_load_slower_than_recompute", "hit_rate_high_by_requests_low_by_tokens",
                 "promised_hits_evicted", "recompute_storm"):
        assert reasons[rule].startswith("no accounting in this source"), rule
    assert [f.rule for f in rep.findings] == ["other_share_high", "queue_dominated_p99"]
    assert rep.findings[0].severity == "critical"  # 50 % other
    assert set(rep.passed) == {"sync_stalls", "ttft_slo_burn"}
    assert len(rep.findings) + len(rep.not_evaluated) + len(rep.passed) == len(RULES)


# --------------------------------------------------------------------------------------------
# the report: order, rendering, JSON, config
# --------------------------------------------------------------------------------------------


def test_report_order_render_and_json() -> None:
    # 20 % sync (warning) and 30 % other (critical) in the same run.
    req, spans = build([{"sync": 20 * MS, "other": 30 * MS, "prefill": 50 * MS}] * 10)
    rep = diagnose_report(req, spans)
    assert [f.rule for f in rep.findings] == ["other_share_high", "sync_stalls"]
    assert diagnose(req, spans) == list(rep.findings)
    text = render_text(rep)
    assert text.startswith("Diagnoses\n  [CRITICAL] Instrumentation blind spot: 30.0 % of TTFT")
    assert "    next: " in text and "  not evaluated:\n" in text
    md = render_markdown(rep)
    assert md.startswith("## Diagnoses\n\n### CRITICAL: ")
    assert "| `nic_imbalance` | no remote reads in this run |" in md
    back = json.loads(json.dumps(rep.to_dict(), allow_nan=False))
    assert back["findings"][0]["rule"] == "other_share_high"
    assert back["config"]["sync_share"] == 0.1
    assert pickle.loads(pickle.dumps(rep)) == rep  # the dashboard caches reports


def test_inf_ratio_is_json_null() -> None:
    req, spans, smp = _nic(0.0)
    rep = diagnose_report(req, spans, samples=smp, rules=("nic_imbalance",))
    assert rep.findings[0].metrics["ratio"] == float("inf")
    assert json.loads(json.dumps(rep.to_dict(), allow_nan=False))["findings"][0]["metrics"][
        "ratio"] is None


@pytest.mark.parametrize(("kw", "msg"), [
    ({"sync_share": 0.0}, r"DiagnoseConfig.sync_share: expected a fraction in \(0, 1\]"),
    ({"sync_share": 0.5, "sync_share_critical": 0.2},
     r"DiagnoseConfig.sync_share_critical: expected >= sync_share"),
    ({"h2d_link_fraction_critical": 0.5},
     r"DiagnoseConfig.h2d_link_fraction_critical: expected <= h2d_link_fraction"),
    ({"storm_window_ns": 0}, r"DiagnoseConfig.storm_window_ns: expected > 0 ns"),
    ({"storm_factor": 1.0}, r"DiagnoseConfig.storm_factor: expected > 1"),
    ({"examples": 0}, r"DiagnoseConfig.examples: expected 1..100"),
])
def test_config_validation(kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        DiagnoseConfig(**kw)


def test_config_from_dict_and_unknown_rule() -> None:
    assert DiagnoseConfig.from_dict({"sync_share": 0.2}).sync_share == 0.2
    with pytest.raises(ValueError, match=r"unknown setting.*bogus"):
        DiagnoseConfig.from_dict({"bogus": 1})
    req, spans = build([{"prefill": MS}])
    with pytest.raises(ValueError, match=r"unknown rule.*nope"):
        diagnose_report(req, spans, rules=("nope",))



def test_next_step_names_the_runs_current_flags() -> None:
    req, spans = _tail(900, 100)
    run_config = {"options": {"max_num_seqs": 2, "max_batched_tokens": 512, "rate": 200.0,
                              "num_blocks": 512},
                  "command": ["kvscope", "run", "--max-num-seqs", "2", "--rate", "200.0"]}
    rep = diagnose_report(req, spans, rules=("queue_dominated_p99",), run_config=run_config)
    assert rep.findings[0].next_step == (
        "Admission is the tail's bottleneck; one factor at a time, and `kvscope compare` each "
        "run with this one: more running slots, `kvscope run --max-num-seqs 4 --rate 200.0`; "
        "or half the offered load, `kvscope run --max-num-seqs 2 --rate 100`.")
    # A trace's load knob is --time-scale, never --rate.
    trace_cfg = {"options": {"workload": "trace:t.jsonl", "time_scale": 0.5, "rate": 4.0,
                             "max_num_seqs": 2},
                 "command": ["kvscope", "run", "--workload", "trace:t.jsonl", "--time-scale",
                             "0.5"]}
    rep = diagnose_report(req, spans, rules=("queue_dominated_p99",), run_config=trace_cfg)
    assert "`kvscope run --workload trace:t.jsonl --time-scale 1`" in rep.findings[0].next_step
    assert "--rate" not in rep.findings[0].next_step
    # An import names the engine's own knob and prints no kvscope command.
    rep = diagnose_report(req, spans, rules=("queue_dominated_p99",))
    assert "kvscope run" not in rep.findings[0].next_step
    f = one("hit_rate_high_by_requests_low_by_tokens", *_hits(32))
    assert isinstance(f, Finding) and f.next_step.endswith(
        "prefixes: the engine's --block-size halved.")


def test_no_requests_means_nothing_evaluated() -> None:
    req, spans = imported(0, MS)
    rep = diagnose_report(req, spans)
    assert rep.findings == () and rep.passed == ()
    assert {n.reason for n in rep.not_evaluated} == {"no per-request data in this source"}
    assert len(rep.not_evaluated) == len(RULES)


def test_hardware_rules_on_recorder_frames() -> None:
    # The same copies and NIC samples as the hand-built tests, through Recorder + drain().
    rec = Recorder(anchor=ClockAnchor(wall_ns=T0, mono_ns=0), clock=lambda: 0, nvtx=False)
    rn = rec.request_begin("x", 0)
    rec.stage(rn, STATE_CODE["h2d"], MS)
    rec.stage(rn, STATE_CODE["prefill"], 80 * MS)
    rec.first_token(rn, 90 * MS)
    rec.request_end(rn, RequestAccounting(prompt_tokens=10, recomputed_tokens=10), t=95 * MS)
    for s in (0, 10, 40, 60):
        rec.activity("h2d", s * MS, (s + 20) * MS, request_num=rn, tier="host",
                     nbytes=100_000_000)
    for a in (1, 5):
        rec.activity("remote_read", a * S, (a + 1) * S, tier="remote")
    for key, v in (("generation_current", 4), ("width_current", 16),
                   ("generation_max", 4), ("width_max", 16)):
        rec.sample("nvml", f"gpu_pcie_link_{key}", v, entity="gpu0", t=0)
    for k in range(9):
        reading = k in (2, 6)
        rec.sample("nic", "nic_receive_bytes_per_second", 8e9 if reading else 1e3,
                   entity="eth0", unit="bytes_per_second", t=k * S)
        rec.sample("nic", "nic_receive_bytes_per_second", 1e9 if reading else 5e8,
                   entity="eth1", unit="bytes_per_second", t=k * S)
    tables = rec.drain()
    frames = {name: to_pandas(tables[name], schema) for name, schema in (
        ("requests", REQUESTS_SCHEMA), ("spans", SPANS_SCHEMA), ("samples", SAMPLES_SCHEMA))}
    rep = diagnose_report(frames["requests"], frames["spans"], samples=frames["samples"],
                          rules=("h2d_bandwidth_low", "nic_imbalance"))
    by_rule = {f.rule: f for f in rep.findings}
    assert by_rule["h2d_bandwidth_low"].evidence[0] == (
        "achieved: 4 h2d copies: 400.00 MB over 70.0 ms with at least one copy in flight = "
        "5.71 GB/s")  # copies 0-20, 10-30, 40-60, 60-80 ms: a 30 ms and a 40 ms stretch
    assert by_rule["nic_imbalance"].metrics["ratio"] == 8.0


def test_partly_known_accounting_is_counted_over_known_requests_only() -> None:
    req, spans = _remote_run(80)
    req.loc[5:, "remote_loaded_tokens"] = pd.NA  # an import that knows half the requests
    rep = diagnose_report(req, spans, cost=COST)
    assert [f.rule for f in rep.findings] == ["remote_load_slower_than_recompute"]
    f = rep.findings[0]
    assert f.evidence[0].startswith("4 / 5 requests that loaded remote KV (80.0 %)")
    assert ("accounting (remote_loaded_tokens, host_loaded_tokens) is known for 5 / 10 "
            "requests (50.0 %) with a first token; the figures above cover those only"
            in f.evidence)
    # The unknown half is not counted as "no hit": 5 / 5 known requests hit.
    assert "hit_rate_high_by_requests_low_by_tokens" in rep.passed


def test_recompute_storm_not_evaluated_when_failures_are_invisible() -> None:
    req, spans, _ = _storm(fail=True)
    for c in ("load_failed_timeout_tokens", "load_failed_checksum_tokens",
              "load_failed_error_tokens", "load_failed_circuit_open_tokens"):
        req[c] = pd.array([pd.NA] * len(req), dtype="Int64")
    out = one("recompute_storm", req, spans, config=DiagnoseConfig(storm_window_ns=500 * MS))
    assert out == NotEvaluated("recompute_storm", "no load-failure accounting and no events: "
                                                  "remote failures cannot be seen")
