"""The dashboard's loading layer (`dashboard.data`) and figure builders (`dashboard.figures`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from agent.runstore import RunStoreWriter, open_run
from agent.schema import TABLES, TTFT_STAGES
from dashboard import data, echarts, figures
from tests.conftest import GOLDEN_RUN


def _sample_table(ts: list[int], values: list[float]) -> pa.Table:
    n = len(ts)
    return pa.table({"ts_ns": ts, "source": ["nic"] * n, "entity": ["eth0"] * n,
                     "metric": ["nic_receive_bytes_total"] * n, "value": values,
                     "unit": ["bytes"] * n}, schema=TABLES["samples"])


def test_run_version_changes_when_a_part_is_added(tmp_path: Path) -> None:
    w = RunStoreWriter(tmp_path / "run", run_id="grow")
    w.write("samples", _sample_table([1_000_000_000], [0.0]))
    before = data.run_version(tmp_path / "run")
    os.utime(tmp_path / "run" / "samples", ns=(before - 10**9, before - 10**9))
    os.utime(tmp_path / "run" / "run.json", ns=(before - 10**9, before - 10**9))
    os.utime(tmp_path / "run", ns=(before - 10**9, before - 10**9))
    older = data.run_version(tmp_path / "run")
    w.write("samples", _sample_table([2_000_000_000], [1.0]))
    assert data.run_version(tmp_path / "run") > older
    with pytest.raises(FileNotFoundError):
        data.run_version(tmp_path / "missing")


def test_counters_become_rates_and_gauges_stay(tmp_path: Path) -> None:
    w = RunStoreWriter(tmp_path / "run", run_id="rates")
    t0 = 1_700_000_000_000_000_000
    w.write("samples", pa.concat_tables([
        _sample_table([t0, t0 + 500_000_000, t0 + 1_500_000_000], [100.0, 600.0, 2600.0]),
        pa.table({"ts_ns": [t0], "source": ["nvml"], "entity": ["0"],
                  "metric": ["gpu_utilization_ratio"], "value": [0.5], "unit": ["ratio"]},
                 schema=TABLES["samples"]),
        pa.table({"ts_ns": [t0], "source": ["pool"], "entity": ["device"],
                  "metric": ["in_use"], "value": [7.0], "unit": ["blocks"]},
                 schema=TABLES["samples"]),
    ]))
    w.close()
    path = str(tmp_path / "run")
    hw = data.hardware_series(path, data.run_version(path))
    nic = hw.loc[hw["source"] == "nic"]
    assert list(nic["metric"]) == ["nic_receive_bytes_per_second"] * 2
    assert list(nic["value"]) == [1000.0, 2000.0]  # 500 B in 0.5 s, 2000 B in 1 s
    assert list(nic["unit"]) == ["bytes/s", "bytes/s"]
    assert list(nic["ts_ns"]) == [t0 + 500_000_000, t0 + 1_500_000_000]
    gpu = hw.loc[hw["source"] == "nvml"]
    assert list(gpu["value"]) == [0.5]
    assert "pool" not in set(hw["source"])
    pool = data.pool_states(path, data.run_version(path))
    assert list(pool["metric"]) == ["in_use"] and list(pool["value"]) == [7.0]


def test_golden_events_and_request_detail() -> None:
    path = str(GOLDEN_RUN)
    version = data.run_version(path)
    ev = data.events_named(path, version, "eviction")
    assert len(ev) == 1 and ev["detail"].iloc[0] == '{"blocks": 16, "tier": "host"}'
    req, part, spans = data.request_detail(path, version, "req-remote")
    assert list(req["request_id"]) == list(part["request_id"]) == ["req-remote"]
    run = open_run(GOLDEN_RUN).spans
    own = run.loc[run["request_id"] == "req-remote"]
    waited = {int(x) for w in own["waits_on"].dropna() for x in w}
    expected = run.loc[(run["request_id"] == "req-remote") | run["transfer_id"].isin(waited)]
    assert sorted(spans.index) == sorted(expected.index)
    assert spans["start_ns"].is_monotonic_increasing
    assert data.request_detail(path, version, "nope") is None
    assert data.slowest_requests(path, version)[-1] == "req-error"  # no TTFT: last


def test_figures_draw_empty_inputs() -> None:
    empty_windows = pd.DataFrame(columns=["window_start_ns", "ttft_p50_ns", "ttft_p90_ns",
                                          "ttft_p99_ns"])
    no_incidents = pd.DataFrame(columns=["window_start_s", "failed_requests",
                                         "failed_load_requests", "remote_errors",
                                         "evicted_blocks"])
    no_breaker = pd.DataFrame(columns=["op", "start_s", "end_s", "closed"])
    inc = echarts.incidents(empty_windows, no_incidents, no_breaker, origin_ns=0).option
    assert [s["name"] for s in inc["series"]] == [
        "failed requests", "requests with a failed load", "remote operation errors",
        "evicted blocks"]
    assert all(s["data"] == [] for s in inc["series"])
    json.dumps(inc, allow_nan=False)  # what st.echarts_chart sends: plain JSON
    samples = pd.DataFrame(columns=list(TABLES["samples"].names))
    fig = figures.hardware(empty_windows, samples, [], origin_ns=0)
    assert fig.layout.title.text == "Hardware and TTFT on one time axis"
    spans = pd.DataFrame(columns=list(TABLES["spans"].names))
    assert figures.request_waterfall(spans, 0, title="r").layout.title.text == "r (no spans)"


def test_time_charts_count_seconds_from_the_runs_start() -> None:
    """The dashboard's time axes are the report's: seconds since run.json's start_ns."""
    from agent.runstore import open_run
    from analyzers.ttft import partition, summarize
    from tests.conftest import GOLDEN_RUN

    run = open_run(GOLDEN_RUN)
    origin = run.meta["start_ns"]
    windows = summarize(partition(run.requests, run.spans), origin_ns=origin).windows
    inc = data.incidents(str(GOLDEN_RUN), data.run_version(str(GOLDEN_RUN)))
    chart = echarts.incidents(windows, inc.windows, inc.breaker, origin_ns=origin).option
    p50 = chart["series"][0]
    assert [x for x, _ in p50["data"]] == list(windows["window_start_s"])
    assert p50["data"][0][0] == 0.0 and chart["xAxis"][2]["name"] == figures.TIME_AXIS
    # Every row on one x range: the TTFT windows and the incident windows alike.
    assert len({(a["min"], a["max"]) for a in chart["xAxis"]}) == 1
    failed = next(s for s in chart["series"] if s["name"] == "failed requests")
    assert [x for x, _ in failed["data"]] == pytest.approx(list(inc.windows["window_start_s"]))
    assert [y for _, y in failed["data"]] == list(inc.windows["failed_requests"])
    ev = run.events
    hist = figures.event_counts(ev, title="e", origin_ns=origin)
    assert list(hist.data[0].x) == list((ev["ts_ns"].astype("int64") - origin) / 1e9)


