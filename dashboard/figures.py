"""Plotly figure builders: analyzer outputs and raw series in, `go.Figure` out (the Overview's
charts, and the token-source bar, are ECharts options: `dashboard.echarts`).

Pure functions (no Streamlit, no I/O); they draw what they are given and only convert units
for the axes (ns → ms, epoch ns → datetimes). Every stage keeps one colour across figures.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

STAGE_COLORS: dict[str, str] = {
    "lookup": "#8c564b", "queue": "#7f7f7f", "remote_read": "#d62728", "h2d": "#ff7f0e",
    "sync": "#9467bd", "prefill": "#1f77b4", "other": "#bcbd22", "decode": "#17becf",
}
SOURCE_COLORS: dict[str, str] = {
    "device_hit": "#2ca02c", "host_loaded": "#ff7f0e", "remote_loaded": "#d62728",
    "recomputed": "#1f77b4",
}
_QUANTILE_DASH = {"p50": "solid", "p90": "dash", "p99": "dot"}
_MS = 1e6



#: The x axis of every time chart: the run's one time base (`analyzers.timebase`).
TIME_AXIS = "seconds since run start"


def _times(ns: pd.Series | np.ndarray, origin_ns: int) -> np.ndarray:
    """Epoch ns → seconds since the run's start (what the report, the diagnoses and
    `kvscope timeline --window` count in)."""
    return (np.asarray(ns, dtype=np.int64) - np.int64(origin_ns)) / 1e9


def _layout(fig: go.Figure, title: str, *, height: int = 360) -> go.Figure:
    fig.update_layout(title=title, height=height, margin={"l": 60, "r": 20, "t": 50, "b": 40},
                      legend={"orientation": "h", "y": -0.2})
    return fig


def request_waterfall(spans: pd.DataFrame, arrival_ns: int, *, title: str,
                      first_token_ns: int | None = None) -> go.Figure:
    """One request's spans on a ms-since-arrival axis: its states on the first row, each
    activity (transfer, store, lookup) on a row named by activity and tier; a dashed line marks
    the first token (the request's TTFT)."""
    fig = go.Figure()
    if not len(spans):
        return _layout(fig, title + " (no spans)")
    kind = spans["kind"].astype(str).to_numpy()
    name = spans["name"].astype(str).to_numpy()
    tier = spans["tier"].astype(object).where(spans["tier"].notna(), "").to_numpy() \
        if "tier" in spans else np.full(len(spans), "")
    start = (spans["start_ns"].to_numpy(dtype=np.int64) - arrival_ns) / _MS
    dur = (spans["end_ns"].to_numpy(dtype=np.int64)
           - spans["start_ns"].to_numpy(dtype=np.int64)) / _MS
    row = np.where(kind == "state", "stages",
                   np.char.add(np.char.add(name.astype(str), " "), tier.astype(str)))
    row = np.char.strip(row.astype(str))
    nbytes = spans["bytes"].astype("float64").fillna(0).to_numpy() if "bytes" in spans \
        else np.zeros(len(spans))
    for label in dict.fromkeys(name):  # one legend entry per span name, in time order
        m = name == label
        fig.add_trace(go.Bar(
            y=row[m], x=dur[m], base=start[m], orientation="h", name=label,
            marker_color=STAGE_COLORS.get(label, "#aaaaaa"),
            customdata=np.column_stack([kind[m], nbytes[m]]),
            hovertemplate=(f"{label}<br>start %{{base:.3f}} ms<br>%{{x:.3f}} ms"
                           "<br>%{customdata[0]}, %{customdata[1]:,.0f} bytes<extra></extra>"),
        ))
    if first_token_ns is not None:
        ttft_ms = (int(first_token_ns) - int(arrival_ns)) / _MS
        fig.add_vline(x=ttft_ms, line={"color": "#000000", "dash": "dash", "width": 1.5})
        fig.add_annotation(x=ttft_ms, y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                           text=f"first token {ttft_ms:,.3f} ms", font={"size": 11})
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="ms since arrival", ticksuffix=" ms")
    _layout(fig, title, height=240 + 28 * len(dict.fromkeys(row)))
    # The legend to the right of the plot: under it, it sat on the axis title.
    fig.update_layout(legend={"orientation": "v", "x": 1.01, "y": 1.0, "yanchor": "top"},
                      margin={"l": 60, "r": 140, "t": 60, "b": 50})
    return fig


