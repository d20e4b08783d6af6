"""The accounting recomputed from the physical operations (analyzers.consistency), on real
engine runs against file:// and a real redis-server: a healthy run with host and remote tiers,
a warm second run, a fault run (errors, corruption, reads slower than their deadline), a
preemption-heavy run and a run with tenants. Every accounting column agrees exactly; one block
booked to the wrong tier fails it; no share in `kvscope analyze --format json` passes 100 %.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from agent.runstore import open_run
from agent.runstore.reader import block_size_of
from analyzers.consistency import CHECKED_COLUMNS, check_consistency, kv_bytes_per_block_of
from analyzers.report import build_report, render_json
from kvscope.session import RunOptions, run_session
from tests.instrumented_engine.tiers.conftest import RedisServer, redis_server  # noqa: F401

BASE = {"model": "tiny", "metrics_port": 0, "collectors": False, "threads": 1, "seed": 3}


def _run(out: Path, **kw: Any) -> Path:
    run_session(RunOptions(out=out, **{**BASE, **kw}))
    return out


def _check(path: Path) -> Any:
    run = open_run(path)
    return run, check_consistency(run.requests, run.spans, block_size=block_size_of(run.meta),
                                  kv_bytes_per_block=kv_bytes_per_block_of(run.meta))


def _shares(doc: Any, where: str = "") -> list[tuple[str, str, int, int]]:
    """Every share (numerator and denominator in one unit) anywhere in the report."""
    out = []
    if isinstance(doc, dict):
        if {"numerator", "denominator", "numerator_unit"} <= set(doc) and \
                doc["numerator_unit"] is None:
            out.append((where, doc.get("key", ""), doc["numerator"], doc["denominator"]))
        for k, v in doc.items():
            out += _shares(v, f"{where}/{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _shares(v, f"{where}/{i}")
    return out


def _assert_run_is_right(path: Path, label: str) -> pd.DataFrame:
    run, c = _check(path)
    assert c.available and c.columns == CHECKED_COLUMNS, (label, c.reason)
    assert c.mismatches.empty, (label, c.mismatches.head(10).to_string())
    report = build_report(run)
    doc = json.loads(render_json(report))
    shares = _shares(doc)
    assert shares, label
    over = [s for s in shares if s[3] and s[2] > s[3]]
    assert over == [], (label, over)
    assert doc["consistency"]["available"] and doc["consistency"]["mismatches"] == []
    tiers = {t["tier"]: t for t in doc["accounting"]["tiers"]}
    # Per request, per tier: loaded <= promised + found; the shortfall is never negative.
    req = run.requests
    for tier in ("host", "remote"):
        loaded, hit, found = (req[f"{tier}_{c}_tokens"].to_numpy(np.int64)
                              for c in ("loaded", "hit", "found"))
        assert (loaded <= hit + found).all(), (label, tier)
        assert tiers[tier]["shortfall_tokens"] >= 0, (label, tier)
    assert "agree exactly with the recorded lookups, loads, reads and copies" in \
        report_text(report)
    return req


def report_text(report: Any) -> str:
    from analyzers.report import render

    return render(report, "text")


@pytest.fixture(params=["file", "redis"])
def remote_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'remote'}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


def test_every_column_agrees_on_healthy_warm_fault_preemption_and_tenant_runs(
        remote_url: str, tmp_path: Path) -> None:
    tiers = {"host_blocks": 48, "remote": remote_url}
    cold = _assert_run_is_right(_run(tmp_path / "cold", num_requests=16, rate=0, **tiers),
                                "healthy")
    assert cold["remote_written_bytes"].sum() > 0 and cold["h2d_bytes"].sum() >= 0

    warm = _assert_run_is_right(_run(tmp_path / "warm", num_requests=16, rate=0, **tiers),
                                "warm")
    assert warm["remote_loaded_tokens"].sum() > 0 and warm["remote_read_bytes"].sum() > 0
    # The same warm remote with every layer copied before the forward (the default copies
    # layer by layer beside it): the columns agree either way.
    whole = _assert_run_is_right(_run(tmp_path / "warm-whole", num_requests=16, rate=0,
                                      load_mode="whole", **tiers), "warm, whole loads")
    assert whole["remote_loaded_tokens"].sum() > 0
    assert warm["remote_hit_tokens"].sum() >= warm["remote_loaded_tokens"].sum() - \
        warm["remote_found_tokens"].sum()

    fault = _assert_run_is_right(_run(
        tmp_path / "fault", num_requests=20, rate=40, remote_timeout_ms=60,
        faults=("remote-error-rate=0.2", "remote-corrupt-rate=0.15",
                "remote-read-latency=90ms"), **tiers), "fault")
    assert fault["load_failed_tokens"].sum() > 0

    # Preemption without the remote: with it, remote reads finishing at different times
    # stagger the admissions, and whether the pool runs out depends on timing.
    pre = _assert_run_is_right(_run(tmp_path / "preempt", num_requests=24, rate=0,
                                    num_blocks=48, max_num_seqs=16, host_blocks=48),
                               "preemption")
    assert pre["num_preemptions"].sum() > 0

    ten = _assert_run_is_right(_run(tmp_path / "tenants", num_requests=18, rate=0, tenants=3,
                                    **tiers), "tenants")
    assert ten["tenant"].nunique() == 3


def test_one_block_booked_to_the_wrong_tier_fails_it(tmp_path: Path) -> None:
    tiers = {"host_blocks": 48, "remote": f"file://{tmp_path / 'remote'}"}
    _run(tmp_path / "cold", num_requests=12, rate=0, **tiers)
    run, c = _check(_run(tmp_path / "warm", num_requests=12, rate=0, **tiers))
    assert c.ok
    req = run.requests.copy()
    i = int(np.flatnonzero(req["remote_loaded_tokens"].to_numpy(np.int64) > 0)[0])
    bs = block_size_of(run.meta)
    assert bs is not None
    req.loc[i, "remote_loaded_tokens"] -= bs
    req.loc[i, "host_loaded_tokens"] += bs  # the identity still holds: only the tier is wrong
    bad = check_consistency(req, run.spans, block_size=bs,
                            kv_bytes_per_block=kv_bytes_per_block_of(run.meta))
    got = {(r.request_id, r.column) for r in bad.mismatches.itertuples()}
    rid = req.loc[i, "request_id"]
    assert got == {(rid, "remote_loaded_tokens"), (rid, "host_loaded_tokens")}
    # A byte counted twice, and a promise counted at the wrong moment, show too.
    req2 = run.requests.copy()
    req2.loc[i, "remote_read_bytes"] *= 2
    req2.loc[i, "remote_hit_tokens"] += bs
    bad2 = check_consistency(req2, run.spans, block_size=bs,
                             kv_bytes_per_block=kv_bytes_per_block_of(run.meta))
    assert {r.column for r in bad2.mismatches.itertuples()} == {"remote_read_bytes",
                                                              "remote_hit_tokens"}


def test_the_engine_booking_one_block_to_the_wrong_tier_is_caught(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation in the engine itself: its counters book a remote block as a host one
    while the ledger records what happened; the check names the requests."""
    from dataclasses import replace

    from instrumented_engine.tiers.flow import TierFlow

    tiers = {"host_blocks": 48, "remote": f"file://{tmp_path / 'remote'}"}
    _run(tmp_path / "cold", num_requests=12, rate=0, **tiers)
    real = TierFlow._loads

    def wrong(self: TierFlow, plan: Any, hit: int, n: int) -> Any:
        loads = real(self, plan, hit, n)
        if loads.remote_loaded_tokens:
            bs = self.bs
            return replace(loads, remote_loaded_tokens=loads.remote_loaded_tokens - bs,
                           host_loaded_tokens=loads.host_loaded_tokens + bs)
        return loads

    monkeypatch.setattr(TierFlow, "_loads", wrong)
    run, c = _check(_run(tmp_path / "warm", num_requests=12, rate=0, **tiers))
    assert c.available and len(c.mismatches)
    assert set(c.mismatches["column"]) >= {"remote_loaded_tokens", "host_loaded_tokens"}
    assert "disagree with the recorded lookups" in report_text(build_report(run))


