"""The diagnoses an operator gets paged for (issue "Diagnoses that catch what an operator gets
paged for"): sustained remote failure, the breaker open, serialised loads, preemption thrash,
an SLO burn, a hit-share drop, a collapsing tenant, cache thrash, GPU XIDs and NIC errors —
each on a hand-built run whose numbers are checked by hand, quiet on its healthy twin, and
a `kvscope run` next step that differs from the run's own command by exactly one flag."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pandas as pd
import pytest

from agent.schema import EVENTS_SCHEMA
from analyzers.diagnose import ALERT_RULES, RULES, Finding, NotEvaluated, diagnose_report
from analyzers.diagnose.model import command_pairs
from tests.analyzers.diagnose_frames import MS, T0, S, build, frame, samples

COMMAND = ["kvscope", "run", "--num-requests", "40", "--model", "tiny", "--num-blocks", "64",
           "--host-blocks", "32", "--remote", "file:///r", "--fault", "remote-error-rate=0.5",
           "--max-num-seqs", "8", "--rate", "10.0", "--remote-timeout-ms", "100.0"]
OPTIONS = {"num_requests": 40, "model": "tiny", "num_blocks": 64, "host_blocks": 32,
           "remote": "file:///r", "faults": ["remote-error-rate=0.5"], "max_num_seqs": 8,
           "rate": 10.0, "remote_timeout_ms": 100.0, "workload": "docqa"}
RUN_CONFIG = {"command": COMMAND, "options": OPTIONS}


def one(rule: str, req: Any, spans: Any, **kw: Any) -> Finding | NotEvaluated | None:
    rep = diagnose_report(req, spans, rules=(rule,), run_config=kw.pop("run_config",
                                                                       RUN_CONFIG), **kw)
    return (rep.findings or rep.not_evaluated or (None,))[0]


def ev(rows: list[tuple[int, str, dict | None]]) -> pd.DataFrame:
    return frame(EVENTS_SCHEMA, [{"ts_ns": t, "source": "remote", "name": n,
                                  "detail": None if d is None else json.dumps(d)}
                                 for t, n, d in rows])


def one_flag_changed(cmd: str) -> set[tuple[str, str | None]]:
    """The (flag, value) pairs in which `cmd` differs from the run's own command."""
    a, b = set(command_pairs(COMMAND)), set(command_pairs(shlex.split(cmd)))
    return (a ^ b)


def run_commands(f: Finding) -> list[str]:
    import re

    return re.findall(r"`(kvscope run[^`]*)`", f.next_step)


def assert_single_factor(f: Finding) -> None:
    cmds = run_commands(f)
    assert cmds, f.next_step
    for c in cmds:
        diff = one_flag_changed(c)
        flags = {fl for fl, _ in diff}
        assert len(flags) == 1, (c, diff)


# ---- remote_failures_sustained -----------------------------------------------------------

def _failing(fail: int, reason: str = "error") -> tuple[Any, Any]:
    acct = {"prompt_tokens": 1000, "lookup_tokens": 992, "remote_hit_tokens": 800,
            "remote_loaded_tokens": 800 - fail, "recomputed_tokens": 200 + fail,
            "load_failed_tokens": fail, f"load_failed_{reason}_tokens": fail}
    return build([{"queue": MS, "prefill": 10 * MS}] * 20, acct)


def _ops(ok: int, failed: int) -> pd.DataFrame:
    return samples([(T0 + S, "pool", "remote", "remote_read_ok", ok),
                    (T0 + S, "pool", "remote", "remote_read_error", failed),
                    (T0 + S, "pool", "remote", "remote_lookup_ok", 20),
                    (T0 + S, "pool", "remote", "remote_write_error", 99)])


