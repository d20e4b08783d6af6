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


def _part(rows: list[tuple[str, dict[str, int]]]) -> pd.DataFrame:
    """A partition frame by hand: each request's stages; ttft is their sum."""
    from analyzers.frames import STAGE_COLUMNS

    out = []
    for rid, stages in rows:
        row = {c: 0 for c in STAGE_COLUMNS}
        row.update({f"{k}_ns": v for k, v in stages.items()})
        row["request_id"] = rid
        row["ttft_ns"] = sum(row[c] for c in STAGE_COLUMNS)
        out.append(row)
    return pd.DataFrame(out)


def test_request_movers_by_hand() -> None:
    from analyzers.compare import request_movers

    a = _part([("r1", {"queue": 100, "prefill": 900}), ("r2", {"prefill": 1000}),
               ("r3", {"remote_read": 500, "prefill": 500}), ("only-a", {"prefill": 5})])
    b = _part([("r1", {"queue": 4000, "prefill": 800}),      # +3,800: queue +3,900
               ("r2", {"prefill": 1000}),                     # unchanged: not listed
               ("r3", {"remote_read": 100, "prefill": 300}),  # -600: prefill -200, read -400
               ("only-b", {"prefill": 5})])
    m = request_movers(a, b, n=5)
    assert list(m["request_id"]) == ["r1", "r3"]  # largest increase first, then decreases
    r1, r3 = m.iloc[0], m.iloc[1]
    assert (r1["a_ttft_ns"], r1["b_ttft_ns"], r1["delta_ns"]) == (1000, 4800, 3800)
    assert (r1["stage"], r1["stage_delta_ns"]) == ("queue", 3900)
    assert (r3["delta_ns"], r3["stage"], r3["stage_delta_ns"]) == (-600, "remote_read", -400)
    assert request_movers(a, b, n=1)["request_id"].tolist() == ["r1", "r3"]
    assert request_movers(a.iloc[:0], b).empty


def _req(rows: list[dict[str, int]]) -> pd.DataFrame:
    cols = ("device_hit", "host_loaded", "remote_loaded", "recomputed")
    return pd.DataFrame([{"first_token_ns": r.get("first_token_ns", 1),  # None: no first token
                          **{f"{c}_tokens": r.get(c, 0) for c in cols}} for r in rows])


def test_source_split_names_the_stage_that_ate_the_saving() -> None:
    from analyzers.compare import source_split

    # A recomputes 1,000 tokens per request; B loads 800 of them from the remote, which at
    # 1,000 ns/token should save 800,000 ns of prefill; B's TTFT instead rose, its loads took
    # 1,500,000 ns more and prefill 700,000 ns less.
    req_a = _req([{"recomputed": 1000}, {"recomputed": 1000}])
    req_b = _req([{"remote_loaded": 800, "recomputed": 200},
                  {"remote_loaded": 800, "recomputed": 200}])
    pa = _part([("x", {"prefill": 1_000_000}), ("y", {"prefill": 1_000_000})])
    pb = _part([("x", {"remote_read": 1_200_000, "h2d": 300_000, "prefill": 300_000}),
                ("y", {"remote_read": 1_200_000, "h2d": 300_000, "prefill": 300_000})])
    s = source_split(req_a, req_b, pa, pb, per_token_ns=1000.0)
    assert s is not None
    t = s["tokens_per_request"]
    assert t["recomputed"] == {"a": 1000.0, "b": 200.0, "delta": -800.0}
    assert t["remote_loaded"]["delta"] == 800.0 and s["reused_delta_tokens"] == 800.0
    assert s["expected_prefill_delta_ns"] == -800_000.0
    assert s["stage_mean_ns"]["prefill"]["delta_ns"] == -700_000.0
    assert s["load_delta_ns"] == 1_500_000.0
    assert s["stage_mean_ns"]["ttft"]["delta_ns"] == 800_000.0
    assert s["ate"] == "loads"
    # The same saving kept (TTFT fell by more than expected): nothing ate it.
    pb_fast = _part([("x", {"remote_read": 50_000, "prefill": 100_000}),
                     ("y", {"remote_read": 50_000, "prefill": 100_000})])
    assert source_split(req_a, req_b, pa, pb_fast, per_token_ns=1000.0)["ate"] is None
    # No fitted cost: the token view stands, no expectation.
    s = source_split(req_a, req_b, pa, pb, per_token_ns=None)
    assert s["expected_prefill_delta_ns"] is None and s["ate"] is None
    # Requests without a first token are left out of the means.
    req_b2 = pd.concat([req_b, _req([{"recomputed": 99_999, "first_token_ns": None}])])
    assert source_split(req_a, req_b2, pa, pb, 1000.0)["tokens_per_request"]["recomputed"][
        "b"] == 200.0
    assert source_split(req_a.drop(columns="host_loaded_tokens"), req_b, pa, pb, 1.0) is None


def test_factor_diff_reads_run_commands_and_start_state() -> None:
    from analyzers.compare import factor_diff

    def meta(cmd: list[str], objects: int | None, host: int | None = 0) -> dict:
        return {"config": {"command": cmd,
                           "tiers": {"remote": {"objects_at_start": objects},
                                     "host": {"blocks_at_start": host}}}}

    base = ["kvscope", "run", "--workload", "docqa", "--remote", "redis://127.0.0.1:6379/0",
            "--metrics-port", "9400"]
    factors, start = factor_diff(meta(base, 0), meta(base, 127))
    assert factors == [] and start == {"a": {"remote_objects": 0, "host_blocks": 0},
                                       "b": {"remote_objects": 127, "host_blocks": 0}}
    other = [*base[:-1], "9500", "--fault", "remote-latency=20ms", "--no-host-write",
             "--fault", "remote-error-rate=0.1"]
    factors, _ = factor_diff(meta(base, 0), meta(other, 0))
    assert factors == [  # --metrics-port changes only where /metrics is served
        {"flag": "--fault", "a": None, "b": "remote-latency=20ms, remote-error-rate=0.1"},
        {"flag": "--host-write", "a": None, "b": "off"}]
    rate = [*base, "--rate", "8"]
    assert factor_diff(meta([*base, "--rate", "4"], 0), meta(rate, 0))[0] == [
        {"flag": "--rate", "a": "4", "b": "8"}]
    # Imported or older runs carry no command: no factors, start state unknown.
    factors, start = factor_diff({"config": {"tiers": {"remote": "off"}}}, {})
    assert factors == [] and start["a"] == {"remote_objects": None, "host_blocks": None}