def test_a_read_shared_by_several_requests_is_booked_to_its_issuer(tmp_path: Path) -> None:
    """Requests arriving together with one document: one read per block is issued, by the
    first; the others wait on it and load the same blocks, with no remote bytes of their
    own. The bytes summed over requests equal the bytes the reads moved."""
    tiers = {"host_blocks": 64, "remote": f"file://{tmp_path / 'remote'}"}
    _run(tmp_path / "cold", num_requests=10, rate=0, **tiers)
    # Slow reads keep each one in flight while the others arrive and join it.
    run, c = _check(_run(tmp_path / "warm", num_requests=10, rate=0, remote_timeout_ms=5000,
                         faults=("remote-read-latency=50ms",), **tiers))
    assert c.ok
    req = run.requests.set_index("request_id")
    sp = run.spans
    reads = sp[(sp["kind"] == "activity") & (sp["name"] == "remote_read")]
    waits: dict[str, set[int]] = {}
    for r in sp[(sp["kind"] == "state") & (sp["name"] == "remote_read")].itertuples():
        w = r.waits_on
        waits.setdefault(r.request_id, set()).update(int(x) for x in ([] if w is None else w))
    issuer = dict(zip(reads["transfer_id"].astype(int), reads["request_id"], strict=True))
    shared = [(rid, t) for rid, ts in waits.items() for t in ts
              if t in issuer and issuer[t] != rid]
    assert shared, "no request waited on another's read: the workload shares no document"
    for _, tid in shared:
        assert req.loc[issuer[tid], "remote_read_bytes"] > 0
    assert int(req["remote_read_bytes"].sum()) == int(reads["bytes"].sum())
    nbytes = dict(zip(reads["transfer_id"].astype(int), reads["bytes"].astype(int),
                      strict=True))
    for rid in {rid for rid, _ in shared}:
        own = int(reads.loc[reads["request_id"] == rid, "bytes"].sum())
        waited = sum(nbytes[t] for t in waits[rid] if t in nbytes)
        assert req.loc[rid, "remote_read_bytes"] == own < waited


def test_without_a_ledger_the_check_says_why() -> None:
    from tests.conftest import GOLDEN_RUN

    run = open_run(GOLDEN_RUN)
    c = check_consistency(run.requests, run.spans, block_size=block_size_of(run.meta))
    assert not c.available and "no ledger rows" in c.reason
    assert "ledger: not checked (the run has no ledger rows;" in report_text(build_report(run))