def test_stage_breakdown_stacks_every_stage_in_ms() -> None:
    groups = {"all": {s: 1_000_000.0 * (i + 1) for i, s in enumerate(TTFT_STAGES)},
              "cold": {"queue": 2_500_000.0}}
    opt = echarts.stage_breakdown(groups).option
    assert [s["name"] for s in opt["series"]] == list(TTFT_STAGES)
    assert [s["data"][0] for s in opt["series"]] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert {s["stack"] for s in opt["series"]} == {"ttft"}
    # A stage a group lacks is a gap (null), not zero.
    assert [s["data"][1] for s in opt["series"]] == [None, 2.5, None, None, None, None, None]
    assert opt["xAxis"]["data"] == ["all", "cold"]
    json.dumps(opt, allow_nan=False)


def test_token_sources_bar_names_counts_and_shares() -> None:
    opt = echarts.token_sources({"device_hit": 30, "host_loaded": 10, "remote_loaded": 0,
                                 "recomputed": 60}, title="t").option
    assert [s["name"] for s in opt["series"]] == [
        "device hit: 30 (30.0 %)", "host loaded: 10 (10.0 %)", "remote loaded: 0 (0.0 %)",
        "recomputed: 60 (60.0 %)"]
    assert [s["data"] for s in opt["series"]] == [[30], [10], [0], [60]]
    assert opt["xAxis"]["max"] == 100
    empty = echarts.token_sources({}, title="t").option
    assert empty["series"][0]["name"] == "device hit: 0"


