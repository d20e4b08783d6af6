"""Run comparison: a planted remote_read regression is named; equal runs name nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from agent.runstore import RunStoreWriter
from agent.runstore.reader import to_pandas
from agent.schema import TABLES
from analyzers.accounting import TokenAccounting, token_accounting
from analyzers.compare import compare, compare_frames
from analyzers.report import render_comparison
from analyzers.ttft import partition
from tests.conftest import GOLDEN_RUN
from tests.synthetic_run import SyntheticConfig, generate


def _frames(cfg: SyntheticConfig) -> tuple[pd.DataFrame, TokenAccounting]:
    t = generate(cfg)
    req = to_pandas(t["requests"], TABLES["requests"])
    return partition(req, to_pandas(t["spans"], TABLES["spans"])), token_accounting(req)


@pytest.fixture(scope="module")
def baseline() -> tuple[pd.DataFrame, TokenAccounting]:
    return _frames(SyntheticConfig(requests=1500, seed=1))


def test_planted_remote_read_regression_is_named(baseline: tuple) -> None:
    slow = _frames(SyntheticConfig(requests=1500, seed=2, remote_read_scale=8.0))
    c = compare_frames(*baseline, *slow, n_boot=500)
    assert c.moved_most == "remote_read"
    assert ": remote_read +" in c.verdict
    st = c.stages.set_index("stage")
    assert st.loc["remote_read", "delta_p99_low_ns"] > 0  # beyond noise at p99
    assert st.loc["ttft", "delta_p99_low_ns"] > 0
    # On the verdict's basis the per-stage changes add up to the TTFT change exactly.
    basis = f"delta_{c.basis}_ns"
    assert st[basis].drop("ttft").sum() == pytest.approx(st.loc["ttft", basis], rel=1e-9)
    assert st["explains"].drop("ttft").sum() == pytest.approx(1.0, rel=1e-9)


def test_planted_queue_regression_names_queue_not_remote_read(baseline: tuple) -> None:
    slow = _frames(SyntheticConfig(requests=1500, seed=2, queue_scale=6.0))
    c = compare_frames(*baseline, *slow, n_boot=500)
    assert c.moved_most == "queue"


def test_same_workload_other_seed_is_within_noise(baseline: tuple) -> None:
    c = compare_frames(*baseline, *_frames(SyntheticConfig(requests=1500, seed=2)),
                       n_boot=500)
    assert "no TTFT change beyond noise" in c.verdict
    ttft = c.stages.set_index("stage").loc["ttft"]
    assert ttft["delta_p50_low_ns"] < 0 < ttft["delta_p50_high_ns"]


def test_accounting_deltas_carry_both_sides(baseline: tuple) -> None:
    more_remote = _frames(SyntheticConfig(requests=1500, seed=1, remote_share=0.5,
                                          device_share=0.1))
    c = compare_frames(*baseline, *more_remote, n_boot=200)
    row = c.accounting.set_index("key").loc["remote_loaded_share"]
    a, b = baseline[1].ratio("remote_loaded_share"), more_remote[1].ratio("remote_loaded_share")
    assert (row["a_numerator"], row["a_denominator"]) == (a.numerator, a.denominator)
    assert (row["b_numerator"], row["b_denominator"]) == (b.numerator, b.denominator)
    assert row["delta"] == pytest.approx(100 * (b.value - a.value))
    assert row["delta_unit"] == "pts"


def test_compare_reads_run_directories_and_renders(tmp_path: Path) -> None:
    for name, cfg in (("a", SyntheticConfig(requests=300, seed=1)),
                      ("b", SyntheticConfig(requests=300, seed=2, remote_read_scale=10.0))):
        w = RunStoreWriter(tmp_path / name, run_id=name)
        w.write_all(generate(cfg))
        w.close()
    c = compare(tmp_path / "a", tmp_path / "b", n_boot=300)
    assert c.moved_most == "remote_read"
    assert c.a_label.endswith("a") and c.requests_a == 300
    text = render_comparison(c, "text")
    assert text.splitlines()[0] == "kvscope compare" and "verdict: " in text
    md = render_comparison(c, "markdown")
    assert "| stage | A p50 |" in md
    doc = json.loads(render_comparison(c, "json"))
    assert doc["kvscope_compare"] == 1 and doc["moved_most"] == "remote_read"
    assert {r["stage"] for r in doc["stages"]} >= {"remote_read", "ttft"}


def test_golden_against_itself_moves_nothing() -> None:
    c = compare(GOLDEN_RUN, GOLDEN_RUN, n_boot=200)
    assert c.moved_most is None
    assert (c.stages["delta_p50_ns"] == 0).all() and (c.stages["delta_p99_ns"] == 0).all()
    assert (c.accounting["delta"] == 0).all()
