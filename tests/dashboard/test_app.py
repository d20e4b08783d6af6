"""Every dashboard page under Streamlit's AppTest: the golden run, a real engine run, an imported
trace, an empty run, two runs compared; no exception and the analyzers' figures on the page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from agent.runstore import RunStoreWriter, open_run
from analyzers.accounting import layer_table, token_accounting
from analyzers.compare import compare_frames
from analyzers.ttft import partition, summarize
from analyzers.units import fmt_ns
from tests.conftest import GOLDEN_RUN, REPO, shared_data

APP = REPO / "dashboard" / "streamlit_app.py"
PAGES = ("overview", "requests", "kv_cache", "hardware")


def app(runs: list[Path | str], page: str | None = None, *, run: bool = True) -> AppTest:
    """The dashboard over `runs`, switched to `page`, run once, with no exception."""
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.session_state["kvscope_runs"] = [str(r) for r in runs]
    if page is not None:
        at.run()  # registers the pages (Compare only with two runs)
        at.switch_page(f"views/{page}.py")
    if run:
        at.run()
        assert not at.exception, [e.message for e in at.exception]
    return at


def charts(at: AppTest) -> list[dict[str, Any]]:
    """The charts on the page as their JSON specs: Plotly figures, then ECharts options."""
    return [json.loads(c.proto.spec) for kind in ("plotly_chart", "echarts_chart")
            for c in at.get(kind)]


def chart_title(spec: dict[str, Any]) -> str:
    """A Plotly figure's title, or an ECharts option's (its first title)."""
    if "layout" in spec:
        return str(spec["layout"].get("title", {}).get("text", ""))
    title = spec.get("title", {})
    return str((title[0] if isinstance(title, list) else title).get("text", ""))


def chart(at: AppTest, title_start: str) -> dict[str, Any]:
    found = [c for c in charts(at) if chart_title(c).startswith(title_start)]
    assert len(found) == 1, [chart_title(c) for c in charts(at)]
    return found[0]


def markdown_table(at: AppTest, key_col: str) -> pd.DataFrame:
    """The first Markdown table on the page with column `key_col`, as strings."""
    for md in at.markdown:
        lines = [ln for ln in str(md.value).splitlines() if ln.startswith("|")]
        if len(lines) < 2:
            continue
        rows = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines]
        if key_col in rows[0]:
            return pd.DataFrame(rows[2:], columns=rows[0])
    raise AssertionError(f"no Markdown table with column {key_col!r}")


def texts(at: AppTest) -> str:
    """Every piece of text on the page (markdown, captions, alerts, titles), joined."""
    parts = [e.value for kind in ("title", "subheader", "markdown", "caption", "info",
                                  "warning", "error", "success") for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


def table(at: AppTest, key_col: str) -> Any:
    """The first dataframe on the page that has column `key_col`."""
    for df in at.dataframe:
        if key_col in df.value.columns:
            return df.value
    raise AssertionError(f"no dataframe with column {key_col!r}")


@pytest.fixture(scope="module")
def golden() -> Path:
    if not (GOLDEN_RUN / "run.json").exists():
        pytest.skip("golden run store not built")
    return GOLDEN_RUN


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of the instrumented engine (tiny model, CPU)."""
    from kvscope.session import RunOptions, run_session

    out = tmp_path_factory.mktemp("engine") / "run"
    run_session(RunOptions(workload="docqa", num_requests=6, rate=0, model="tiny", out=out,
                           metrics_port=0, threads=1))
    return out


@pytest.fixture(scope="module")
def empty_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("empty") / "run"
    RunStoreWriter(out, run_id="empty").close()
    return out


# ---- every page, every kind of run: no exception ---------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_the_golden_run(golden: Path, page: str) -> None:
    at = app([golden], page)
    assert at.title[0].value == {"overview": "Overview", "requests": "Requests",
                                 "kv_cache": "KV cache", "hardware": "Hardware"}[page]
    assert at.caption[0].value == "golden · run store · 10 requests"
    assert charts(at)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_an_engine_run(engine_run: Path, page: str) -> None:
    at = app([engine_run], page)
    assert " · run store · 6 requests" in at.caption[0].value
    assert not at.error
    assert charts(at)