def test_waterfall_is_relative_to_arrival() -> None:
    spans = pd.DataFrame({"kind": ["state", "state", "activity"],
                          "name": ["queue", "prefill", "h2d"],
                          "start_ns": [1_000, 3_000_000, 1_500_000],
                          "end_ns": [3_000_000, 5_000_000, 2_500_000],
                          "tier": [None, None, "host"], "bytes": [None, None, 4096]})
    fig = figures.request_waterfall(spans, 1_000, title="t")
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["queue"].base) == [0.0] and list(by_name["queue"].x) == [2.999]
    assert list(by_name["h2d"].y) == ["h2d host"] and list(by_name["prefill"].y) == ["stages"]
    assert np.isclose(by_name["h2d"].base[0], 1.499)


def test_thin_keeps_the_extremes_of_every_bucket() -> None:
    n = 1000
    value = np.zeros(n)
    value[123], value[777] = 50.0, -5.0  # one spike, one dip
    df = pd.DataFrame({"ts_ns": np.arange(n), "source": "nvml", "entity": "0",
                       "metric": "m", "value": value, "unit": "x"})
    other = df.assign(metric="short").iloc[:10]
    both = pd.concat([df, other], ignore_index=True)
    out = data.thin(both, max_points=100)
    long = out.loc[out["metric"] == "m"]
    assert len(long) <= 100 and {50.0, -5.0} <= set(long["value"])
    assert long["ts_ns"].is_monotonic_increasing
    assert len(out.loc[out["metric"] == "short"]) == 10  # short series untouched
    assert data.thin(other, max_points=100) is other


def _pool_run(tmp_path: Path) -> str:
    """Block states of the device and host pools (≤ 96 blocks) beside the end-of-run tier
    counters the engine also records as source ``pool`` (bytes up to millions), remote error
    counters over time, breaker events and evictions."""
    w = RunStoreWriter(tmp_path / "run", run_id="pool", config={"x": 1})
    t0 = w.anchor.wall_ns + 10**8  # run.json's start_ns: the run's time origin
    rows = [
        (t0, "pool", "device", "in_use", 90.0, "blocks"),
        (t0, "pool", "device", "empty", 6.0, "blocks"),
        (t0, "pool", "host", "cached_free", 32.0, "blocks"),
        (t0 + 2 * 10**9, "pool", "host", "bytes_written", 10_485_760.0, None),
        (t0 + 2 * 10**9, "pool", "remote", "ops_write", 541.0, None),
        (t0 + 2 * 10**9, "pool", "host", "evictions", 810.0, None),
        (t0, "pool", "remote", "remote_read_error", 1.0, "operations"),
        (t0 + 10**9, "pool", "remote", "remote_read_error", 4.0, "operations"),
        (t0, "host", "host", "host_memory_total_bytes", 6.4e10, "bytes"),
        (t0 + 10**9, "host", "host", "host_memory_total_bytes", 6.4e10, "bytes"),
        (t0, "host", "host", "host_cpu_utilization_ratio", 0.2, "ratio"),
        (t0 + 10**9, "host", "host", "host_cpu_utilization_ratio", 0.9, "ratio"),
        (t0, "host", "host", "host_memory_used_bytes", 1e9, "bytes"),
        (t0 + 10**9, "host", "host", "host_memory_used_bytes", 2e9, "bytes"),
    ]
    w.write("samples", pa.table({k: [r[i] for r in rows] for i, k in enumerate(
        ("ts_ns", "source", "entity", "metric", "value", "unit"))}, schema=TABLES["samples"]))
    ev = [(t0 + 500_000_000, "engine", "eviction", None, '{"blocks": 16, "tier": "device"}'),
          (t0 + 600_000_000, "remote", "circuit_open", None, '{"op": "read", "failures": 5}'),
          (t0 + 900_000_000, "remote", "circuit_close", None, '{"op": "read"}'),
          (t0 + 950_000_000, "nvml", "collector_unavailable", None,
           '{"collector": "nvml", "reason": "NVML Shared Library Not Found"}')]
    w.write("events", pa.table({k: [r[i] for r in ev] for i, k in enumerate(
        ("ts_ns", "source", "name", "request_id", "detail"))}, schema=TABLES["events"]))
    w.close()
    return str(tmp_path / "run")