def test_sustained_remote_failure_by_tokens_and_operations() -> None:
    req, spans = _failing(160)
    f = one("remote_failures_sustained", req, spans, samples=_ops(16, 4))
    assert isinstance(f, Finding) and f.severity == "warning"
    # By hand: 20 x 160 / (20 x 800) = 20 %; reads+lookups: 4 / (16 + 4 + 20) = 10 %
    # (writes are off the request path and left out).
    assert f.evidence[0] == ("3,200 / 16,000 promised remote tokens (20.0 %) failed to load "
                             "and were recomputed (error 3,200 tokens)")
    assert f.evidence[1] == "4 / 40 remote lookups and reads (10.0 %) failed (read error 4)"
    assert f.evidence[2].startswith("20 / 20 requests with promised remote hits (100.0 %)")
    assert f.metrics["token_share"] == 0.2 and f.metrics["operation_share"] == 0.1
    assert "kvscope timeline" in f.next_step
    # The run injected the errors: the single factor is that fault, dropped.
    cmd = run_commands(f)[0]
    assert one_flag_changed(cmd) == {("--fault", "remote-error-rate=0.5")}
    assert_single_factor(f)
    # A run without injected faults: the remote tier itself is the factor.
    real = {"command": [c for c in COMMAND if c not in ("--fault", "remote-error-rate=0.5")],
            "options": {**OPTIONS, "faults": []}}
    f = one("remote_failures_sustained", req, spans, samples=_ops(16, 4), run_config=real)
    assert isinstance(f, Finding)
    assert one_flag_changed(run_commands(f)[0]) ^ {("--fault", "remote-error-rate=0.5")} == \
        {("--remote", "file:///r")}


def test_timeouts_lead_to_a_longer_deadline_and_a_healthy_tier_is_quiet() -> None:
    req, spans = _failing(400, "timeout")
    f = one("remote_failures_sustained", req, spans)
    assert isinstance(f, Finding) and f.severity == "critical"  # 50 %
    assert one_flag_changed(run_commands(f)[0]) == {("--remote-timeout-ms", "100.0"),
                                                    ("--remote-timeout-ms", "200")}
    req, spans = _failing(8)  # 1 %
    assert one("remote_failures_sustained", req, spans, samples=_ops(400, 1)) is None
    imported = one("remote_failures_sustained", *build([{"prefill": MS}] * 3),
                   run_config=None)
    assert imported is None  # accounting known, no remote hits at all: nothing failing


# ---- remote_breaker_open ------------------------------------------------------------------

def test_breaker_open_time_and_the_requests_it_turned_away() -> None:
    acct = [{"prompt_tokens": 100, "remote_hit_tokens": 64, "recomputed_tokens": 100,
             "load_failed_tokens": 64, "load_failed_circuit_open_tokens": 64} if 10 <= i < 14
            else {"prompt_tokens": 100, "recomputed_tokens": 100} for i in range(20)]
    req, spans = build([{"prefill": 10 * MS}] * 20, acct)
    events = ev([(T0 + 1000 * MS, "circuit_open", {"op": "read", "failures": 5}),
                 (T0 + 1500 * MS, "circuit_close", {"op": "read"}),
                 (T0 + 1800 * MS, "circuit_open", {"op": "lookup", "failures": 5})])
    f = one("remote_breaker_open", req, spans, events=events, origin_ns=T0)
    assert isinstance(f, Finding)
    # read: 500 ms; lookup: open from 1.8 s to the run's end (the last finish, 1.911 s).
    assert f.metrics["openings"] == 2
    assert f.metrics["open_ns"] == 500 * MS + (1911 * MS - 1800 * MS)
    assert f.metrics["requests_turned_away"] == 4 and f.metrics["tokens_turned_away"] == 256
    assert "lookup breaker opened 1 time(s)" in f.evidence[0]
    assert "read breaker opened 1 time(s), open 500.0 ms" in f.evidence[0]
    assert f.evidence[-1] == "first opening: read at 1.000 s, closed at 1.500 s after the " \
        "run's start"
    assert set(f.requests) == {"r010", "r011", "r012", "r013"}
    assert one("remote_breaker_open", req, spans, events=ev([])) is None
    # Read and write breakers open at the same time: the time any was open counts once, and
    # never more than the run (the title's share stays <= 100 %).
    both = ev([(T0 + 100 * MS, "circuit_open", {"op": "read"}),
               (T0 + 200 * MS, "circuit_open", {"op": "write"}),
               (T0 + 1500 * MS, "circuit_close", {"op": "read"})])
    f = one("remote_breaker_open", req, spans, events=both, origin_ns=T0)
    # read 100..1,500 ms, write 200 ms..the end (1,911 ms): union 100..1,911 ms.
    assert f.metrics["open_ns"] == 1811 * MS
    assert "(94.8 % of the run)" in f.title  # 1,811 / 1,911 ms


