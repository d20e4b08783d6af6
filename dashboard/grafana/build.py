"""Generates the kvscope Grafana dashboard (`kvscope.json` beside this file).

Run ``python -m dashboard.grafana.build > dashboard/grafana/kvscope.json`` after a change; the
tests check that the checked-in file matches. The dashboard is importable as is: its datasource
is the `datasource` template variable (type prometheus), and `model` and `instance` variables
filter every engine panel. Panels show the same signals as the alert rules
(dashboard/rules/kvscope-rules.yaml), and every ratio panel has its numerator and denominator
next to it (docs/DESIGN.md, "Token accounting"): in the same panel when they share its unit, in
the panel beside it otherwise (a 0-1 share never shares an axis with tokens/s). Every panel has
one unit (`fieldConfig.defaults.unit`) and a description; the hardware panels' descriptions say
that they need the node agent (`kvscope agent`) scraped. Queries name only catalogued metrics
(agent/schema.py); tests/dashboard/test_grafana_live.py runs every one against a real
Prometheus scraping real runs and an agent.
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


#: Grafana units of the panels (`fieldConfig.defaults.unit`); one unit per panel.
TOKENS_PS = "suffix: tokens/s"
ERRORS_PS = "suffix: errors/s"

#: Description suffix of the panels whose series come from the node agent, not the engine.
AGENT_ONLY = ("Needs the node agent (`kvscope agent`, its own scrape job, e.g. `kvscope-agent`) "
              "to be scraped; `kvscope run` does not export {metric}, so the panel stays empty "
              "with only engines scraped.")


def _agent(text: str, metric: str) -> str:
    return f"{text} {AGENT_ONLY.format(metric=f'`{metric}`')}"


def _p99(name_filter: str) -> str:
    return (f"histogram_quantile(0.99, sum by (tier, name, le) "
            f"(rate(kvscope_kv_transfer_seconds_bucket{{{ENG}, {name_filter}}}[{RI}])))")


#: kvscope_kv_transfer_seconds `name` filters of the three transfer panels: every name is in
#: exactly one (lookups: `lookup`, `remote_lookup`; writes: `remote_write`; reads: the rest,
#: `remote_read` and `h2d`).
LOOKUPS = 'name=~"(.+_)?lookup"'
WRITES = 'name=~".*write.*"'
READS = 'name!~"(.+_)?lookup|.*write.*"'


def panels() -> list[dict[str, Any]]:
    """Every panel of the dashboard, in layout order."""
    p: list[dict[str, Any]] = []
    p.append(_row(1, "Latency: TTFT and its stages", 0))
    p.append(_panel(2, "TTFT p50 / p99", [
        (f"histogram_quantile(0.99, sum by (model, le) "
         f"(rate(kvscope_request_ttft_seconds_bucket{{{ENG}}}[{RI}])))", "p99 {{model}}"),
        (f"histogram_quantile(0.5, sum by (model, le) "
         f"(rate(kvscope_request_ttft_seconds_bucket{{{ENG}}}[{RI}])))", "p50 {{model}}"),
    ], x=0, y=1, unit="s", description="Time to first token (arrival to first sampled "
                                        "token), from the TTFT histogram."))
    p.append(_panel(3, "TTFT SLO: requests over 2 s / requests", [
        (f'sum by (model) (rate(kvscope_request_ttft_seconds_count{{{ENG}}}[{RI}])) - '
         f'sum by (model) (rate(kvscope_request_ttft_seconds_bucket{{{ENG}, le="2.0"}}[{RI}]))',
         "over 2 s/s {{model}}"),
        (f"sum by (model) (rate(kvscope_request_ttft_seconds_count{{{ENG}}}[{RI}]))",
         "requests/s {{model}}"),
    ], x=12, y=1, unit="reqps",
        description="Numerator and denominator of the TTFT SLO (99 % within 2 s), requests "
                    "per second; the alerts KvscopeTTFTSLOFastBurn/SlowBurn divide them."))
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
    ], x=0, y=18, unit=TOKENS_PS,
        description="Tokens per second; the sources sum to prompt tokens. Lookup tokens are "
                    "the denominator of the KV hit share."))
    p.append(_panel(7, "KV hit share (reused / lookup tokens)", [
        (f'sum(rate(kvscope_prompt_tokens_by_source_total{{{ENG}, '
         f'source=~"device_hit|host_loaded|remote_loaded"}}[{RI}])) '
         f"/ sum(rate(kvscope_lookup_tokens_total{{{ENG}}}[{RI}]))", "share"),
    ], x=12, y=18, unit="percentunit",
        description="Share (0-1) of lookup tokens served by a KV tier. Its numerator and "
                    "denominator, in tokens/s, are the panel beside it (KvscopeTokenHitShareDrop "
                    "compares this share over 15 m and 6 h)."))
    p.append(_panel(21, "Reused tokens / lookup tokens", [
        (f'sum(rate(kvscope_prompt_tokens_by_source_total{{{ENG}, '
         f'source=~"device_hit|host_loaded|remote_loaded"}}[{RI}]))', "reused tokens/s"),
        (f"sum(rate(kvscope_lookup_tokens_total{{{ENG}}}[{RI}]))", "lookup tokens/s"),
    ], x=12, y=26, unit=TOKENS_PS,
        description="Numerator (device hits plus host and remote loads) and denominator of "
                    "the KV hit share, tokens per second."))
    p.append(_panel(8, "Remote read failures by reason / promised remote hits", [
        (f"sum by (reason) (rate(kvscope_kv_load_failed_tokens_total{{{ENG}}}[{RI}]))",
         "failed {{reason}}"),
        (f'sum(rate(kvscope_kv_hit_tokens_total{{{ENG}, tier="remote"}}[{RI}]))',
         "remote hit tokens (denominator)"),
    ], x=0, y=26, unit=TOKENS_PS,
        description="Promised tokens that failed to load (and were recomputed), by reason, "
                    "beside the remote-hit tokens promised; tokens per second. "
                    "KvscopeRemoteReadFailureRatioHigh divides the two (without `evicted`)."))
    p.append(_panel(9, "Remote breakers open, by operation", [
        (f"max by (instance, model, op) (kvscope_remote_breaker_open{{{ENG}}})",
         "{{instance}} {{model}} {{op}}"),
    ], x=0, y=34, unit="bool", kind="state-timeline",
        description="1 while the remote tier's circuit breaker for an operation kind "
                    "(lookup, read, write) is open (KvscopeRemoteBreakerOpen). Only engines "
                    "with a remote tier (`--remote`) export it."))
    p.append(_panel(20, "Remote operations by outcome / lookups+reads", [
        (f'sum by (op, outcome) (rate(kvscope_remote_operations_total{{{ENG}, '
         f'outcome!="ok"}}[{RI}]))', "failed {{op}} {{outcome}}"),
        (f'sum(rate(kvscope_remote_operations_total{{{ENG}, op=~"lookup|read"}}[{RI}]))',
         "lookups+reads (denominator)"),
    ], x=12, y=34, unit="ops",
        description="Operations per second. A failed lookup promises nothing, so it shows "
                    "here and not in the load-failed tokens; writes are behind the "
                    "request path and left out of the denominator."))
    p.append(_panel(10, "KV bytes read by tier", [
        (f"sum by (tier) (rate(kvscope_kv_read_bytes_total{{{ENG}}}[{RI}]))", "{{tier}}"),
        (f"sum(rate(kvscope_h2d_bytes_total{{{ENG}}}[{RI}]))", "h2d"),
    ], x=0, y=42, unit="Bps",
        description="KV bytes per second read from the host and remote tiers, and copied "
                    "host to device (h2d)."))
    p.append(_panel(11, "KV read p99 by tier", [
        (_p99(READS), "{{tier}} {{name}}"),
    ], x=12, y=42, unit="s",
        description="p99 duration of KV reads (remote_read, h2d), by tier and transfer name. "
                    "Lookups and writes are in their own panels below."))
    p.append(_panel(22, "KV lookup p99 by tier", [
        (_p99(LOOKUPS), "{{tier}} {{name}}"),
    ], x=0, y=50, unit="s",
        description="p99 duration of KV lookups (the per-tier prefix lookups and the remote "
                    "tier's lookup), by tier and transfer name."))
    p.append(_panel(23, "KV write p99 by tier", [
        (_p99(WRITES), "{{tier}} {{name}}"),
    ], x=12, y=50, unit="s",
        description="p99 duration of KV writes (remote_write, behind the request path), by "
                    "tier and transfer name."))

    p.append(_row(12, "Scheduler and block pool", 58))
    p.append(_panel(13, "Device block pool", [
        (f'sum by (state) (kvscope_block_pool_blocks{{{ENG}, tier="device"}})', "{{state}}"),
    ], x=0, y=59, w=8, unit="suffix: blocks", stack=True,
        description="Device KV blocks by state (in_use, cached_free, empty); the stack is the "
                    "pool size. No empty blocks while preempting: KvscopeBlockPoolExhausted."))
    p.append(_panel(14, "Preemptions", [
        (f"sum(rate(kvscope_preemptions_total{{{ENG}}}[{RI}]))", "preemptions/s"),
    ], x=8, y=59, w=8, unit="suffix: preemptions/s",
        description="Requests preempted (by recompute) per second because KV blocks ran out "
                    "(KvscopePreemptionRateHigh)."))
    p.append(_panel(24, "Requests running / waiting", [
        (f"sum(kvscope_requests_waiting{{{ENG}}})", "waiting"),
        (f"sum(kvscope_requests_running{{{ENG}}})", "running"),
    ], x=16, y=59, w=8, unit="suffix: requests",
        description="Requests scheduled (running) and waiting for admission, now."))

    p.append(_row(15, "Hardware (node agent)", 67))
    p.append(_panel(16, "GPU XID errors (increase)", [
        (f"sum by (instance, gpu, xid) (increase(kvscope_gpu_xid_errors_total{{{NODE}}}[{RI}]))",
         "{{instance}} gpu {{gpu}} xid {{xid}}"),
    ], x=0, y=68, unit="short", description=_agent(
        "XID critical errors per GPU and XID in the interval (KvscopeGPUXidError). A (gpu, "
        "xid) series appears with its first error: empty means no XID yet.",
        "kvscope_gpu_xid_errors_total")))
    p.append(_panel(17, "GPU utilization", [
        (f"kvscope_gpu_utilization_ratio{{{NODE}}}", "{{instance}} gpu {{gpu}}"),
    ], x=12, y=68, unit="percentunit", description=_agent(
        "GPU utilization over the agent's last sample period, 0-1 (NVML; empty on a node "
        "without NVIDIA GPUs).", "kvscope_gpu_utilization_ratio")))
    p.append(_panel(18, "NIC errors", [
        (f"sum by (instance, device) (rate(kvscope_nic_receive_errors_total{{{NODE}}}[{RI}]))",
         "rx {{instance}} {{device}}"),
        (f"sum by (instance, device) (rate(kvscope_nic_transmit_errors_total{{{NODE}}}[{RI}]))",
         "tx {{instance}} {{device}}"),
    ], x=0, y=76, unit=ERRORS_PS, description=_agent(
        "Receive and transmit errors per second per NIC (KvscopeNICErrors).",
        "kvscope_nic_receive_errors_total / kvscope_nic_transmit_errors_total")))
    p.append(_panel(19, "NIC throughput", [
        (f"sum by (instance, device) (rate(kvscope_nic_receive_bytes_total{{{NODE}}}[{RI}]))",
         "rx {{instance}} {{device}}"),
        (f"sum by (instance, device) (rate(kvscope_nic_transmit_bytes_total{{{NODE}}}[{RI}]))",
         "tx {{instance}} {{device}}"),
    ], x=12, y=76, unit="Bps", description=_agent(
        "Bytes per second received and transmitted per NIC.",
        "kvscope_nic_receive_bytes_total / kvscope_nic_transmit_bytes_total")))
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
            # Engines (`kvscope run`) and node agents (`kvscope agent`) are scraped as different
            # instances (and jobs); both export kvscope_build_info.
            _query_var("instance", "instance", "label_values(kvscope_build_info, instance)"),
        ]},
        "panels": panels(),
    }


def render() -> str:
    """The dashboard as the JSON text checked in beside this module."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