def test_pool_states_are_blocks_and_counters_are_a_table(tmp_path: Path) -> None:
    path = _pool_run(tmp_path)
    v = data.run_version(path)
    states = data.pool_states(path, v)
    assert set(states["unit"]) == {"blocks"} and states["value"].max() <= 96
    assert sorted(set(zip(states["entity"], states["metric"], strict=True))) == [
        ("device", "empty"), ("device", "in_use"), ("host", "cached_free")]
    fig = figures.pool_states(states, origin_ns=0)
    assert fig.layout.yaxis.title.text == "blocks"
    counters = data.pool_counters(path, v)
    got = {(e, c): (val, u) for e, c, val, u in counters.itertuples(index=False)}
    assert got[("host", "bytes_written")] == (10_485_760.0, "bytes")
    assert got[("remote", "ops_write")] == (541.0, "operations")
    assert got[("host", "evictions")] == (810.0, "blocks")
    assert got[("remote", "remote_read_error")] == (4.0, "operations")  # the last sample


def test_events_table_is_seconds_since_start_and_fields(tmp_path: Path) -> None:
    path = _pool_run(tmp_path)
    v = data.run_version(path)
    table = data.events_table(path, v, "eviction")
    origin = data.origin_ns(path, v)
    assert list(table.columns) == ["t (s since start)", "source", "request", "blocks", "tier"]
    row = table.iloc[0]
    ts = int(data.events_named(path, v, "eviction")["ts_ns"].iloc[0])
    assert row["t (s since start)"] == (ts - origin) / 1e9
    assert (row["blocks"], row["tier"]) == (16, "device")
    assert "ts_ns" not in table and "detail" not in table


def test_incidents_put_failures_breaker_and_evictions_on_the_time_axis(tmp_path: Path
                                                                        ) -> None:
    path = _pool_run(tmp_path)
    v = data.run_version(path)
    inc = data.incidents(path, v)
    origin = data.origin_ns(path, v)
    assert int(inc.windows["evicted_blocks"].sum()) == 16
    assert int(inc.windows["remote_errors"].sum()) == 4  # 1, then 3 more
    assert inc.remote_errors_from is not None and "remote_<op>_error" in inc.remote_errors_from
    b = inc.breaker.iloc[0]
    assert b["op"] == "read" and bool(b["closed"])
    opened = data.events_named(path, v, "circuit_open")["ts_ns"].iloc[0]
    closed = data.events_named(path, v, "circuit_close")["ts_ns"].iloc[0]
    assert np.isclose(b["start_s"], (int(opened) - origin) / 1e9)
    assert np.isclose(b["end_s"], (int(closed) - origin) / 1e9)
    assert inc.any
    assert data.collector_notes(path, v) == {"nvml": "NVML Shared Library Not Found"}


