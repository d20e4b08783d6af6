"""kvscope's own `/metrics` exposition (``kvscope_*``) → what one snapshot can honestly say.

`kvscope run` serves the engine's series on /metrics and `kvscope agent` the node's (names and
units in agent/schema.py's catalogue, docs/METRICS.md). A scrape of either is a snapshot of
cumulative counters, histograms and gauges: it has no requests and no time axis. What it gives:

- engine: TTFT and per-stage histograms (count, sum, p50/p90/p99 from the buckets, as PromQL's
  ``histogram_quantile``) and each stage's total as a share of the TTFT total (kvscope's stages
  partition every request's TTFT, so the stage sums add up to TTFT's: checked); the token
  accounting counters as ratios, each with its denominator (lookup tokens, prompt tokens,
  promised tokens, ...), named as `analyzers.accounting` names the run store's; failed-load
  tokens by reason, remote operations by op and outcome; each remote breaker's state at the
  scrape; block-pool states, events and finished requests by status;
- node agent: the hardware gauges and counters at the scrape and each collector's health.

What it cannot: the per-request TTFT partition, per-request token sources, groups, the slowest
requests, diagnoses (they need the run store: ``kvscope analyze RUN_DIR``), when anything
happened, or how long a breaker was open. ``import.summary`` holds the structured totals
(``exporter``, ``models``, ``requests``, ``ttft``, ``stages``, ``stages_sum_s``, ``tokens``,
``load_failed_tokens``, ``remote_operations``, ``remote_failures``, ``breakers``,
``block_pool``, ``engine_events``; for an agent ``hardware`` and ``collectors``); the text
report states them as derived lines.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from agent.schema import (
    LOAD_FAIL_REASONS,
    METRICS_BY_NAME,
    REMOTE_OPS,
    TOKEN_SOURCES,
    TTFT_STAGES,
)
from analyzers.importers.base import ImportedRun, field_error
from analyzers.importers.metrics_text import (
    INTERPOLATION,
    _base,
    _histograms,
    _ratio,
    _scalars,
    _where,
)
from analyzers.units import fmt_ns

Sample = tuple[str, dict[str, str], float]

#: histogram (``kvscope_`` stripped) → (stage, unit); the stage histogram's stage is its label
_HIST: dict[str, tuple[str | None, str]] = {
    "request_ttft_seconds": ("ttft", "seconds"),
    "request_stage_seconds": (None, "seconds"),
    "request_inter_token_latency_seconds": ("itl", "seconds"),
    "request_e2e_seconds": ("e2e", "seconds"),
    "kv_transfer_seconds": (None, "seconds"),
    "step_phase_seconds": (None, "seconds"),
}
_STAGE_LABEL = {"request_stage_seconds": "stage"}
#: relative difference tolerated between the stage sums and the TTFT sum (float sums of
#: per-request observations; the exporter observes each stage and TTFT from the same row)
STAGE_SUM_RTOL = 1e-6
#: what no kvscope scrape can tell, whichever exporter wrote it
CANNOT = (
    "per-request TTFT partition: a scrape holds aggregates, no requests",
    "per-request token sources, groups (tenant, workload class, hit class) and the slowest "
    "requests: the counters are totals over all finished requests",
    "diagnoses and the run's checks: they need the run store (kvscope analyze RUN_DIR)",
    "when anything happened: one snapshot has no time axis (rates need two scrapes, or "
    "Prometheus)",
)


def _groups() -> dict[str, str]:
    return {name: m.group for name, m in METRICS_BY_NAME.items()}


def _metric_of(name: str) -> str | None:
    """The catalogued metric a sample name belongs to (``_bucket``/``_sum``/``_count`` of a
    histogram, a counter's ``_created``), or None."""
    for cand in (name, _base(name), name.removesuffix("_created") + "_total"):
        if cand in METRICS_BY_NAME:
            return cand
    return None


def load_kvscope(path: Path, samples: list[Sample], text: str) -> ImportedRun:
    """Import a scrape of kvscope's own /metrics (engine or node agent).

    Args:
        path: the scrape file (for messages).
        samples: its parsed samples, ``(name, labels, value)``.
        text: its text (error messages name the line).
    Returns:
        An ImportedRun (source ``kvscope-prometheus`` for an engine's scrape,
        ``kvscope-agent-prometheus`` for a node agent's) with `distributions`, `ratios`,
        `summary` and what it can and cannot tell; no requests or spans.
    Raises:
        InputError: a counter that is negative or not finite, or a histogram sample no
            histogram has; each names the line.
    """
    groups = _groups()
    known = {m for n, _, _ in samples if (m := _metric_of(n)) is not None}
    engine = any(groups[m] == "engine" for m in known)
    agent = any(groups[m] in ("collector", "agent") for m in known)
    source = "kvscope-prometheus" if engine or not agent else "kvscope-agent-prometheus"
    run = ImportedRun.empty(source, path)
    samples, dropped = _check_values(samples, text, path)
    if dropped:
        run.cannot.append(f"{len(dropped)} gauge(s) read no number (NaN or infinite), left "
                          f"out: {'; '.join(dropped[:3])}" + (" ..." if len(dropped) > 3 else ""))
    rows, hist_series = _histograms(samples, "kvscope_", _HIST, text, path, run,
                                    stage_label=_STAGE_LABEL)
    models = sorted({lab["model"] for _, lab, _ in samples if "model" in lab})
    exporter = "engine" if engine else ("agent" if agent else "unknown")
    run.summary = {"exporter": exporter, "models": models, "series": len(samples),
                   "gauges_and_counters": _scalars(samples, hist_series)}
    uncatalogued = sorted({_base(n) for n, _, _ in samples
                           if n.startswith("kvscope_") and _metric_of(n) is None})
    if uncatalogued:
        run.summary["uncatalogued"] = uncatalogued
        run.cannot.append(f"{len(uncatalogued)} kvscope_ series not in this version's "
                          f"catalogue (newer or older kvscope?): {', '.join(uncatalogued[:5])}"
                          + (" ..." if len(uncatalogued) > 5 else "") + "; not read")
    if len(models) > 1:
        run.derived.append(f"totals summed over {len(models)} models: {', '.join(models)}")
    if engine:
        _engine(samples, rows, run)
    if agent:
        _agent(samples, run)
    if not engine and not agent:
        run.cannot.append("anything beyond the build: the scrape has no engine or node-agent "
                          "series (only kvscope_build_info?)")
    run.cannot.extend(CANNOT)
    import pandas as pd

    run.distributions = pd.DataFrame(rows, columns=[
        "metric", "labels", "stage", "unit", "count", "sum", "sum_s", "mean",
        "p50", "p90", "p99", "buckets", "complete", "note"])
    return run


def _check_values(samples: list[Sample], text: str, path: Path) -> tuple[list[Sample], list[str]]:
    """Counters must be finite and >= 0 (anything else is a garbled snapshot: InputError
    naming the line). A gauge that reads NaN or ±Inf (a sensor with no reading) is left out
    and named. Returns the samples kept and the gauges left out."""
    kept: list[Sample] = []
    dropped: list[str] = []
    for name, labels, value in samples:
        spec = METRICS_BY_NAME.get(name)
        if spec is not None and spec.type == "counter" and not (
                math.isfinite(value) and value >= 0):
            raise field_error(path, _where(text, name, labels), "value",
                              f"a counter must be a finite number >= 0, got {value:g}")
        if spec is not None and spec.type in ("gauge", "info") and not math.isfinite(value):
            lk = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            dropped.append(f"{name}{{{lk}}} = {value:g}")
            continue
        kept.append((name, labels, value))
    return kept, dropped


def _by(samples: list[Sample], name: str, label: str) -> dict[str, float]:
    """Sum of series `name` per value of `label` (summed over every other label)."""
    out: dict[str, float] = defaultdict(float)
    for n, lab, v in samples:
        if n == name:
            out[lab.get(label, "")] += v
    return dict(out)


def _sum(samples: list[Sample], name: str) -> float | None:
    vals = [v for n, _, v in samples if n == name]
    return sum(vals) if vals else None


def _engine(samples: list[Sample], rows: list[dict[str, Any]], run: ImportedRun) -> None:
    s = run.summary
    status = _by(samples, "kvscope_requests_total", "status")
    s["requests"] = status
    _stages(rows, run)
    tokens = _tokens(samples)
    s["tokens"] = tokens
    failed = tokens["load_failed"]
    s["load_failed_tokens"] = failed
    ops: dict[str, dict[str, float]] = defaultdict(dict)
    for n, lab, v in samples:
        if n == "kvscope_remote_operations_total":
            op, outcome = lab.get("op", ""), lab.get("outcome", "")
            ops[op][outcome] = ops[op].get(outcome, 0.0) + v
    s["remote_operations"] = {op: dict(sorted(o.items())) for op, o in sorted(ops.items())}
    s["remote_failures"] = {op: {k: v for k, v in sorted(o.items()) if k != "ok" and v}
                            for op, o in sorted(ops.items())}
    breakers: dict[str, str] = {}
    for n, lab, v in samples:
        if n == "kvscope_remote_breaker_open":
            op = lab.get("op", "")
            if v >= 1 or breakers.get(op) != "open":  # open on any model: open
                breakers[op] = "open" if v >= 1 else "closed"
    s["breakers"] = dict(sorted(breakers.items()))
    pool: dict[str, dict[str, float]] = defaultdict(dict)
    for n, lab, v in samples:
        if n == "kvscope_block_pool_blocks":
            t, state = lab.get("tier", ""), lab.get("state", "")
            pool[t][state] = pool[t].get(state, 0.0) + v
    s["block_pool"] = {t: dict(sorted(x.items())) for t, x in sorted(pool.items())}
    events: dict[str, float] = defaultdict(float)
    for n, lab, v in samples:
        if n == "kvscope_events_total":
            events[f"{lab.get('source', '')}/{lab.get('name', '')}"] += v
    s["engine_events"] = dict(sorted(events.items()))
    run.ratios = _ratios(samples, tokens, status, ops)
    _engine_notes(run, rows)


def _stages(rows: list[dict[str, Any]], run: ImportedRun) -> None:
    """Per-stage totals (summed over models) as shares of the TTFT total, and the check that
    the stage sums add up to it."""
    def total(metric: str, stage: str | None) -> tuple[float, float]:
        rs = [r for r in rows if r["metric"] == metric and (stage is None or r["stage"] == stage)]
        return (sum(r["count"] for r in rs if r["count"] == r["count"]),
                sum(r["sum_s"] for r in rs if r["sum_s"] == r["sum_s"]))

    n, ttft_s = total("kvscope_request_ttft_seconds", None)
    stages = {}
    for st in TTFT_STAGES:
        c, t = total("kvscope_request_stage_seconds", st)
        stages[st] = {"count": c, "sum_s": t, "share_of_ttft": t / ttft_s if ttft_s else None}
    run.summary["ttft"] = {"count": n, "sum_s": ttft_s}
    run.summary["stages"] = stages
    staged = sum(v["sum_s"] for v in stages.values())
    run.summary["stages_sum_s"] = staged
    if not n or ttft_s <= 0:
        run.cannot.append("TTFT and stage totals: no request reached its first token yet "
                          f"(TTFT histogram count {n:g}, sum {ttft_s:g} s)")
        return
    parts = ", ".join(f"{st} {fmt_ns(v['sum_s'] * 1e9)} ({100 * v['share_of_ttft']:.1f} %)"
                      for st, v in stages.items() if v["sum_s"] > 0)
    run.derived.append(f"TTFT stage totals over {n:,.0f} requests (stage sum / TTFT sum "
                       f"{fmt_ns(ttft_s * 1e9)}): {parts}")
    if math.isclose(staged, ttft_s, rel_tol=STAGE_SUM_RTOL, abs_tol=1e-9):
        run.can.append("TTFT stage totals as shares of the TTFT total (the stage sums add up "
                       "to the TTFT sum, as kvscope's per-request partition does)")
    else:
        run.cannot.append(f"stage shares: the stage sums ({staged:.6f} s) differ from the TTFT "
                          f"sum ({ttft_s:.6f} s): a snapshot taken mid-update, or series of "
                          "different runs")


def _tokens(samples: list[Sample]) -> dict[str, Any]:
    def tier(name: str) -> dict[str, float]:
        return dict(sorted(_by(samples, name, "tier").items()))

    by_source = _by(samples, "kvscope_prompt_tokens_by_source_total", "source")
    reasons = _by(samples, "kvscope_kv_load_failed_tokens_total", "reason")
    return {
        "prompt": _sum(samples, "kvscope_prompt_tokens_total"),
        "generation": _sum(samples, "kvscope_generation_tokens_total"),
        "lookup": _sum(samples, "kvscope_lookup_tokens_total"),
        "by_source": {k: by_source.get(k, 0.0) for k in TOKEN_SOURCES
                      if k in by_source} | {k: v for k, v in by_source.items()
                                            if k not in TOKEN_SOURCES},
        "hit": tier("kvscope_kv_hit_tokens_total"),
        "found": tier("kvscope_kv_found_tokens_total"),
        "load_failed": {k: reasons.get(k, 0.0) for k in LOAD_FAIL_REASONS if k in reasons}
        | {k: v for k, v in reasons.items() if k not in LOAD_FAIL_REASONS},
        "preempted": _sum(samples, "kvscope_preempted_tokens_total"),
        "read_bytes": tier("kvscope_kv_read_bytes_total"),
        "written_bytes": tier("kvscope_kv_written_bytes_total"),
        "h2d_bytes": _sum(samples, "kvscope_h2d_bytes_total"),
    }


def _ratios(samples: list[Sample], tok: dict[str, Any], status: dict[str, float],
            ops: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """The accounting ratios the counters support, named as `analyzers.accounting` names the
    run store's, each with its own denominator."""
    src, hit, found = tok["by_source"], tok["hit"], tok["found"]
    lookup, prompt = tok["lookup"], tok["prompt"]
    by_src = "kvscope_prompt_tokens_by_source_total"
    out: list[dict[str, Any]] = []
    if src and lookup is not None:
        reused = sum(src.get(k, 0.0) for k in ("device_hit", "host_loaded", "remote_loaded"))
        out.append(_ratio("token_hit_share", reused, lookup, "lookup tokens",
                          f"{by_src}{{source!=\"recomputed\"}} / kvscope_lookup_tokens_total",
                          "device hits + host and remote loads", zero="no lookups yet"))
        for s, key in (("device_hit", "device_hit_share"), ("host_loaded", "host_loaded_share"),
                       ("remote_loaded", "remote_loaded_share")):
            if s in src:
                out.append(_ratio(key, src[s], lookup, "lookup tokens",
                                  f"{by_src}{{source=\"{s}\"}} / kvscope_lookup_tokens_total",
                                  zero="no lookups yet"))
    if lookup is not None:
        for t in ("host", "remote"):
            if t in hit:
                out.append(_ratio(f"{t}_promised_share", hit[t], lookup, "lookup tokens",
                                  f"kvscope_kv_hit_tokens_total{{tier=\"{t}\"}} / "
                                  "kvscope_lookup_tokens_total", zero="no lookups yet"))
            if t in found:
                out.append(_ratio(f"{t}_found_share", found[t], lookup, "lookup tokens",
                                  f"kvscope_kv_found_tokens_total{{tier=\"{t}\"}} / "
                                  "kvscope_lookup_tokens_total",
                                  "found in the tier where no lookup promised them",
                                  zero="no lookups yet"))
    for t in ("host", "remote"):
        loaded = src.get(f"{t}_loaded")
        if t in hit and loaded is not None and t in found:
            out.append(_ratio(f"{t}_load_yield", loaded - found[t], hit[t],
                              f"promised {t} tokens",
                              f"({by_src}{{source=\"{t}_loaded\"}} - kvscope_kv_found_tokens"
                              f"_total{{tier=\"{t}\"}}) / kvscope_kv_hit_tokens_total"
                              f"{{tier=\"{t}\"}}", f"{t} promises loaded",
                              zero=f"no {t} promises"))
    promised = hit.get("host", 0.0) + hit.get("remote", 0.0) if hit else None
    failed = tok["load_failed"]
    if failed and promised is not None:
        out.append(_ratio("load_failed_share", sum(failed.values()), promised,
                          "promised tokens", "kvscope_kv_load_failed_tokens_total / "
                          "kvscope_kv_hit_tokens_total{tier=~\"host|remote\"}",
                          "promised tokens that failed to load and were recomputed",
                          zero="no host or remote promises"))
        for r, v in failed.items() if promised else ():  # 0 / 0 once is enough
            out.append(_ratio(f"load_failed_{r}_share", v, promised, "promised tokens",
                              f"kvscope_kv_load_failed_tokens_total{{reason=\"{r}\"}} / "
                              "kvscope_kv_hit_tokens_total{tier=~\"host|remote\"}",
                              zero="no host or remote promises"))
    if src and prompt is not None:
        for s, v in src.items():
            out.append(_ratio(f"prompt_{s}", v, prompt, "prompt tokens",
                              f"{by_src}{{source=\"{s}\"}} / kvscope_prompt_tokens_total",
                              zero="no prompt tokens yet"))
    if tok["preempted"] is not None and "recomputed" in src:
        out.append(_ratio("preemption_waste", tok["preempted"],
                          src["recomputed"] + tok["preempted"], "computed tokens",
                          "kvscope_preempted_tokens_total / (recomputed + preempted tokens)",
                          "computed tokens thrown away by preemption",
                          zero="no tokens computed"))
    reads = tok["read_bytes"]
    if reads and "remote" in reads:
        out.append(_ratio("remote_read_byte_share", reads["remote"], sum(reads.values()),
                          "bytes read", "kvscope_kv_read_bytes_total{tier=\"remote\"} / "
                          "kvscope_kv_read_bytes_total", zero="no bytes read"))
    if status:
        bad = sum(v for k, v in status.items() if k != "ok")
        out.append(_ratio("requests_not_ok", bad, sum(status.values()), "finished requests",
                          "kvscope_requests_total{status!=\"ok\"} / kvscope_requests_total",
                          "finished with status error or aborted",
                          zero="no request finished yet"))
    for op in (*REMOTE_OPS, *sorted(set(ops) - set(REMOTE_OPS))):
        if op in ops:
            o = ops[op]
            out.append(_ratio(f"remote_{op}_failed", sum(v for k, v in o.items() if k != "ok"),
                              sum(o.values()), f"remote {op} operations",
                              f"kvscope_remote_operations_total{{op=\"{op}\","
                              "outcome!=\"ok\"} / kvscope_remote_operations_total"
                              f"{{op=\"{op}\"}}",
                              "by outcome in import.summary.remote_failures",
                              zero=f"no remote {op}s"))
    return out


def _engine_notes(run: ImportedRun, rows: list[dict[str, Any]]) -> None:
    s = run.summary
    observed = [r for r in rows if r["count"] == r["count"] and r["count"] > 0]
    if any(r["p50"] == r["p50"] for r in observed):
        run.derived.append(INTERPOLATION)
    staged = [st for st in (*TTFT_STAGES, "ttft", "itl", "e2e")
              if any(r["stage"] == st for r in observed)]
    if staged:
        run.can.append("TTFT and stage distributions (count, sum, p50/p90/p99; a stage's "
                       "over the requests that spent time in it): " + ", ".join(staged))
    known = [r["name"] for r in run.ratios if r["value"] is not None]
    if known:
        run.can.append("token accounting and failure ratios from the counters, each with its "
                       "denominator: " + ", ".join(known))
    for r in run.ratios:
        if r.get("undefined"):
            run.cannot.append(f"{r['name']}: {r['numerator'] or 0:,.0f} / 0 "
                              f"{r['denominator_unit']} ({r['undefined']})")
    failed = {k: v for k, v in s["load_failed_tokens"].items() if v}
    run.derived.append("failed-load tokens by reason: " + (", ".join(
        f"{k} {v:,.0f}" for k, v in failed.items()) if failed else "none"))
    fails = [f"{op} {outcome} {v:,.0f}" for op, o in s["remote_failures"].items()
             for outcome, v in o.items()]
    if s["remote_operations"]:
        run.derived.append("failed remote operations by op and outcome: "
                           + (", ".join(fails) if fails else "none"))
        run.can.append("remote failures by op and outcome, failed-load tokens by reason")
    if s["breakers"]:
        run.derived.append("remote breakers at the scrape: " + ", ".join(
            f"{op} {state}" for op, state in s["breakers"].items()))
        run.can.append("each remote breaker's state at the scrape")
        run.cannot.append("how long a breaker was open, or how often it opened: the gauge is "
                          "its state at the scrape (the run's summary and circuit_open events "
                          "have the open time)")
    run.cannot.append("bytes per loaded token and preempted loads "
                      "(preempted_loaded_tokens is not exported)")


def _agent(samples: list[Sample], run: ImportedRun) -> None:
    """The node agent's hardware series at the scrape and its collectors' health."""
    groups = _groups()
    hw: dict[str, float] = {}
    collectors: dict[str, dict[str, float]] = defaultdict(dict)
    for name, labels, value in samples:
        g = groups.get(name)
        if g == "collector":
            lk = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            hw[f"{name}{{{lk}}}" if lk else name] = value
        elif g == "agent":
            c = labels.get("collector", "")
            collectors[c][name.removeprefix("kvscope_collector_")] = value
    run.summary["hardware"] = hw
    run.summary["collectors"] = {c: dict(sorted(v.items())) for c, v in sorted(
        collectors.items())}
    if hw:
        run.can.append(f"hardware gauges and counters at the scrape ({len(hw):,} series; "
                       "counters are totals since the agent started)")
    if collectors:
        failing = [c for c, v in collectors.items() if v.get("errors_total")]
        run.can.append("the agent's collectors' health (last run's duration, errors, dropped "
                       "samples, last success)")
        run.derived.append(f"collectors: {', '.join(sorted(collectors))}"
                           + (f"; with errors: {', '.join(sorted(failing))}" if failing
                              else "; none with errors"))
    if run.source == "kvscope-agent-prometheus":
        run.cannot.append("requests, TTFT and KV accounting: the node agent exports hardware "
                          "only (scrape the engine's /metrics, `kvscope run`, for those)")
        run.cannot.append("rates (bandwidth, utilisation over time): one snapshot of "
                          "cumulative counters")

