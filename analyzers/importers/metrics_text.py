"""vLLM (v0 and v1 names) and SGLang `/metrics` scrapes → stage distributions and labelled ratios.

A scrape is aggregate-only: it has no requests and no spans, so it cannot give a per-request TTFT
partition. What it gives is histogram-derived distributions per stage (queue, prefill, TTFT, …)
and the engines' hit ratios, each labelled with *its own* denominator (vLLM v1 counts queried
prompt tokens; v0's hit rate is a precomputed gauge; SGLang's covers the last prefill batch).

Quantiles are estimated as PromQL's ``histogram_quantile`` does: linear interpolation inside the
bucket holding the rank, the first bucket starting at 0, and the last finite bound when the rank
falls in ``+Inf``. A histogram cut short (no ``+Inf`` bucket and no ``_count``, as in the shared
v0 scrape) is imported with what it has: its total is unknown, so no quantile is estimated.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from agent.errors import InputError
from analyzers.importers.base import ImportedRun, read_bytes

QUANTILES = (0.5, 0.9, 0.99)
INTERPOLATION = (
    "p50/p90/p99 estimated from buckets by linear interpolation inside the bucket holding the "
    "rank (as PromQL histogram_quantile; first bucket from 0, capped at the last finite bound)"
)

#: histogram base name (engine prefix stripped) → (stage, unit)
_VLLM_HIST: dict[str, tuple[str | None, str]] = {
    "time_to_first_token_seconds": ("ttft", "seconds"),
    "request_queue_time_seconds": ("queue", "seconds"),
    "request_prefill_time_seconds": ("prefill", "seconds"),
    "request_decode_time_seconds": ("decode", "seconds"),
    "request_inference_time_seconds": ("inference", "seconds"),
    "e2e_request_latency_seconds": ("e2e", "seconds"),
    "inter_token_latency_seconds": ("itl", "seconds"),
    "time_per_output_token_seconds": ("itl", "seconds"),
    "request_prefill_kv_computed_tokens": (None, "tokens"),
    "request_prompt_tokens": (None, "tokens"),
    "request_generation_tokens": (None, "tokens"),
    "iteration_tokens_total": (None, "tokens"),
}
_SGLANG_HIST: dict[str, tuple[str | None, str]] = {
    "time_to_first_token_seconds": ("ttft", "seconds"),
    "queue_time_seconds": ("queue", "seconds"),
    "e2e_request_latency_seconds": ("e2e", "seconds"),
    "inter_token_latency_seconds": ("itl", "seconds"),
    "time_per_output_token_seconds": ("itl", "seconds"),
}
#: SGLang per_stage_req_latency_seconds{stage=...} → kvscope stage
_SGLANG_STAGE = {"prefill_forward": "prefill", "prefill_transfer_kv_cache": "remote_read"}
#: metric names only vLLM v1 exports
_V1_ONLY = (
    "vllm:prefix_cache_queries", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_by_source",
)


def load_prometheus(path: Path) -> ImportedRun:
    """Import a vLLM or SGLang Prometheus text scrape.

    Args:
        path: the scrape file (text exposition format).
    Returns:
        An ImportedRun with `distributions`, `ratios` and `summary` (gauges and counters); the
        requests and spans frames are empty.
    Raises:
        InputError: not Prometheus text, or no vLLM/SGLang metric in it.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = read_bytes(path).decode("utf-8")
        samples = [
            (s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text (expected a Prometheus scrape)") from None
    except ValueError as exc:
        raise InputError(f"{path}: not valid Prometheus text ({exc})") from None
    names = {n for n, _, _ in samples}
    if any(n.startswith("vllm:") for n in names):
        v1 = any(n.startswith(p) for n in names for p in _V1_ONLY)
        source, prefix, table = ("vllm-prometheus-v1" if v1 else "vllm-prometheus-v0",
                                 "vllm:", _VLLM_HIST)
    elif any(n.startswith("sglang:") for n in names):
        source, prefix, table = "sglang-prometheus", "sglang:", _SGLANG_HIST
    else:
        raise InputError(f"{path}: Prometheus text without vllm: or sglang: metrics")

    run = ImportedRun.empty(source, path)
    dist_rows, hist_names = _histograms(samples, prefix, table)
    scalars = {n: v for n, v in _scalars(samples, hist_names).items()}
    run.summary = {"gauges_and_counters": scalars, "series": len(samples)}
    run.ratios = _ratios(samples, source)
    _aggregate_other(dist_rows, run)
    _notes(run, dist_rows)
    import pandas as pd

    run.distributions = pd.DataFrame(dist_rows, columns=[
        "metric", "labels", "stage", "unit", "count", "sum", "sum_s", "mean",
        "p50", "p90", "p99", "buckets", "complete", "note"])
    return run


def _label_key(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "le")


def _histograms(samples: list[tuple[str, dict[str, str], float]], prefix: str,
                table: dict[str, tuple[str | None, str]]) -> tuple[list[dict[str, Any]], set[str]]:
    """One distribution row per histogram series (metric × labels other than `le`)."""
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    sums: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], float] = {}
    labels_of: dict[tuple[str, str], dict[str, str]] = {}
    for name, labels, value in samples:
        if name.endswith("_bucket") and "le" in labels:
            key = (name[: -len("_bucket")], _label_key(labels))
            buckets[key].append((float(labels["le"]), value))
            labels_of[key] = {k: v for k, v in labels.items() if k != "le"}
    bases = {b for b, _ in buckets}
    for name, labels, value in samples:
        for suffix, store in (("_sum", sums), ("_count", counts)):
            if name.endswith(suffix) and name[: -len(suffix)] in bases:
                store[(name[: -len(suffix)], _label_key(labels))] = value
    rows = []
    for key in sorted(buckets):
        base, lkey = key
        short = base[len(prefix):] if base.startswith(prefix) else base
        stage, unit = table.get(short, (None, "seconds" if short.endswith("_seconds") else ""))
        if short == "per_stage_req_latency_seconds":
            stage = _SGLANG_STAGE.get(labels_of[key].get("stage", ""))
        rows.append(_row(base, lkey, stage, unit, sorted(buckets[key]),
                         sums.get(key), counts.get(key)))
    hist_series = {f"{b}{s}" for b in bases for s in ("_bucket", "_sum", "_count", "_created")}
    return rows, hist_series