# ---- load_serialisation -------------------------------------------------------------------

def _serial_run(serial: bool) -> tuple[Any, Any]:
    """12 requests arrive 1 ms apart and wait in remote_read; serialised, the k-th waits
    k x 20 ms (one 20 ms read at a time); parallel, every wait is one read."""
    stages = [{"remote_read": ((k + 1) if serial else 1) * 20 * MS, "prefill": MS}
              for k in range(12)]
    reads = [{"request_id": f"r{k:03d}", "kind": "activity", "name": "remote_read",
              "start_ns": T0 + k * 20 * MS, "end_ns": T0 + (k + 1) * 20 * MS,
              "tier": "remote", "transfer_id": k} for k in range(12)]
    return build(stages, gap_ns=MS, extra_spans=reads)


def test_serialised_loads_show_one_load_per_waiting_request() -> None:
    f = one("load_serialisation", *_serial_run(True))
    assert isinstance(f, Finding) and f.severity == "critical"
    # Each waiting request adds one 20 ms read: slope 20 ms, parallelism 20 / 20 = 1.
    assert f.metrics["slope_ns"] == pytest.approx(20 * MS)
    assert f.metrics["one_load_ns"] == pytest.approx(20 * MS)
    assert f.metrics["parallelism"] == pytest.approx(1.0)
    assert f.evidence[0].startswith("the wait in remote_read grows 20.0 ms per request "
                                    "waiting with it (Theil-Sen over 12 waits with 1 to 12 "
                                    "waiting; rank correlation 1.00)")
    assert_single_factor(f)  # --rate halved
    assert one("load_serialisation", *_serial_run(False)) is None
    cfg = {"command": [*COMMAND, "--fault", "remote-concurrency=1"],
           "options": {**OPTIONS, "faults": ["remote-error-rate=0.5", "remote-concurrency=1"]}}
    f = one("load_serialisation", *_serial_run(True), run_config=cfg)
    assert isinstance(f, Finding) and "--fault remote-concurrency=1" in f.next_step
    assert "remote-concurrency" not in run_commands(f)[0]
    few = build([{"remote_read": MS, "prefill": MS}] * 3)
    assert isinstance(one("load_serialisation", *few), NotEvaluated)


def test_serialisation_behind_prefetch_workers_is_still_one_at_a_time() -> None:
    """The shape `--fault remote-concurrency=1` gives with two prefetch workers: a one-at-a-
    time store, 20 ms a read, and a second read always queued inside it, so every read but
    the first spans 40 ms ((k-1) x 20 .. (k+1) x 20 ms). The queued half is not service: the
    fastest read (20 ms) bounds one read's service, and the path serves 20 / 20 = 1 at a
    time (a typical read's 40 ms would say 2)."""
    stages = [{"remote_read": (k + 1) * 20 * MS, "prefill": MS} for k in range(12)]
    reads = [{"request_id": f"r{k:03d}", "kind": "activity", "name": "remote_read",
              "start_ns": T0 + max(k - 1, 0) * 20 * MS, "end_ns": T0 + (k + 1) * 20 * MS,
              "tier": "remote", "transfer_id": k} for k in range(12)]
    f = one("load_serialisation", *build(stages, gap_ns=MS, extra_spans=reads))
    assert isinstance(f, Finding) and f.severity == "critical"
    assert f.metrics["one_load_ns"] == pytest.approx(20 * MS)
    assert f.metrics["parallelism"] == pytest.approx(1.0)
    assert "serves at most about 1.0 at a time" in f.title


# ---- preemption_thrash --------------------------------------------------------------------

