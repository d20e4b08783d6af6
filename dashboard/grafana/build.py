"""Generates the kvscope Grafana dashboard (`kvscope.json` beside this file).

Run ``python -m dashboard.grafana.build > dashboard/grafana/kvscope.json`` after a change; the
tests check that the checked-in file matches. The dashboard is importable as is: its datasource
is the `datasource` template variable (type prometheus), and `model` and `instance` variables
filter every engine panel. Panels show the same signals as the alert rules
(dashboard/rules/kvscope-rules.yaml), and every ratio panel plots its numerator and denominator
beside the share (docs/DESIGN.md, "Token accounting"). Queries name only catalogued metrics
(agent/schema.py).
"""

from __future__ import annotations

import json
import sys
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
#: Label filter of engine metrics (model and instance variables, both multi-value with "All").
ENG = 'model=~"$model", instance=~"$instance"'
#: Label filter of node (collector) metrics, which carry no model label.
NODE = 'instance=~"$instance"'
RI = "$__rate_interval"

UID = "kvscope-overview"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def _panel(
    pid: int,
    title: str,
    targets: list[tuple[str, str]],
    *,
    x: int,
    y: int,
    w: int = 12,
    h: int = 8,
    unit: str = "short",
    kind: str = "timeseries",
    description: str = "",
    stack: bool = False,
) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "line", "fillOpacity": 10 if not stack else 60}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom if kind == "timeseries"
                                     else {}}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom",
                               "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else {},
        "targets": [_target(e, lg, chr(ord("A") + i)) for i, (e, lg) in enumerate(targets)],
    }