def _row(metric: str, labels: str, stage: str | None, unit: str,
         bk: list[tuple[float, float]], total_sum: float | None,
         count: float | None) -> dict[str, Any]:
    missing = []
    has_inf = bool(bk) and math.isinf(bk[-1][0])
    if not has_inf:
        missing.append("no +Inf bucket")
    if count is None:
        missing.append("no _count")
        count = bk[-1][1] if has_inf else None
    if total_sum is None:
        missing.append("no _sum")
    if count is not None and not has_inf:
        bk = [*bk, (math.inf, count)]  # _count is the +Inf bucket's value
    complete = not missing
    q = {f"p{round(p * 100)}": (_quantile(p, bk) if count else math.nan) for p in QUANTILES}
    note = ""
    if missing:
        note = "; ".join(missing)
        if count is None:
            note += (f": total unknown (at least {bk[-1][1]:g} observations up to le="
                     f"{bk[-1][0]:g}), no quantile estimated") if bk else ": no buckets"
    mean = (total_sum / count) if (total_sum is not None and count) else math.nan
    return {
        "metric": metric, "labels": labels, "stage": stage, "unit": unit,
        "count": math.nan if count is None else count,
        "sum": math.nan if total_sum is None else total_sum,
        "sum_s": total_sum if (unit == "seconds" and total_sum is not None) else math.nan,
        "mean": mean, **q, "buckets": len(bk), "complete": complete, "note": note,
    }


def _quantile(q: float, bk: list[tuple[float, float]]) -> float:
    """PromQL histogram_quantile over cumulative (le, count) pairs ending with +Inf."""
    total = bk[-1][1]
    if total <= 0 or len(bk) < 2:
        return math.nan
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in bk:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # the rank is above every finite bound
            if c == prev_c:
                return le
            lower = prev_le if prev_le < le else 0.0
            return lower + (le - lower) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def _scalars(samples: list[tuple[str, dict[str, str], float]],
             hist_series: set[str]) -> dict[str, float]:
    out = {}
    for name, labels, value in samples:
        if name in hist_series or name.endswith("_created"):
            continue
        lk = _label_key(labels)
        out[f"{name}{{{lk}}}" if lk else name] = value
    return out


def _total(samples: list[tuple[str, dict[str, str], float]], name: str,
           **match: str) -> float | None:
    """Sum of a series over its labels (optionally filtered); None when absent."""
    vals = [v for n, lab, v in samples
            if n == name and all(lab.get(k) == x for k, x in match.items())]
    return sum(vals) if vals else None


def _ratio(name: str, num: float | None, den: float | None, unit: str, metric: str,
           note: str = "") -> dict[str, Any]:
    value = (num / den) if (num is not None and den) else None
    return {"name": name, "numerator": num, "denominator": den, "denominator_unit": unit,
            "source_metric": metric, "value": value, "note": note}