def tier_bars(tiers: pd.DataFrame) -> go.Figure:
    """Promised vs loaded tokens per tier (`TokenAccounting.tiers`)."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=tiers["tier"], y=tiers["promised_tokens"], name="promised by lookup"))
    fig.add_trace(go.Bar(x=tiers["tier"], y=tiers["loaded_tokens"], name="used (hit / loaded)"))
    fig.add_trace(go.Bar(x=tiers["tier"], y=tiers["shortfall_tokens"], name="shortfall"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(title_text="tokens")
    return _layout(fig, "Tokens per tier: promised, used, shortfall")


def layer_heatmap(table: pd.DataFrame) -> go.Figure:
    """Per layer, the share of prompt tokens hit, loaded and recomputed (`layer_table`), and
    skipped (outside a sliding-window layer's window) when a layer skipped any."""
    kinds: tuple[str, ...] = ("hit", "loaded", "recomputed")
    if "skipped_tokens" in table and bool((table["skipped_tokens"] > 0).any()):
        kinds += ("skipped",)
    z = np.vstack([table[f"{k}_share"].astype("float64").to_numpy() for k in kinds])
    num = np.vstack([table[f"{k}_tokens"].to_numpy(dtype=np.int64) for k in kinds])
    den = np.broadcast_to(table["prompt_tokens"].to_numpy(dtype=np.int64), num.shape)
    text = np.vectorize(lambda n, d: f"{n:,} / {d:,}")(num, den) if num.size else num
    fig = go.Figure(go.Heatmap(
        z=z, x=table["layer"].astype(str), y=list(kinds), zmin=0, zmax=1, colorscale="Viridis",
        customdata=text,
        colorbar={"title": {"text": "share of prompt<br>tokens (%)", "side": "right"},
                  "tickformat": ".0%"},
        hovertemplate="layer %{x} %{y}: %{customdata} prompt tokens (%{z:.1%})<extra></extra>",
    ))
    fig.update_xaxes(title_text="layer", type="category")
    return _layout(fig, "Share of prompt tokens by layer", height=300)


def pool_states(samples: pd.DataFrame, *, origin_ns: int) -> go.Figure:
    """Block-pool states over time, stacked per pool (device, host): only samples in unit
    ``blocks`` (`dashboard.data.pool_states`); tier counters belong in a table."""
    fig = go.Figure()
    for (entity, state), g in samples.groupby(["entity", "metric"], sort=True, dropna=False):
        g = g.sort_values("ts_ns")
        fig.add_trace(go.Scatter(x=_times(g["ts_ns"], origin_ns), y=g["value"],
                                 name=f"{entity} {state}",
                                 mode="lines", stackgroup=str(entity), line={"shape": "hv"}))
    fig.update_yaxes(title_text="blocks", tickformat=",d", rangemode="tozero")
    fig.update_xaxes(title_text=TIME_AXIS, type="linear")
    return _layout(fig, "Block pool states over time (blocks)")


def event_counts(events: pd.DataFrame, *, title: str, origin_ns: int) -> go.Figure:
    """Events over time, as a histogram of their timestamps."""
    fig = go.Figure(go.Histogram(x=_times(events["ts_ns"], origin_ns), name="events"))
    fig.update_yaxes(title_text="events")
    fig.update_xaxes(title_text=TIME_AXIS, type="linear")
    return _layout(fig, title, height=280)


#: How each sample unit is drawn: (tickformat, ticksuffix, hover format, hover suffix).
#: Plotly's default SI format writes giga as "B" (25.2765020165B), so bytes get ``~s`` + B.
_UNIT_AXES: dict[str, tuple[str, str, str, str]] = {
    "bytes": ("~s", "B", "~s", "B"),
    "bytes_per_second": ("~s", "B/s", "~s", "B/s"),
    "bytes/s": ("~s", "B/s", "~s", "B/s"),
    "ratio": (".1%", "", ".1%", ""),
    "percent": (".0f", " %", ".1f", " %"),
    "per_second": ("~s", "/s", ",.3~f", "/s"),
    "seconds_per_second": (".2f", " s/s", ".3f", " s/s"),
    "seconds": ("~s", " s", ",.3~f", " s"),
    "watts": ("~s", " W", ",.1f", " W"),
    "celsius": (".0f", " °C", ".1f", " °C"),
    "hertz": ("~s", "Hz", "~s", "Hz"),
}
_SOURCE_PREFIXES = {"nvml": ("gpu_", "nvml_"), "nic": ("nic_",), "rdma": ("rdma_",),
                    "host": ("host_",)}


def unit_axis(unit: str) -> tuple[str, str, str, str]:
    """(tickformat, ticksuffix, hover format, hover suffix) for samples recorded in `unit`."""
    u = (unit or "").strip()
    if u in _UNIT_AXES:
        return _UNIT_AXES[u]
    if u.endswith("/s"):
        return ("~s", f" {u}", "~s", f" {u}")
    return ("~s", f" {u}" if u else "", ",.4~g", f" {u}" if u else "")


def short_metric(source: str, metric: str) -> str:
    """A metric's name for a legend: its source prefix and unit suffix dropped, underscores as
    spaces (``host_cpu_utilization_ratio`` → ``cpu utilization``, ``nic_receive_bytes_per_second``
    → ``receive``, ``gpu_pcie_receive_bytes_per_second`` → ``pcie receive``)."""
    m = metric
    for pre in _SOURCE_PREFIXES.get(source, ()):
        m = m.removeprefix(pre)
    for suf in ("_bytes_per_second", "_per_second", "_ratio", "_bytes", "_total"):
        if m.endswith(suf) and len(m) > len(suf):
            m = m.removesuffix(suf)
            break
    return m.replace("_", " ")


def hardware(windows: pd.DataFrame, series: pd.DataFrame, metrics: Sequence[str], *,
             origin_ns: int) -> go.Figure:
    """TTFT percentiles on top, then one row per hardware metric (a line per entity, named
    ``entity short-metric``), all on one shared time axis; each row's axis in its unit."""
    rows = 1 + len(metrics)
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=["TTFT (ms)", *metrics])
    if len(windows):
        x = _times(windows["window_start_ns"], origin_ns)
        for q, dash in _QUANTILE_DASH.items():
            fig.add_trace(go.Scatter(x=x, y=windows[f"ttft_{q}_ns"].astype("float64") / _MS,
                                     name=f"TTFT {q}", mode="lines+markers",
                                     line={"dash": dash}), row=1, col=1)
    fig.update_yaxes(ticksuffix=" ms", row=1, col=1)
    for i, metric in enumerate(metrics, start=2):
        s = series.loc[series["metric"] == metric]
        unit = ""
        for (source, entity), g in s.groupby(["source", "entity"], sort=True):
            unit = str(g["unit"].dropna().iloc[0]) if g["unit"].notna().any() else ""
            _, _, hover, hsuf = unit_axis(unit)
            name = " ".join(x for x in (str(entity), short_metric(str(source), metric)) if x)
            fig.add_trace(go.Scatter(
                x=_times(g["ts_ns"], origin_ns), y=g["value"].to_numpy(dtype=np.float64),
                mode="lines" if len(g) > 200 else "lines+markers", name=name,
                hovertemplate=f"{name}: %{{y:{hover}}}{hsuf}<extra></extra>"), row=i, col=1)
        tick, suffix, _, _ = unit_axis(unit)
        fig.update_yaxes(tickformat=tick, ticksuffix=suffix, row=i, col=1)
    fig.update_xaxes(type="linear")
    fig.update_xaxes(title_text=TIME_AXIS, row=rows, col=1)
    return _layout(fig, "Hardware and TTFT on one time axis", height=220 + 200 * rows)


def compare_stages(stages: pd.DataFrame, a_label: str, b_label: str) -> go.Figure:
    """p50 and p99 of each stage and TTFT in run A and run B (`Comparison.stages`)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["p50 (ms)", "p99 (ms)"])
    for col, q in enumerate(("p50", "p99"), start=1):
        for side, label, color in (("a", a_label, "#1f77b4"), ("b", b_label, "#d62728")):
            fig.add_trace(go.Bar(x=stages["stage"], y=stages[f"{side}_{q}_ns"] / _MS,
                                 name=f"{side.upper()}: {label}", marker_color=color,
                                 showlegend=col == 1), row=1, col=col)
    fig.update_layout(barmode="group")
    return _layout(fig, "Stage percentiles, A vs B", height=380)