@pytest.mark.parametrize("page", PAGES)
def test_an_empty_run_says_so_on_every_page(empty_run: Path, page: str) -> None:
    at = app([empty_run], page)
    text = texts(at)
    expected = {
        "overview": "This run has no requests: there is no TTFT to break down.",
        "requests": "This run has no requests.",
        "kv_cache": "No token accounting in this run (nothing was recorded for it in this run).",
        "hardware": "No hardware samples (NVML, NIC, RDMA, host) in this run",
    }[page]
    assert expected in text


@pytest.mark.parametrize("page", PAGES)
def test_an_imported_trace_shows_what_it_has_and_what_is_missing(page: str) -> None:
    trace = shared_data("kineto/sampled_rank-0.json.gz")
    at = app([trace], page)
    assert at.caption[0].value == "sampled_rank-0.json.gz · kineto · 0 requests"
    assert at.expander[0].label.startswith("What this run is missing")
    notes = texts(at)
    assert "imported from kineto: no layers, hardware samples or events tables" in notes
    assert "cannot: token sources (hits, loads, recompute): accounting columns left <NA>" in notes


def test_no_run_and_a_missing_run_are_one_clear_error(tmp_path: Path) -> None:
    assert app([]).error[0].value.startswith("No run given. Start the dashboard with")
    at = app([tmp_path / "nope"])
    assert at.error[0].value == f"{tmp_path / 'nope'}: no such run directory or file"


def test_compare_is_offered_only_with_two_runs(golden: Path) -> None:
    at = app([golden])
    with pytest.raises(ValueError, match="Known pages"):
        at.switch_page("views/compare.py")


# ---- the figures on the page are the analyzers' ----------------------------------------------


def test_overview_shows_the_partition_summary_and_findings(golden: Path) -> None:
    run = open_run(golden)
    summary = summarize(partition(run.requests, run.spans))
    acct = token_accounting(run.requests)
    at = app([golden], "overview")
    metrics = {m.label: m.value for m in at.metric}
    hit = acct.ratio("token_hit_share")
    assert metrics == {
        "Requests with a first token": "9", "Without a first token": "1",
        "TTFT p50": fmt_ns(summary.stage("ttft")["p50_ns"]),
        "TTFT p99": fmt_ns(summary.stage("ttft")["p99_ns"]),
        "Token hit share": f"{100 * hit.value:.1f} %",
        "Failed-load tokens": f"{acct.totals['load_failed_tokens']:,}"}
    assert f"{hit.numerator:,} / {hit.denominator:,} {hit.unit}" in texts(at)
    # Where the KV came from, beside where TTFT went.
    sources = chart(at, "Where the prompt tokens' KV came from")
    assert [s["data"][0] for s in sources["series"]] == [
        acct.totals[f"{s}_tokens"] for s in ("device_hit", "host_loaded", "remote_loaded",
                                             "recomputed")]
    # Failures, breaker and evictions on TTFT's time axis (seconds since the run's start).
    inc = chart(at, "TTFT, failures, breaker and evictions on one time axis")
    names = [s["name"] for s in inc["series"]]
    assert names[:3] == ["TTFT p50", "TTFT p90", "TTFT p99"]
    assert {"failed requests", "requests with a failed load", "evicted blocks",
            "breaker open"} <= set(names)
    assert any(s.get("markArea", {}).get("data") for s in inc["series"])  # breaker shaded
    origin = run.meta["start_ns"]
    windows = summarize(partition(run.requests, run.spans), origin_ns=origin).windows
    p99 = inc["series"][2]["data"]
    assert [x for x, _ in p99] == list(windows["window_start_s"])
    assert [y for _, y in p99] == pytest.approx(list(windows["ttft_p99_ns"] / 1e6))
    bars = chart(at, "Where TTFT went: mean by stage")
    assert [s["name"] for s in bars["series"]] == ["lookup", "queue", "remote_read", "h2d",
                                                   "sync", "prefill", "other"]
    assert bars["xAxis"]["data"] == ["all", "slowest 1 % (≥ p99)", "hit class: cold",
                                     "hit class: full", "hit class: partial"]
    means = summary.stages.set_index("stage")["mean_ns"]
    assert [s["data"][0] for s in bars["series"]] == pytest.approx(
        [means[s] / 1e6 for s in ("lookup", "queue", "remote_read", "h2d", "sync", "prefill",
                                  "other")], abs=1e-4)
    stages = markdown_table(at, "p99")
    assert list(stages["stage"])[:7] == ["lookup", "queue", "remote_read", "h2d", "sync",
                                         "prefill", "other"]
    ttft_row = stages.loc[stages["stage"] == "ttft"].iloc[0]
    assert ttft_row["p99"] == fmt_ns(summary.stage("ttft")["p99_ns"])
    assert "Top findings" in texts(at)


