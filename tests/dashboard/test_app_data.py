"""The dashboard's loading layer (`dashboard.data`) and figure builders (`dashboard.figures`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from agent.runstore import RunStoreWriter, open_run
from agent.schema import TABLES, TTFT_STAGES
from dashboard import data, figures
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
    assert len(figures.ttft_over_time(empty_windows, origin_ns=0).data) == 3
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
    fig = figures.ttft_over_time(windows, origin_ns=origin)
    assert list(fig.data[0].x) == list(windows["window_start_s"])
    assert fig.data[0].x[0] == 0.0 and fig.layout.xaxis.title.text == figures.TIME_AXIS
    ev = run.events
    hist = figures.event_counts(ev, title="e", origin_ns=origin)
    assert list(hist.data[0].x) == list((ev["ts_ns"].astype("int64") - origin) / 1e9)


def test_stage_breakdown_stacks_every_stage_in_ms() -> None:
    fig = figures.stage_breakdown({"all": {s: 1_000_000.0 * (i + 1)
                                           for i, s in enumerate(TTFT_STAGES)}})
    assert [t.name for t in fig.data] == list(TTFT_STAGES)
    assert [float(t.y[0]) for t in fig.data] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert fig.layout.barmode == "stack"


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