def test_hardware_defaults_skip_constants_and_axes_carry_units(tmp_path: Path) -> None:
    path = _pool_run(tmp_path)
    series = data.hardware_series(path, data.run_version(path))
    assert data.default_hardware_metrics(series) == ["host_cpu_utilization_ratio",
                                                     "host_memory_used_bytes"]
    fig = figures.hardware(pd.DataFrame(), series, ["host_cpu_utilization_ratio",
                                                    "host_memory_used_bytes"], origin_ns=0)
    assert [t.name for t in fig.data] == ["host cpu utilization", "host memory used"]
    assert fig.layout.yaxis2.tickformat.endswith("%")
    assert (fig.layout.yaxis3.tickformat, fig.layout.yaxis3.ticksuffix) == ("~s", "B")
    assert figures.short_metric("nic", "nic_receive_bytes_per_second") == "receive"
    assert figures.short_metric("nvml", "gpu_pcie_receive_bytes_per_second") == "pcie receive"


def test_waterfall_marks_the_first_token_and_heatmap_has_a_scale_title() -> None:
    spans = pd.DataFrame({"kind": ["state"], "name": ["prefill"], "start_ns": [0],
                          "end_ns": [2_000_000], "tier": [None], "bytes": [None]})
    fig = figures.request_waterfall(spans, 0, title="t", first_token_ns=2_000_000)
    assert [s.x0 for s in fig.layout.shapes] == [2.0]
    assert fig.layout.annotations[0].text == "first token 2.000 ms"
    assert fig.layout.legend.orientation == "v"  # beside the plot, not over the axis title
    table = pd.DataFrame({"layer": [0], "prompt_tokens": [10], **{
        f"{k}_{c}": [v] for k, v in (("hit", 5), ("loaded", 3), ("recomputed", 2))
        for c in ("tokens",)}, "hit_share": [0.5], "loaded_share": [0.3],
        "recomputed_share": [0.2]})
    heat = figures.layer_heatmap(table)
    assert "share of prompt" in heat.data[0].colorbar.title.text


def test_compare_uses_the_clis_resamples() -> None:
    import inspect

    from analyzers.compare import compare_frames

    assert inspect.signature(compare_frames).parameters["n_boot"].default == data.N_BOOT
    assert data.N_BOOT == 2000


def test_one_label_per_run(tmp_path: Path) -> None:
    path = _pool_run(tmp_path)
    assert data.run_labels((path, str(GOLDEN_RUN))) == ["pool", "golden"]
    assert data.run_labels((str(GOLDEN_RUN), str(GOLDEN_RUN))) == [str(GOLDEN_RUN),
                                                                   f"{GOLDEN_RUN} #2"]


def test_the_dashboards_findings_are_kvscope_analyzes(tmp_path: Path) -> None:
    """The Overview's diagnoses (its cost model fitted without resamples) are those `kvscope
    analyze` reports, finding for finding and word for word, on a run whose cost model is
    fitted and whose device pool thrashes (findings that quote the fitted cost)."""
    from analyzers.report import build_report
    from kvscope.session import RunOptions, run_session

    out = tmp_path / "run"
    run_session(RunOptions(workload="docqa", num_requests=24, rate=0, model="tiny", out=out,
                           metrics_port=0, threads=1, num_blocks=48))
    path = str(out)
    report, why = data.diagnoses(path, data.run_version(path))
    assert why is None and report is not None
    cli = build_report(open_run(out)).diagnoses
    assert cli is not None and cli.findings
    assert [f.to_dict() for f in report.findings] == [f.to_dict() for f in cli.findings]
    assert report.passed == cli.passed
    assert [n.to_dict() for n in report.not_evaluated] == [n.to_dict() for n in cli.not_evaluated]
    assert any("at the fitted" in e for f in report.findings for e in f.evidence)