def test_overview_groups_by_the_chosen_column(golden: Path) -> None:
    at = app([golden], "overview")
    at.radio(key="overview_group").set_value("tenant").run()
    assert not at.exception
    assert chart(at, "Where TTFT went")["xAxis"]["data"][2:] == [
        "tenant: acme", "tenant: globex"]


def test_requests_page_waterfall_and_accounting(golden: Path) -> None:
    run = open_run(golden)
    at = app([golden], "requests")
    picker = at.selectbox(key="request_pick")
    part = partition(run.requests, run.spans)
    slowest = part.sort_values("ttft_ns", ascending=False)["request_id"].iloc[0]
    assert picker.value == slowest
    at.text_input(key="request_typed").set_value("req-remote").run()
    assert not at.exception
    fig = chart(at, "req-remote: stages and transfers")
    names = [t["name"] for t in fig["data"]]
    assert {"lookup", "queue", "remote_read", "h2d", "sync", "prefill", "decode"} <= set(names)
    rows = {r for t in fig["data"] for r in t["y"]}
    assert "stages" in rows and any(r.startswith("remote_read") for r in rows if r != "stages")
    acct = token_accounting(run.requests.loc[run.requests["request_id"] == "req-remote"])
    ratios = table(at, "measure")
    assert str(acct.ratio("remote_loaded_share")) in list(ratios["value"])
    assert str(acct.ratio("token_hit_share")) in list(ratios["value"])
    stage_rows = table(at, "time")
    row = part.loc[part["request_id"] == "req-remote"].iloc[0]
    assert list(stage_rows["time"])[2] == fmt_ns(int(row["remote_read_ns"]))


def test_requests_page_unknown_id(golden: Path) -> None:
    at = app([golden], "requests")
    at.text_input(key="request_typed").set_value("nope").run()
    assert at.error[0].value == "No request 'nope' in this run."


def test_requests_page_request_without_first_token(golden: Path) -> None:
    at = app([golden], "requests")
    at.text_input(key="request_typed").set_value("req-error").run()
    assert not at.exception
    assert {m.label: m.value for m in at.metric}["TTFT"] == "-"
    assert "This request produced no first token" in texts(at)


def test_kv_cache_page_prints_denominators(golden: Path) -> None:
    run = open_run(golden)
    acct = token_accounting(run.requests)
    at = app([golden], "kv_cache")
    captions = [c.value for c in at.caption]
    for key in ("token_hit_share", "device_hit_share", "host_loaded_share",
                "remote_loaded_share", "prompt_recomputed"):
        assert str(acct.ratio(key)) in captions
    assert str(acct.ratio("token_hit_share")).endswith(" lookup tokens (" + str(
        f"{100 * acct.ratio('token_hit_share').value:.1f} %)"))
    assert list(table(at, "value")["value"]) == [str(r) for r in acct.ratios]
    assert list(table(at, "promised_tokens")["tier"]) == ["device", "host", "remote"]
    heat = chart(at, "Share of prompt tokens by layer")
    expected = layer_table(run.layers)
    assert heat["data"][0]["y"] == ["hit", "loaded", "recomputed"]
    assert list(heat["data"][0]["x"]) == [str(x) for x in expected["layer"]]
    pool = chart(at, "Block pool states over time")
    assert [t["name"] for t in pool["data"]] == ["device cached_free", "device empty",
                                                 "device in_use"]
    evictions = open_run(golden).events
    n = int((evictions["name"] == "eviction").sum())
    chart(at, f"{n:,} eviction event(s)")


