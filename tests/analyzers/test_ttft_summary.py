"""TTFT aggregates on the golden run: percentiles, shares, slowest requests, windows, groups."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from agent.errors import InputError
from agent.runstore import open_run
from analyzers.ttft import partition, summarize
from tests.conftest import GOLDEN_RUN

EXPECTED = json.loads((GOLDEN_RUN.parent / "expected.json").read_text())["ttft"]


@pytest.fixture(scope="module")
def part() -> pd.DataFrame:
    store = open_run(GOLDEN_RUN)
    return partition(store.requests, store.spans)


def test_percentiles_totals_and_counts(part: pd.DataFrame) -> None:
    s = summarize(part)
    assert (s.requests, s.without_first_token, s.derived, s.violations) == (9, 1, 0, 0)
    ttft = s.stage("ttft")
    assert (ttft["p50_ns"], ttft["p90_ns"], ttft["p99_ns"]) == (
        EXPECTED["ttft_p50_ns"], EXPECTED["ttft_p90_ns"], EXPECTED["ttft_p99_ns"])
    assert ttft["total_ns"] == EXPECTED["ttft_total_ns"]
    queue = s.stage("queue")
    assert (queue["p50_ns"], queue["p90_ns"]) == (EXPECTED["queue_p50_ns"],
                                                  EXPECTED["queue_p90_ns"])
    for stage, total in EXPECTED["stage_total_ns"].items():
        row = s.stage(stage)
        assert row["total_ns"] == total
        assert row["share_of_total"] == pytest.approx(total / EXPECTED["ttft_total_ns"],
                                                      rel=1e-12)
    assert s.stage("hidden_load")["total_ns"] == EXPECTED["hidden_load_total_ns"]


def test_mean_share_is_the_mean_of_per_request_shares(part: pd.DataFrame) -> None:
    served = part[part["ttft_ns"].notna()]
    want = (served["queue_ns"].astype(float) / served["ttft_ns"].astype(float)).mean()
    assert summarize(part).stage("queue")["share_mean"] == pytest.approx(want, rel=1e-12)
    shares = summarize(part).stages.set_index("stage")["share_mean"]
    assert shares.drop(["ttft", "hidden_load"]).sum() == pytest.approx(1.0, rel=1e-12)


def test_slowest_requests_are_those_at_or_above_p99(part: pd.DataFrame) -> None:
    slow = summarize(part).slowest.set_index("stage")
    assert (slow["requests"] == len(EXPECTED["slowest_requests"])).all()
    assert (slow["threshold_ns"] == EXPECTED["ttft_p99_ns"]).all()
    for stage, (num, den) in EXPECTED["slowest_share"].items():
        assert slow.loc[stage, "share"] == pytest.approx(num / den, rel=1e-12)
        assert slow.loc[stage, "mean_ns"] == num
    assert slow["share"].sum() == pytest.approx(1.0, rel=1e-12)


def test_windows_by_arrival(part: pd.DataFrame) -> None:
    s = summarize(part)
    assert s.window_ns == EXPECTED["window_ns"]
    assert s.windows["requests"].tolist() == EXPECTED["window_requests"]
    # req-host (15.69 ms) and req-remote (21.96 ms) share the 10-15 ms window.
    w = s.windows.iloc[2]
    assert w["ttft_p50_ns"] == (15_690_000 + 21_960_000) / 2
    one = summarize(part, window_ns=10**9).windows
    assert one["requests"].tolist() == [9]
    assert one["ttft_p99_ns"].iloc[0] == EXPECTED["ttft_p99_ns"]


def test_grouping_by_tenant_and_hit_class(part: pd.DataFrame) -> None:
    s = summarize(part, by="tenant")
    ttft = s.stages[s.stages["stage"] == "ttft"].set_index("tenant")
    assert ttft["requests"].to_dict() == {"acme": 6, "globex": 3}
    # globex: req-remote 21.96, req-remote-checksum 23.205, req-preempted 45.08 ms
    assert ttft.loc["globex", "p50_ns"] == 23_205_000
    assert ttft.loc["globex", "total_ns"] == 21_960_000 + 23_205_000 + 45_080_000
    hc = summarize(part, by="hit_class").stages
    assert hc.loc[hc["stage"] == "ttft", "requests"].tolist() == [3, 1, 5]  # cold, full, partial
    both = summarize(part, by=["tenant", "hit_class"]).slowest
    assert set(map(tuple, both[["tenant", "hit_class"]].drop_duplicates().to_numpy())) == {
        ("acme", "cold"), ("acme", "full"), ("acme", "partial"), ("globex", "cold"),
        ("globex", "partial")}


def test_bad_grouping_and_window_are_input_errors(part: pd.DataFrame) -> None:
    with pytest.raises(InputError, match="--by request_id"):
        summarize(part, by="request_id")
    with pytest.raises(InputError, match="window_ns"):
        summarize(part, window_ns=0)


def test_empty_partition_summarises_to_zero_requests(part: pd.DataFrame) -> None:
    s = summarize(part.iloc[:0])
    assert s.requests == 0
    assert s.stage("ttft")["requests"] == 0 and s.stage("ttft")["p50_ns"] is None
    assert s.slowest.empty and s.windows.empty
    assert s.to_dict()["stages"][0]["stage"] == "lookup"