def _ratios(samples: list[tuple[str, dict[str, str], float]], source: str) -> list[dict[str, Any]]:
    out = []
    if source.startswith("vllm"):
        hits = _total(samples, "vllm:prefix_cache_hits_total")
        queries = _total(samples, "vllm:prefix_cache_queries_total")
        if queries is not None:
            out.append(_ratio(
                "prefix_cache_hit", hits, queries, "queried prompt tokens (blocks in older vLLM)",
                "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total",
                "hits are block-aligned, capped at num_tokens - 1; preempted requests apart"))
        ext_h = _total(samples, "vllm:external_prefix_cache_hits_total")
        ext_q = _total(samples, "vllm:external_prefix_cache_queries_total")
        if ext_q is not None:
            out.append(_ratio(
                "external_prefix_cache_hit", ext_h, ext_q,
                "prompt tokens left after the local hit",
                "vllm:external_prefix_cache_hits_total / vllm:external_prefix_cache_queries_total",
                "a connector hit counts even if the load later fails"))
        by_src = {lab.get("source"): v for n, lab, v in samples
                  if n == "vllm:prompt_tokens_by_source_total"}
        den = sum(by_src.values())
        for src, v in sorted((k, v) for k, v in by_src.items() if k):
            out.append(_ratio(f"prompt_tokens_{src}", v, den, "prompt tokens (all sources)",
                              "vllm:prompt_tokens_by_source_total"))
        for tier in ("gpu", "cpu"):
            g = _total(samples, f"vllm:{tier}_prefix_cache_hit_rate")
            if g is not None:
                note = ("precomputed gauge: denominator unknown (v0 counts blocks since start)"
                        + ("; -1 means prefix caching off or no queries yet" if g < 0 else ""))
                out.append({"name": f"{tier}_prefix_cache_hit_rate", "numerator": None,
                            "denominator": None, "denominator_unit": "unknown",
                            "source_metric": f"vllm:{tier}_prefix_cache_hit_rate",
                            "value": g if g >= 0 else None, "note": note})
    else:
        g = _total(samples, "sglang:cache_hit_rate")
        if g is not None:
            out.append({"name": "cache_hit_rate", "numerator": None, "denominator": None,
                        "denominator_unit": "tokens of the most recent prefill batch only",
                        "source_metric": "sglang:cache_hit_rate", "value": g,
                        "note": "a gauge over the last prefill batch, not the run"})
        prompt = _total(samples, "sglang:prompt_tokens_total")
        cached = defaultdict(float)
        for n, lab, v in samples:
            if n == "sglang:cached_tokens_total":
                cached[lab.get("cache_source", "")] += v
        for src, v in sorted(cached.items()):
            out.append(_ratio(f"cached_tokens_{src or 'all'}", v, prompt, "prompt tokens",
                              "sglang:cached_tokens_total / sglang:prompt_tokens_total"))
    return out


def _aggregate_other(rows: list[dict[str, Any]], run: ImportedRun) -> None:
    """TTFT minus the stages the engine times, in aggregate: the explicit `other` share.

    Only sums are subtractable; quantiles of a difference cannot come from histograms.
    """
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["stage"]:
            by_stage[r["stage"]].append(r)
    ttft = by_stage.get("ttft")
    parts = [s for s in ("queue", "prefill", "remote_read") if s in by_stage]
    if not ttft or not parts:
        return

    def tot(rs: list[dict[str, Any]], k: str) -> float:
        return sum(r[k] for r in rs)

    n = tot(ttft, "count")
    if any(not math.isclose(tot(by_stage[s], "count"), n) for s in parts) or math.isnan(n):
        run.cannot.append(
            f"aggregate `other`: stage histogram counts differ from TTFT's ({n:g}); "
            f"{', '.join(parts)} and TTFT cover different requests")
        return
    other = tot(ttft, "sum_s") - sum(tot(by_stage[s], "sum_s") for s in parts)
    rows.append({
        "metric": "derived: ttft - " + " - ".join(parts), "labels": "", "stage": "other",
        "unit": "seconds", "count": n, "sum": other, "sum_s": other,
        "mean": other / n if n else math.nan, "p50": math.nan, "p90": math.nan,
        "p99": math.nan, "buckets": 0, "complete": True,
        "note": "sum only: quantiles of a difference are not derivable from histograms"})
    run.derived.append(
        f"aggregate other = TTFT sum - {' - '.join(parts)} sums = {other:.6g} s over {n:g} "
        "requests (the part of TTFT no engine histogram explains)")


def _notes(run: ImportedRun, rows: list[dict[str, Any]]) -> None:
    staged = sorted({r["stage"] for r in rows if r["stage"]})
    run.derived.append(INTERPOLATION)
    if staged:
        run.can.append("stage distributions (count, sum, p50/p90/p99): " + ", ".join(staged))
    if run.ratios:
        run.can.append("hit ratios with the engine's own denominators: "
                       + ", ".join(r["name"] for r in run.ratios))
    for r in rows:
        if not r["complete"]:
            run.cannot.append(f"{r['metric']}{{{r['labels']}}}: {r['note']}")
    run.cannot.append("per-request TTFT partition: a scrape holds aggregates, no requests")
    if run.source == "vllm-prometheus-v0":
        run.cannot.append("queue/prefill split: vLLM v0 names have no queue or prefill histogram")
    if run.source == "sglang-prometheus" and not any(r["stage"] == "queue" for r in rows):
        run.cannot.append("queue time: no sglang:queue_time_seconds in this scrape")
    run.cannot.append("token sources (device hit / host / remote / recomputed) per request")
