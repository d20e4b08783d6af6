"""ECharts option builders for the Overview: analyzer outputs in, ``st.echarts_chart`` options
(JSON-compatible dicts) out.

The Overview is the page an on-call engineer opens first, so it draws with ECharts (Streamlit's
ECharts chunk is about a quarter of Plotly's 4.7 MB and draws in SVG at once); the other pages
keep their Plotly figures (`dashboard.figures`). Both modules draw the same things the same way:
one colour per stage and per token source (`figures.STAGE_COLORS`, `figures.SOURCE_COLORS`),
ms on duration axes, seconds since the run's start (`figures.TIME_AXIS`) on time axes.

Pure functions (no Streamlit, no I/O). Missing values (NaN) become ``None``, which ECharts draws
as a gap. Each chart's ARIA label is its title (`_aria`): screen readers announce it, and the
browser tests find a drawn chart by it (ECharts sets the label when it renders).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from agent.schema import TTFT_STAGES
from dashboard.figures import SOURCE_COLORS, STAGE_COLORS, TIME_AXIS

_MS = 1e6
_FONT = {"fontSize": 16, "fontWeight": "normal"}
_SUBTITLE = {"fontSize": 12, "fontWeight": "normal"}
_BREAKER = "#d62728"
#: Series that only lay the chart out (no legend entry, no tooltip).
_ALIGN = "(x alignment)"
#: What the toolbox offers on every chart: zoom by box, back to the full view, a PNG/SVG copy.
_TOOLBOX = {"right": 10, "top": 0, "feature": {"dataZoom": {"yAxisIndex": "none"},
                                                "restore": {}, "saveAsImage": {}}}


@dataclass(frozen=True, slots=True)
class Chart:
    """An ECharts option and the height (px) to draw it at."""

    option: dict[str, Any]
    height: int


def _num(v: Any) -> float | None:
    """A JSON number, or None for a missing value."""
    if v is None:
        return None
    f = float(v)
    return None if math.isnan(f) else f


def _aria(title: str) -> dict[str, Any]:
    return {"enabled": True, "label": {"description": title}}


def _round(values: Iterable[Any], digits: int = 6) -> list[float | None]:
    return [None if (x := _num(v)) is None else round(x, digits) for v in values]


def stage_breakdown(groups: Mapping[str, Mapping[str, float]], *,
                    title: str = "Mean TTFT by stage", height: int = 380) -> Chart:
    """Stacked bars: per group (e.g. ``all``, ``slowest 1 %``, a hit class) the mean time in
    each stage, in ms; means add up to the group's mean TTFT, percentiles would not.

    Args:
        groups: group label → stage → mean ns (a stage missing from a group is a gap).
    """
    labels = list(groups)
    series = [{
        "type": "bar", "stack": "ttft", "name": stage, "itemStyle": {"color": STAGE_COLORS[stage]},
        "emphasis": {"focus": "series"},
        "data": _round((float(groups[g].get(stage, np.nan)) / _MS for g in labels), 4),
    } for stage in TTFT_STAGES]
    return Chart({
        "title": {"text": title, "textStyle": _FONT},
        "aria": _aria(title),
        "toolbox": {**_TOOLBOX, "feature": {"saveAsImage": {}}},
        "tooltip": {"trigger": "axis", "axisPointer": {"type": "shadow"},
                    "valueFormatter": "%,.3f ms"},
        "legend": {"bottom": 0, "itemGap": 8},
        "grid": {"left": 70, "right": 20, "top": 50, "bottom": 100},
        # Every group named under its bar, wrapped to the bar's share of the width.
        "xAxis": {"type": "category", "data": labels,
                  "axisLabel": {"interval": 0, "overflow": "break",
                                "width": max(40, 260 // max(len(labels), 1))}},
        "yAxis": {"type": "value", "name": "mean ms per request", "nameLocation": "middle",
                  "nameGap": 50},
        "series": series,
    }, height)


def token_sources(counts: Mapping[str, int], *, title: str, of: str = "",
                  height: int = 380) -> Chart:
    """One stacked horizontal bar: the prompt's tokens by KV source (device hit, host loaded,
    remote loaded, recomputed); each legend entry carries its count and share of the total.

    Args:
        of: whose prompt tokens they are, for the subtitle (e.g. "of requests with a first
            token").
    """
    total = sum(int(counts.get(src, 0)) for src in SOURCE_COLORS)
    series = []
    for src, color in SOURCE_COLORS.items():
        n = int(counts.get(src, 0))
        share = f" ({100 * n / total:.1f} %)" if total else ""
        series.append({"type": "bar", "stack": "prompt", "barWidth": "45%",
                       "name": f"{src.replace('_', ' ')}: {n:,}{share}",
                       "itemStyle": {"color": color}, "data": [n]})
    return Chart({
        "title": {"text": title, "textStyle": _FONT,
                  "subtext": f"{total:,} prompt tokens {of}".rstrip(),
                  "subtextStyle": _SUBTITLE},
        "aria": _aria(title),
        "toolbox": {**_TOOLBOX, "feature": {"saveAsImage": {}}},
        "tooltip": {"trigger": "item", "valueFormatter": "%,d prompt tokens"},
        "legend": {"orient": "vertical", "left": 70, "bottom": 0},
        "grid": {"left": 70, "right": 30, "top": 70, "bottom": 130},
        "xAxis": {"type": "value", "name": "prompt tokens", "nameLocation": "middle",
                  "nameGap": 28, "max": total or None, "minInterval": 1},
        "yAxis": {"type": "category", "data": ["prompt"]},
        "series": series,
    }, height)


def _grid_titles(tops: list[int], names: list[str]) -> list[dict[str, Any]]:
    return [{"text": n, "top": t - 24, "left": 70, "textStyle": _SUBTITLE}
            for t, n in zip(tops, names, strict=True)]


def incidents(windows: pd.DataFrame, incidents: pd.DataFrame, breaker: pd.DataFrame, *,
              origin_ns: int, height: int = 620) -> Chart:
    """When did things go wrong: TTFT p50/p90/p99 per arrival window on top, failures (failed
    requests, failed loads, remote errors) in the middle, evicted blocks at the bottom, on one
    time axis (zoomed together); breaker-open periods shaded across all three rows and listed
    in the legend.

    Args:
        windows: `TTFTSummary.windows`.
        incidents: `dashboard.data.Incidents.windows` (``window_start_s`` and counts).
        breaker: `dashboard.data.Incidents.breaker` (``op, start_s, end_s, closed``).
        origin_ns: the run's start.
    """
    tops, heights = [100, 350, 500], [190, 100, 60]
    grids = [{"left": 70, "right": 30, "top": t, "height": h}
             for t, h in zip(tops, heights, strict=True)]
    xs: list[float] = []
    series: list[dict[str, Any]] = []
    if len(windows):
        x = (windows["window_start_ns"].to_numpy(dtype=np.int64) - np.int64(origin_ns)) / 1e9
        xs += [float(x.min()), float(x.max())]
        for q, dash in (("p50", "solid"), ("p90", "dashed"), ("p99", "dotted")):
            y = windows[f"ttft_{q}_ns"].astype("float64").to_numpy() / _MS
            series.append({"type": "line", "name": f"TTFT {q}", "xAxisIndex": 0,
                           "yAxisIndex": 0, "showSymbol": True, "symbolSize": 5,
                           "lineStyle": {"type": dash},
                           "data": [[round(float(a), 6), _num(b)] for a, b in zip(x, y,
                                                                               strict=True)]})
    if len(incidents):
        xi = incidents["window_start_s"].to_numpy(dtype=np.float64)
        xs += [float(xi.min()), float(xi.max())]
    else:
        xi = np.zeros(0)

    def bars(col: str, name: str, color: str, row: int) -> dict[str, Any]:
        y = incidents[col].to_numpy() if len(incidents) else np.zeros(0)
        return {"type": "bar", "name": name, "xAxisIndex": row, "yAxisIndex": row,
                "itemStyle": {"color": color}, "barMaxWidth": 14,
                "data": [[round(float(a), 6), int(b)] for a, b in zip(xi, y, strict=True)]}

    if len(xi) and len(windows):
        # ECharts widens a value axis that carries bars by half a bar on each side; a bar
        # series with no visible bars gives the TTFT row the same widening, so that all three
        # rows keep one x scale.
        series.append({"type": "bar", "name": _ALIGN, "xAxisIndex": 0, "yAxisIndex": 0,
                       "barMaxWidth": 14, "silent": True, "tooltip": {"show": False},
                       "itemStyle": {"opacity": 0},
                       "data": [[round(float(a), 6), None] for a in xi]})
    series += [bars("failed_requests", "failed requests", "#7f0000", 1),
               bars("failed_load_requests", "requests with a failed load", "#d62728", 1),
               bars("remote_errors", "remote operation errors", "#ff7f0e", 1),
               bars("evicted_blocks", "evicted blocks", "#9467bd", 2)]
    periods = [[{"xAxis": round(float(b.start_s), 6)}, {"xAxis": round(float(b.end_s), 6)}]
               for b in breaker.itertuples(index=False)]
    if periods:
        xs += [p[1]["xAxis"] for p in periods] + [p[0]["xAxis"] for p in periods]
        for row in range(3):  # the shading, on every row (a series of its own, no legend)
            series.append({"type": "line", "name": f"breaker shading {row}", "xAxisIndex": row,
                           "yAxisIndex": row, "data": [], "silent": True,
                           "legendHoverLink": False,
                           "markArea": {"silent": True, "data": periods,
                                        "itemStyle": {"color": _BREAKER, "opacity": 0.12}}})
    for b in breaker.itertuples(index=False):
        label = f"breaker open ({b.op})" if b.op else "breaker open"
        end = "" if b.closed else " (still open at end)"
        series.append({"type": "line", "name": label, "xAxisIndex": 1, "yAxisIndex": 1,
                       "lineStyle": {"color": _BREAKER, "width": 6},
                       "itemStyle": {"color": _BREAKER}, "symbol": "none",
                       "tooltip": {"valueFormatter": f"%.2f s{end}"},
                       "data": [[round(float(b.start_s), 6), 0], [round(float(b.end_s), 6), 0]]})
    # The range, widened to whole hundredths (ECharts labels both ends of a fixed range).
    lo, hi = (math.floor(min(xs) * 100) / 100, math.ceil(max(xs) * 100) / 100) if xs \
        else (0.0, 1.0)
    x_axes = [{"type": "value", "gridIndex": i, "min": round(lo, 6), "max": round(hi, 6),
               "axisLabel": {"show": i == 2}, **({"name": TIME_AXIS, "nameLocation": "middle",
                                                   "nameGap": 28} if i == 2 else {})}
              for i in range(3)]
    y_axes = [{"type": "value", "gridIndex": 0, "axisLabel": {"formatter": "{value} ms"}},
              {"type": "value", "gridIndex": 1, "minInterval": 1, "min": 0},
              {"type": "value", "gridIndex": 2, "minInterval": 1, "min": 0}]
    title = "TTFT, failures, breaker and evictions on one time axis"
    legend_names = [s["name"] for s in series
                    if s["name"] != _ALIGN and not s["name"].startswith("breaker shading")]
    return Chart({
        "title": [{"text": title, "textStyle": _FONT},
                  *_grid_titles(tops, ["TTFT (ms)", "failures per window",
                                       "evicted blocks per window"])],
        "aria": _aria(title),
        "toolbox": _TOOLBOX,
        "tooltip": {"trigger": "axis"},
        "axisPointer": {"link": [{"xAxisIndex": "all"}]},
        "dataZoom": [{"type": "inside", "xAxisIndex": [0, 1, 2]}],
        "legend": {"top": 26, "left": 60, "right": 20, "data": legend_names},
        "grid": grids,
        "xAxis": x_axes,
        "yAxis": y_axes,
        "series": series,
    }, height)