def test_hardware_page_shares_the_time_axis(golden: Path) -> None:
    at = app([golden], "hardware")
    fig = chart(at, "Hardware and TTFT on one time axis")
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles == ["TTFT (ms)", "gpu_pcie_receive_bytes_per_second",
                      "nic_receive_bytes_per_second"]
    # One time axis: every row's x axis follows the bottom one, all in seconds since the
    # run's start (the report's and `kvscope timeline --window`'s time base).
    assert fig["layout"]["xaxis"]["matches"] == fig["layout"]["xaxis2"]["matches"] == "x3"
    assert {fig["layout"][k]["type"] for k in ("xaxis", "xaxis2", "xaxis3")} == {"linear"}
    assert fig["layout"]["xaxis3"]["title"]["text"] == "seconds since run start"
    names = [t["name"] for t in fig["data"]]
    assert names[:3] == ["TTFT p50", "TTFT p90", "TTFT p99"]
    assert "eth0 receive" in names  # entity + short metric name, not "nic eth0 nic_…"
    # Each row's axis in its metric's unit (bytes per second), not Plotly's "25.3B".
    assert fig["layout"]["yaxis2"]["ticksuffix"] == "B/s"
    assert fig["layout"]["yaxis2"]["tickformat"] == "~s"


@pytest.fixture(scope="module")
def no_samples_run(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden run's requests and spans only: a partial run without collector samples."""
    out = tmp_path_factory.mktemp("partial") / "run"
    tables = open_run(golden).tables
    w = RunStoreWriter(out, run_id="partial")
    w.write_all({"requests": tables["requests"], "spans": tables["spans"]})
    w.close()
    return out


@pytest.mark.parametrize("page", PAGES)
def test_a_run_without_samples_layers_or_events(no_samples_run: Path, page: str) -> None:
    at = app([no_samples_run], page)
    expected = {
        "overview": ["Top findings"],
        "requests": ["Token accounting"],
        "kv_cache": ["No per-layer rows in this run", "No block-pool samples in this run",
                     "No eviction events in this run"],
        "hardware": ["No hardware samples (NVML, NIC, RDMA, host) in this run"],
    }[page]
    for line in expected:
        assert line in texts(at)
    assert charts(at)


def test_hardware_page_without_samples_still_draws_ttft(no_samples_run: Path) -> None:
    at = app([no_samples_run], "hardware")
    assert "No hardware samples (NVML, NIC, RDMA, host) in this run" in texts(at)
    fig = chart(at, "Hardware and TTFT on one time axis")
    assert [t["name"] for t in fig["data"]] == ["TTFT p50", "TTFT p90", "TTFT p99"]


def test_compare_page_shows_the_verdict(golden: Path, engine_run: Path) -> None:
    at = app([golden, engine_run], "compare")
    a, b = open_run(golden), open_run(engine_run)
    pa_, pb_ = partition(a.requests, a.spans), partition(b.requests, b.spans)
    expected = compare_frames(pa_, token_accounting(a.requests), pb_,
                              token_accounting(b.requests), a_label="golden",
                              b_label=b.meta["run_id"], n_boot=2000)  # the CLI's
    assert at.info[0].value == expected.verdict
    stages = table(at, "A p99")
    assert list(stages["stage"]) == list(expected.stages["stage"])
    assert list(stages["A p99"]) == [fmt_ns(v) for v in expected.stages["a_p99_ns"]]
    acc = table(at, "measure")
    hit = acc.loc[acc["measure"] == "token hit share (KV reused)"].iloc[0]
    acct_a, acct_b = token_accounting(a.requests), token_accounting(b.requests)
    assert hit["A"] == str(acct_a.ratio("token_hit_share"))
    assert hit["B"] == str(acct_b.ratio("token_hit_share"))
    rate = acc.loc[acc["measure"] == acct_a.ratio("h2d_bytes_per_loaded_token").label].iloc[0]
    assert rate["A"] == str(acct_a.ratio("h2d_bytes_per_loaded_token"))  # bytes each, not %
    assert chart(at, "Stage percentiles, A vs B")["data"][0]["name"] == "A: golden"


def test_a_second_run_is_picked_in_the_sidebar(golden: Path, engine_run: Path) -> None:
    at = app([golden, engine_run], "overview")
    assert at.caption[0].value.startswith("golden · ")
    # The selector lists the runs by the label the captions and legends use (the run id).
    picker = at.sidebar.selectbox(key="kvscope_selected_run")
    run_id = open_run(engine_run).meta["run_id"]
    assert picker.options == ["golden", run_id]
    picker.set_value(run_id).run()
    assert not at.exception
    assert " · run store · 6 requests" in at.caption[0].value