def test_preemption_thrash_with_an_exhausted_pool() -> None:
    acct = [{"prompt_tokens": 500, "recomputed_tokens": 500, "preempted_tokens": 250,
             "num_preemptions": 1} if i % 2 else {"prompt_tokens": 500,
                                                   "recomputed_tokens": 500}
            for i in range(20)]
    req, spans = build([{"prefill": 10 * MS}] * 20, acct)
    smp = samples([(T0 + i * 100 * MS, "pool", "device", "empty", 0 if i < 15 else 8)
                   for i in range(20)])
    f = one("preemption_thrash", req, spans, samples=smp, origin_ns=T0)
    assert isinstance(f, Finding) and f.severity == "critical"
    # By hand: 10 x 250 / (10 x 250 + 20 x 500) = 2,500 / 12,500 = 20 %.
    assert f.evidence[0].startswith("2,500 / 12,500 computed prompt tokens (20.0 %)")
    assert "the device pool had no empty block in 15 / 20 pool samples (75.0 %)" in f.evidence
    assert one_flag_changed(run_commands(f)[0]) == {("--num-blocks", "64"),
                                                    ("--num-blocks", "128")}
    quiet = build([{"prefill": 10 * MS}] * 20, {"prompt_tokens": 500,
                                                 "recomputed_tokens": 500})
    assert one("preemption_thrash", *quiet) is None


# ---- ttft_slo_burn ------------------------------------------------------------------------

def test_slo_burn_fast_and_slow() -> None:
    slow = [{"queue": 2500 * MS, "prefill": 10 * MS}] * 3 + [{"prefill": 10 * MS}] * 17
    f = one("ttft_slo_burn", *build(slow))
    # 3 / 20 = 15 % over 2 s: 15x the 1 % budget (fast burn at 14.4x).
    assert isinstance(f, Finding) and f.severity == "critical"
    assert f.metrics["burn_rate"] == pytest.approx(15.0)
    assert "queue" in f.evidence[1] and "--rate 5" in run_commands(f)[0]
    assert_single_factor(f)
    f = one("ttft_slo_burn", *build(slow[:2] + [{"prefill": 10 * MS}] * 28))
    assert isinstance(f, Finding) and f.severity == "warning"  # 2 / 30 = 6.7x
    assert one("ttft_slo_burn", *build(slow[:1] + [{"prefill": 10 * MS}] * 29)) is None


# ---- token_hit_share_drop -----------------------------------------------------------------

def test_hit_share_drop_against_what_came_before() -> None:
    hit = {"prompt_tokens": 1000, "lookup_tokens": 992, "device_hit_tokens": 800,
           "recomputed_tokens": 200}
    miss = {"prompt_tokens": 1000, "lookup_tokens": 992, "recomputed_tokens": 1000}
    acct = [hit] * 30 + [miss] * 10
    req, spans = build([{"prefill": 10 * MS}] * 40, acct)
    f = one("token_hit_share_drop", req, spans, origin_ns=T0)
    assert isinstance(f, Finding)
    assert f.metrics["share"] == 0.0 and f.metrics["baseline_share"] == pytest.approx(800 / 992)
    assert set(f.requests) <= {f"r{i:03d}" for i in range(30, 40)}
    assert one("token_hit_share_drop", *build([{"prefill": 10 * MS}] * 40, hit)) is None


# ---- tenant_collapse ----------------------------------------------------------------------

def test_a_tenant_whose_prefix_never_fits_collapses() -> None:
    hit = {"prompt_tokens": 1000, "lookup_tokens": 992, "device_hit_tokens": 800,
           "recomputed_tokens": 200}
    miss = {"prompt_tokens": 1000, "lookup_tokens": 992, "recomputed_tokens": 1000,
            "host_hit_tokens": 96, "load_failed_tokens": 96, "load_failed_evicted_tokens": 96}
    acct = [miss if i % 3 == 0 else hit for i in range(30)]
    req, spans = build([{"prefill": 10 * MS}] * 30, acct)
    req["tenant"] = ["big" if i % 3 == 0 else f"t{i % 3}" for i in range(30)]
    f = one("tenant_collapse", req, spans)
    assert isinstance(f, Finding)
    assert f.metrics["name"] == "big" and f.metrics["kind"] == "hit"
    assert f.evidence[0] == "tenant big: 0 / 9,920 lookup tokens (0.0 %) reused over 10 requests"
    assert f.evidence[1] == "every other tenant: 16,000 / 19,840 lookup tokens (80.6 %) reused"
    assert "960 of its promised tokens were evicted before admission" in f.evidence
    assert_single_factor(f)
    req["tenant"] = ["a" if i % 2 else "b" for i in range(30)]
    req2, spans2 = build([{"prefill": 10 * MS}] * 30, hit)
    req2["tenant"] = req["tenant"]
    assert one("tenant_collapse", req2, spans2) is None
    assert isinstance(one("tenant_collapse", *build([{"prefill": MS}] * 30, hit)),
                      NotEvaluated)


