"""Plotly figure builders: analyzer outputs and raw series in, `go.Figure` out.

Pure functions (no Streamlit, no I/O); they draw what they are given and only convert units
for the axes (ns → ms, epoch ns → datetimes). Every stage keeps one colour across figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from agent.schema import TTFT_STAGES

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


def ttft_over_time(windows: pd.DataFrame, *, origin_ns: int, stage: str = "ttft"
                   ) -> go.Figure:
    """Percentiles of TTFT (or one stage) per arrival window (`TTFTSummary.windows`)."""
    fig = go.Figure()
    x = _times(windows["window_start_ns"], origin_ns) if len(windows) else []
    for q, dash in _QUANTILE_DASH.items():
        col = f"{stage}_{q}_ns"
        y = windows[col].astype("float64") / _MS if len(windows) else []
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"{stage} {q}",
                                 line={"dash": dash}))
    fig.update_yaxes(title_text="ms")
    fig.update_xaxes(title_text=TIME_AXIS, type="linear")
    return _layout(fig, f"{stage.upper() if stage == 'ttft' else stage} percentiles over time "
                        "(by arrival window)")


def stage_breakdown(groups: Mapping[str, Mapping[str, float]], *,
                    title: str = "Mean TTFT by stage") -> go.Figure:
    """Stacked bars: per group (e.g. ``all``, ``slowest 1 %``, a hit class) the mean time in
    each stage; means add up to the group's mean TTFT, percentiles would not."""
    labels = list(groups)
    fig = go.Figure()
    for stage in TTFT_STAGES:
        y = [float(groups[g].get(stage, np.nan)) / _MS for g in labels]
        fig.add_trace(go.Bar(x=labels, y=y, name=stage, marker_color=STAGE_COLORS[stage]))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="mean ms per request")
    return _layout(fig, title)


def request_waterfall(spans: pd.DataFrame, arrival_ns: int, *, title: str) -> go.Figure:
    """One request's spans on a ms-since-arrival axis: its states on the first row, each
    activity (transfer, store, lookup) on a row named by activity and tier."""
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
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(ticksuffix=" ms")  # since arrival; an axis title would hit the legend
    return _layout(fig, title, height=220 + 28 * len(dict.fromkeys(row)))


def token_sources(counts: Mapping[str, int], *, title: str) -> go.Figure:
    """One stacked horizontal bar: the prompt's tokens by KV source."""
    fig = go.Figure()
    for src, color in SOURCE_COLORS.items():
        n = int(counts.get(src, 0))
        fig.add_trace(go.Bar(y=["prompt"], x=[n], name=f"{src.replace('_', ' ')}: {n:,}",
                             orientation="h", marker_color=color))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="prompt tokens")
    return _layout(fig, title, height=220)


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
    """Per layer, the share of prompt tokens hit, loaded and recomputed (`layer_table`)."""
    kinds = ("hit", "loaded", "recomputed")
    z = np.vstack([table[f"{k}_share"].astype("float64").to_numpy() for k in kinds])
    num = np.vstack([table[f"{k}_tokens"].to_numpy(dtype=np.int64) for k in kinds])
    den = np.broadcast_to(table["prompt_tokens"].to_numpy(dtype=np.int64), num.shape)
    text = np.vectorize(lambda n, d: f"{n:,} / {d:,}")(num, den) if num.size else num
    fig = go.Figure(go.Heatmap(
        z=z, x=table["layer"].astype(str), y=list(kinds), zmin=0, zmax=1, colorscale="Viridis",
        customdata=text,
        hovertemplate="layer %{x} %{y}: %{customdata} prompt tokens (%{z:.1%})<extra></extra>",
    ))
    fig.update_xaxes(title_text="layer", type="category")
    return _layout(fig, "Share of prompt tokens by layer", height=300)


def pool_states(samples: pd.DataFrame, *, origin_ns: int) -> go.Figure:
    """Block-pool states over time, stacked (samples with source ``pool``)."""
    fig = go.Figure()
    for (entity, state), g in samples.groupby(["entity", "metric"], sort=True, dropna=False):
        g = g.sort_values("ts_ns")
        fig.add_trace(go.Scatter(x=_times(g["ts_ns"], origin_ns), y=g["value"],
                                 name=f"{entity} {state}",
                                 mode="lines", stackgroup=str(entity), line={"shape": "hv"}))
    fig.update_yaxes(title_text="blocks")
    fig.update_xaxes(title_text=TIME_AXIS, type="linear")
    return _layout(fig, "Block pool states over time")


def event_counts(events: pd.DataFrame, *, title: str, origin_ns: int) -> go.Figure:
    """Events over time, as a histogram of their timestamps."""
    fig = go.Figure(go.Histogram(x=_times(events["ts_ns"], origin_ns), name="events"))
    fig.update_yaxes(title_text="events")
    fig.update_xaxes(title_text=TIME_AXIS, type="linear")
    return _layout(fig, title, height=280)


def hardware(windows: pd.DataFrame, series: pd.DataFrame, metrics: Sequence[str], *,
             origin_ns: int) -> go.Figure:
    """TTFT percentiles on top, then one row per hardware metric (a line per entity), all on
    one shared time axis."""
    rows = 1 + len(metrics)
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=["TTFT (ms)", *metrics])
    if len(windows):
        x = _times(windows["window_start_ns"], origin_ns)
        for q, dash in _QUANTILE_DASH.items():
            fig.add_trace(go.Scatter(x=x, y=windows[f"ttft_{q}_ns"].astype("float64") / _MS,
                                     name=f"TTFT {q}", mode="lines+markers",
                                     line={"dash": dash}), row=1, col=1)
    for i, metric in enumerate(metrics, start=2):
        s = series.loc[series["metric"] == metric]
        for (source, entity), g in s.groupby(["source", "entity"], sort=True):
            unit = str(g["unit"].iloc[0]) if g["unit"].notna().any() else ""
            fig.add_trace(go.Scatter(
                x=_times(g["ts_ns"], origin_ns), y=g["value"].to_numpy(dtype=np.float64),
                mode="lines" if len(g) > 200 else "lines+markers",
                name=f"{source} {entity} {metric}".strip(),
                hovertemplate=f"%{{y:,.4g}} {unit}<extra></extra>"), row=i, col=1)
    fig.update_xaxes(title_text=TIME_AXIS, type="linear")
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