def _row(pid: int, title: str, y: int) -> dict[str, Any]:
    return {"id": pid, "type": "row", "title": title, "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}


def panels() -> list[dict[str, Any]]:
    """Every panel of the dashboard, in layout order."""
    p: list[dict[str, Any]] = []
    p.append(_row(1, "Latency: TTFT and its stages", 0))
    p.append(_panel(2, "TTFT p50 / p99", [
        (f"histogram_quantile(0.99, sum by (model, le) "
         f"(rate(kvscope_request_ttft_seconds_bucket{{{ENG}}}[{RI}])))", "p99 {{model}}"),
        (f"histogram_quantile(0.5, sum by (model, le) "
         f"(rate(kvscope_request_ttft_seconds_bucket{{{ENG}}}[{RI}])))", "p50 {{model}}"),
    ], x=0, y=1, unit="s", description="Time to first token from the TTFT histogram."))
    p.append(_panel(3, "TTFT SLO: requests over 2 s / requests", [
        (f'sum by (model) (rate(kvscope_request_ttft_seconds_count{{{ENG}}}[{RI}])) - '
         f'sum by (model) (rate(kvscope_request_ttft_seconds_bucket{{{ENG}, le="2.0"}}[{RI}]))',
         "over 2 s/s {{model}}"),
        (f"sum by (model) (rate(kvscope_request_ttft_seconds_count{{{ENG}}}[{RI}]))",
         "requests/s {{model}}"),
    ], x=12, y=1, unit="reqps",
        description="Numerator and denominator of the TTFT SLO (99 % within 2 s)."))
    p.append(_panel(4, "TTFT stages: mean seconds per request", [
        (f"sum by (stage) (rate(kvscope_request_stage_seconds_sum{{{ENG}}}[{RI}])) "
         f"/ ignoring (stage) group_left "
         f"sum(rate(kvscope_request_ttft_seconds_count{{{ENG}}}[{RI}]))", "{{stage}}"),
    ], x=0, y=9, w=24, unit="s", stack=True,
        description="Stages partition TTFT: the stack sums to the mean TTFT."))

    p.append(_row(5, "KV cache: where prompt tokens came from", 17))
    p.append(_panel(6, "Prompt tokens by source / lookup tokens", [
        (f"sum by (source) (rate(kvscope_prompt_tokens_by_source_total{{{ENG}}}[{RI}]))",
         "{{source}}"),
        (f"sum(rate(kvscope_lookup_tokens_total{{{ENG}}}[{RI}]))", "lookup tokens (denominator)"),
    ], x=0, y=18, unit="short", description="Tokens per second; sources sum to prompt tokens."))
    p.append(_panel(7, "KV hit share (reused / lookup tokens)", [
        (f'sum(rate(kvscope_prompt_tokens_by_source_total{{{ENG}, '
         f'source=~"device_hit|host_loaded|remote_loaded"}}[{RI}])) '
         f"/ sum(rate(kvscope_lookup_tokens_total{{{ENG}}}[{RI}]))", "share"),
        (f'sum(rate(kvscope_prompt_tokens_by_source_total{{{ENG}, '
         f'source=~"device_hit|host_loaded|remote_loaded"}}[{RI}]))', "reused tokens/s"),
        (f"sum(rate(kvscope_lookup_tokens_total{{{ENG}}}[{RI}]))", "lookup tokens/s"),
    ], x=12, y=18, unit="short",
        description="Share of lookup tokens served by a tier, with its numerator and "
                    "denominator."))
    p.append(_panel(8, "Remote read failures by reason / promised remote hits", [
        (f"sum by (reason) (rate(kvscope_kv_load_failed_tokens_total{{{ENG}}}[{RI}]))",
         "failed {{reason}}"),
        (f'sum(rate(kvscope_kv_hit_tokens_total{{{ENG}, tier="remote"}}[{RI}]))',
         "remote hit tokens (denominator)"),
    ], x=0, y=26, unit="short", description="Tokens per second."))
    p.append(_panel(9, "Remote breakers open, by operation", [
        (f"max by (instance, model, op) (kvscope_remote_breaker_open{{{ENG}}})",
         "{{instance}} {{model}} {{op}}"),
    ], x=12, y=26, unit="bool", kind="state-timeline"))
    p.append(_panel(20, "Remote operations by outcome / lookups+reads", [
        (f'sum by (op, outcome) (rate(kvscope_remote_operations_total{{{ENG}, '
         f'outcome!="ok"}}[{RI}]))', "failed {{op}} {{outcome}}"),
        (f'sum(rate(kvscope_remote_operations_total{{{ENG}, op=~"lookup|read"}}[{RI}]))',
         "lookups+reads (denominator)"),
    ], x=0, y=34, w=24, unit="ops",
        description="Operations per second. A failed lookup promises nothing, so it shows "
                    "here and not in the load-failed tokens above; writes are behind the "
                    "request path and left out of the denominator."))
    p.append(_panel(10, "KV bytes read by tier", [
        (f"sum by (tier) (rate(kvscope_kv_read_bytes_total{{{ENG}}}[{RI}]))", "{{tier}}"),
        (f"sum(rate(kvscope_h2d_bytes_total{{{ENG}}}[{RI}]))", "h2d"),
    ], x=0, y=42, unit="Bps"))
    p.append(_panel(11, "KV transfer p99 by tier", [
        (f"histogram_quantile(0.99, sum by (tier, le) "
         f"(rate(kvscope_kv_transfer_seconds_bucket{{{ENG}}}[{RI}])))", "{{tier}}"),
    ], x=12, y=42, unit="s"))

    p.append(_row(12, "Scheduler and block pool", 50))
    p.append(_panel(13, "Device block pool", [
        (f'sum by (state) (kvscope_block_pool_blocks{{{ENG}, tier="device"}})', "{{state}}"),
    ], x=0, y=51, unit="short", stack=True))
    p.append(_panel(14, "Preemptions and queue", [
        (f"sum(rate(kvscope_preemptions_total{{{ENG}}}[{RI}]))", "preemptions/s"),
        (f"sum(kvscope_requests_waiting{{{ENG}}})", "waiting"),
        (f"sum(kvscope_requests_running{{{ENG}}})", "running"),
    ], x=12, y=51, unit="short"))

    p.append(_row(15, "Hardware", 59))
    p.append(_panel(16, "GPU XID errors (increase)", [
        (f"sum by (instance, gpu, xid) (increase(kvscope_gpu_xid_errors_total{{{NODE}}}[{RI}]))",
         "{{instance}} gpu {{gpu}} xid {{xid}}"),
    ], x=0, y=60, unit="short"))
    p.append(_panel(17, "GPU utilization", [
        (f"kvscope_gpu_utilization_ratio{{{NODE}}}", "{{instance}} gpu {{gpu}}"),
    ], x=12, y=60, unit="percentunit"))
    p.append(_panel(18, "NIC errors", [
        (f"sum by (instance, device) (rate(kvscope_nic_receive_errors_total{{{NODE}}}[{RI}]))",
         "rx {{instance}} {{device}}"),
        (f"sum by (instance, device) (rate(kvscope_nic_transmit_errors_total{{{NODE}}}[{RI}]))",
         "tx {{instance}} {{device}}"),
    ], x=0, y=68, unit="short"))
    p.append(_panel(19, "NIC throughput", [
        (f"sum by (instance, device) (rate(kvscope_nic_receive_bytes_total{{{NODE}}}[{RI}]))",
         "rx {{instance}} {{device}}"),
        (f"sum by (instance, device) (rate(kvscope_nic_transmit_bytes_total{{{NODE}}}[{RI}]))",
         "tx {{instance}} {{device}}"),
    ], x=12, y=68, unit="Bps"))
    return p


def _query_var(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-var"},
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    """The dashboard model (Grafana JSON, schemaVersion 39)."""
    return {
        "uid": UID,
        "title": "kvscope: TTFT stages and KV cache",
        "tags": ["kvscope", "llm", "kv-cache"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
            _query_var("model", "model", "label_values(kvscope_requests_total, model)"),
            # Engines and node agents are scraped as different instances; both export build_info.
            _query_var("instance", "instance", "label_values(kvscope_build_info, instance)"),
        ]},
        "panels": panels(),
    }


def render() -> str:
    """The dashboard as the JSON text checked in beside this module."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