# ---- cache_thrash -------------------------------------------------------------------------

def test_cache_thrash_from_the_ledger() -> None:
    acct = {"prompt_tokens": 500, "recomputed_tokens": 500}
    rows = [{"request_id": f"r{i:03d}", "kind": "ledger", "name": "evicted_again",
             "start_ns": T0 + i * 100 * MS, "end_ns": T0 + i * 100 * MS, "tier": "host",
             "tokens": 160} for i in range(0, 20, 2)]
    rows.append({"request_id": "r001", "kind": "ledger", "name": "evicted_reloaded",
                 "start_ns": T0, "end_ns": T0, "tokens": 64})
    req, spans = build([{"prefill": 10 * MS}] * 20, acct, extra_spans=rows)
    f = one("cache_thrash", req, spans)
    assert isinstance(f, Finding)
    # By hand: 10 x 160 / (20 x 500) = 16 %.
    assert f.evidence[0].startswith("1,600 / 10,000 computed prompt tokens (16.0 %) were of "
                                    "blocks evicted earlier in the run and computed again "
                                    "(device and host 1,600 evicted)")
    assert "another 64 tokens of evicted blocks were loaded back" in f.evidence[-1]
    assert one_flag_changed(run_commands(f)[0]) == {("--host-blocks", "32"),
                                                    ("--host-blocks", "64")}
    quiet = build([{"prefill": 10 * MS}] * 20, acct, extra_spans=[
        {**rows[0], "name": "device_hit", "tokens": 0}])
    assert one("cache_thrash", *quiet) is None
    assert isinstance(one("cache_thrash", *build([{"prefill": MS}] * 3, acct)), NotEvaluated)


# ---- hardware -----------------------------------------------------------------------------

def test_gpu_xid_and_nic_errors() -> None:
    req, spans = build([{"prefill": MS}] * 3)
    xid = frame(EVENTS_SCHEMA, [{"ts_ns": T0 + 2 * S, "source": "nvml", "name": "xid",
                                 "detail": json.dumps({"gpu": "0", "xid": 79})}])
    f = one("gpu_xid_errors", req, spans, events=xid, origin_ns=T0)
    assert isinstance(f, Finding) and f.severity == "critical"
    assert f.evidence == ("1 XID event(s) from NVML: GPU 0 XID 79 x1",
                          "the first at 2.000 s after the run's start")
    nvml = samples([(T0, "nvml", "gpu0", "gpu_utilization_ratio", 0.5)])
    assert one("gpu_xid_errors", req, spans, events=ev([]), samples=nvml) is None
    nic = samples([(T0 + i * S, "nic", "eth0", "nic_receive_errors_per_second",
                    3.0 if i == 4 else 0.0) for i in range(10)])
    f = one("nic_errors", req, spans, samples=nic)
    assert isinstance(f, Finding) and f.evidence[0] == ("eth0 receive_errors: up to 3.00/s in "
                                                        "1 sample(s)")
    clean = samples([(T0 + i * S, "nic", "eth0", "nic_receive_errors_per_second", 0.0)
                     for i in range(10)])
    assert one("nic_errors", req, spans, samples=clean) is None


# ---- alerts and rules ---------------------------------------------------------------------

def test_every_alert_has_its_rule_and_its_runbook_names_it() -> None:
    import yaml

    from tests.conftest import REPO

    rules = yaml.safe_load((REPO / "dashboard/rules/kvscope-rules.yaml").read_text())
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert set(alerts) == set(ALERT_RULES)
    assert set(ALERT_RULES.values()) <= set(RULES)
    runbook = (REPO / "dashboard/rules/RUNBOOKS.md").read_text()
    sections = runbook.split("\n## ")
    for alert, rule in ALERT_RULES.items():
        sec = next(s for s in sections if s.startswith(alert))
        assert f"`{rule}`" in sec, alert
