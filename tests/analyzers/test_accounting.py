"""Token accounting, the identity check, the layer table and the time saved (golden run)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from agent.runstore import RunStore, open_run
from agent.schema import ACCOUNTING_COLUMNS
from analyzers.accounting import (
    Ratio,
    check_identity,
    layer_table,
    prefill_seconds_saved,
    token_accounting,
)
from analyzers.costmodel import StepCost, fit_step_cost
from analyzers.ttft import partition
from tests.conftest import GOLDEN_RUN

EXPECTED = json.loads((GOLDEN_RUN.parent / "expected.json").read_text())


@pytest.fixture(scope="module")
def store() -> RunStore:
    return open_run(GOLDEN_RUN)


def test_totals_and_population(store: RunStore) -> None:
    acct = token_accounting(store.requests)
    want = EXPECTED["accounting"]
    assert (acct.requests, acct.without_first_token) == (want["requests"],
                                                         want["without_first_token"])
    for col, value in want["totals"].items():
        assert acct.totals[col] == value, col
    assert set(acct.totals) == set(ACCOUNTING_COLUMNS)


def test_every_ratio_carries_its_numerator_denominator_and_unit(store: RunStore) -> None:
    acct = token_accounting(store.requests)
    for key, (num, den, unit) in EXPECTED["accounting"]["ratios"].items():
        r = acct.ratio(key)
        assert (r.numerator, r.denominator, r.unit) == (num, den, unit), key
    assert str(acct.ratio("token_hit_share")) == EXPECTED["accounting"]["token_hit_share_text"]
    # Prompt tokens by source add up to the prompt (the identity, in aggregate).
    assert sum(acct.ratio(f"prompt_{s}").numerator for s in
               ("device_hit", "host_loaded", "remote_loaded", "recomputed")) == 12104


def test_ratio_rendering() -> None:
    assert str(Ratio("k", "x", 6144, 8191, "lookup tokens", "token")) == \
        "6,144 / 8,191 lookup tokens (75.0 %)"
    assert str(Ratio("k", "x", 1, 0, "requests", "request")) == "1 / 0 requests (n/a)"
    rate = Ratio("k", "x", 8192, 2, "loaded tokens", "byte", numerator_unit="bytes")
    assert str(rate) == "8,192 bytes / 2 loaded tokens (4,096.0 bytes each)"
    assert rate.to_dict()["value"] == 4096.0


def test_tiers_and_failures(store: RunStore) -> None:
    acct = token_accounting(store.requests)
    tiers = acct.tiers.set_index("tier")
    for tier, want in EXPECTED["accounting"]["tiers"].items():
        for col, v in want.items():
            assert tiers.loc[tier, col] == v, (tier, col)
    fails = acct.failures.set_index("reason")
    assert fails.loc["checksum"].tolist() == [512, 1]
    assert fails.loc["evicted"].tolist() == [256, 1]
    assert fails.loc["timeout"].tolist() == [0, 0]


def test_grouped_accounting(store: RunStore) -> None:
    g = token_accounting(store.requests, by="tenant").groups.set_index("tenant")
    assert g.loc["acme", "requests"] == 6 and g.loc["globex", "requests"] == 3
    assert g.loc["globex", "reused_tokens"] == 768 + 1024  # device hits + remote loaded
    assert g["lookup_tokens"].sum() == 12032


def test_identity_violations_name_the_offending_requests(store: RunStore) -> None:
    assert check_identity(store.requests).empty
    bad = store.requests.copy()
    i = bad.index[bad["request_id"] == "req-host"][0]
    bad.loc[i, "recomputed_tokens"] = 200  # 64 tokens unaccounted for
    j = bad.index[bad["request_id"] == "req-evicted"][0]
    bad.loc[j, "load_failed_evicted_tokens"] = 0  # reasons no longer sum to load_failed
    k = bad.index[bad["request_id"] == "req-error"][0]
    bad.loc[k, "recomputed_tokens"] = 5  # no first token: the identity does not apply
    v = check_identity(bad)
    assert v.to_dict("records") == [
        {"request_id": "req-host",
         "check": "prompt = device_hit + host_loaded + remote_loaded + recomputed",
         "expected": 1032, "actual": 968},
        {"request_id": "req-evicted", "check": "load_failed = sum of reasons",
         "expected": 256, "actual": 0},
    ]
    assert len(token_accounting(bad).identity_violations) == 2


def test_columns_an_import_does_not_carry_make_no_ratio(store: RunStore) -> None:
    req = store.requests.copy()
    for c in ("host_hit_tokens", "remote_hit_tokens"):
        req[c] = pd.array([None] * len(req), dtype="Int64")
    acct = token_accounting(req)
    keys = {r.key for r in acct.ratios}
    assert "token_hit_share" in keys
    assert not keys & {"host_promised_share", "host_load_yield", "load_failed_share"}
    assert "host_hit_tokens" not in acct.totals


def test_layer_table(store: RunStore) -> None:
    lt = layer_table(store.layers).set_index("layer")
    for layer, want in EXPECTED["layers"].items():
        for col, v in want.items():
            assert lt.loc[int(layer), col] == v, (layer, col)
    assert lt.loc[0, "hit_share"] == pytest.approx(2816 / 12104, rel=1e-12)
    assert (lt["identity_violations"] == 0).all()


def test_seconds_saved_by_reuse_use_the_per_token_step_cost(store: RunStore) -> None:
    cost = StepCost(fixed_ns=3e6, per_token_ns=50_000.0, fixed_ci_ns=(2.9e6, 3.1e6),
                    per_token_ci_ns=(45_000.0, 56_000.0), steps=100, token_range=(2, 512))
    part = partition(store.requests, store.spans)
    saved = prefill_seconds_saved(store.requests, cost, part)
    reused = EXPECTED["seconds_saved"]["reused_tokens"]
    assert saved.reused_tokens == reused == 4352
    # By hand: 4,352 tokens x 50 us = 0.2176 s (the fixed per-step cost is paid anyway).
    assert saved.gross_seconds == pytest.approx(0.2176, rel=1e-12)
    assert saved.gross_ci_seconds == pytest.approx((4352 * 45e-6, 4352 * 56e-6), rel=1e-12)
    assert saved.load_seconds == EXPECTED["seconds_saved"]["load_ns"] / 1e9
    assert saved.net_seconds == pytest.approx(saved.gross_seconds - saved.load_seconds)
    assert saved.by_source["remote_loaded"] == {"tokens": 1024,
                                                "seconds": pytest.approx(1024 * 50e-6)}
    assert prefill_seconds_saved(store.requests, cost).load_seconds is None
    # Without a fitted model the saving is unknown, not zero.
    none = fit_step_cost(store.spans.iloc[0:0])
    assert not none.fitted and np.isnan(prefill_seconds_saved(store.requests, none)
                                        .gross_seconds)
