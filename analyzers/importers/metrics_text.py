"""vLLM (v0 and v1 names) and SGLang `/metrics` scrapes → stage distributions and labelled ratios.

kvscope's own exposition (``kvscope_*``, from `kvscope run` or `kvscope agent`) is read by
`analyzers.importers.kvscope_text` with this module's parser and histogram reader.

A scrape is aggregate-only: it has no requests and no spans, so it cannot give a per-request TTFT
partition. What it gives is histogram-derived distributions per stage (queue, prefill, TTFT, …)
and the engines' hit ratios, each labelled with *its own* denominator (vLLM v1 counts queried
prompt tokens; v0's hit rate is a precomputed gauge; SGLang's covers the last prefill batch).

Quantiles are estimated as PromQL's ``histogram_quantile`` does: linear interpolation inside the
bucket holding the rank, the first bucket starting at 0, and the last finite bound when the rank
falls in ``+Inf``. A histogram cut short (no ``+Inf`` bucket and no ``_count``, as in the shared
v0 scrape) is imported with what it has: its total is unknown, so no quantile is estimated.

SGLang's `cache_hit_rate` meant different things in different releases (`SGLANG_NEWER`): the
scrape's metric names say which releases wrote it (`sglang_semantics`), and the ratio is labelled
with the semantics it was read with. A scrape whose histograms hold no observation derives
nothing and says so. A sample no histogram can have (``le`` that is not a number, a count that is
negative or not finite, a duplicate series) is an InputError naming the line.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from agent.errors import InputError
from analyzers.importers.base import ImportedRun, field_error, read_bytes
from analyzers.units import fmt_ns

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
    "queue_time_s": ("queue", "seconds"),  # its name in 0.5.2 (declared, never observed)
    "prompt_tokens_histogram": (None, "tokens"),
    "generation_tokens_histogram": (None, "tokens"),
    "e2e_request_latency_seconds": ("e2e", "seconds"),
    "inter_token_latency_seconds": ("itl", "seconds"),
    "time_per_output_token_seconds": ("itl", "seconds"),
}
#: SGLang per_stage_req_latency_seconds{stage=...} → kvscope stage
_SGLANG_STAGE = {"prefill_forward": "prefill", "prefill_transfer_kv_cache": "remote_read"}
#: SGLang's `cache_hit_rate` changed meaning (read in the releases' sglang/srt/managers/
#: scheduler.py and sglang/srt/metrics/collector.py): 0.3.6 (the first release with
#: /metrics) to 0.4.3 set it to hit / total prompt tokens of the radix cache *since server
#: start* (`tree_cache_metrics`); from 0.4.4 it is the most recent prefill batch's
#: `log_hit_tokens / (log_input_tokens + log_hit_tokens)`, set back to 0 by each decode-batch
#: log. Both are fractions (0..1); the server log prints them ×100. A scrape says which it is
#: by the metrics beside it: these names appear from 0.4.4 on (the version ranges they
#: were exported in) ...
SGLANG_NEWER = {
    "sglang:inter_token_latency_seconds": ">= 0.4.4",
    "sglang:cached_tokens_total": ">= 0.4.4",
    "sglang:avg_request_queue_latency": "0.4.6 .. 0.5.2",
    "sglang:queue_time_s": "0.5.2",
    "sglang:queue_time_seconds": ">= 0.5.3",
    "sglang:per_stage_req_latency_seconds": ">= 0.5.3",
}
#: ... and this one only up to 0.4.4 (replaced by inter_token_latency_seconds in 0.4.5)
SGLANG_OLDER = "sglang:time_per_output_token_seconds"
SGLANG_CUMULATIVE = "0.3.6 .. 0.4.3"
#: where SGLang's TTFT starts, in every release read (0.3.6 .. 0.5.23): the tokenizer
#: manager's `created_time` (the request's arrival), so it includes the scheduler queue
SGLANG_TTFT = ("sglang TTFT runs from the tokenizer manager receiving the request to the first "
               "token in every release read (0.3.6 .. 0.5.23), so it includes the queue")

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
        InputError: not Prometheus text (naming the first line the parser refuses), no
            vLLM/SGLang/kvscope metric in it, or a histogram sample no histogram has (``le`` that is
            not a number, a count that is negative or not finite, a duplicate series).
    """
    try:
        text = read_bytes(path).decode("utf-8").removeprefix("\ufeff")  # a byte order mark
    except UnicodeDecodeError as exc:
        line = read_bytes(path)[: exc.start].count(b"\n") + 1
        raise InputError(f"{path}: line {line}: not UTF-8 text (expected a Prometheus scrape)"
                         ) from None
    samples = _parse(text, path)
    names = {n for n, _, _ in samples}
    if any(n.startswith("vllm:") for n in names):
        v1 = any(n.startswith(p) for n in names for p in _V1_ONLY)
        source, prefix, table = ("vllm-prometheus-v1" if v1 else "vllm-prometheus-v0",
                                 "vllm:", _VLLM_HIST)
    elif any(n.startswith("sglang:") for n in names):
        source, prefix, table = "sglang-prometheus", "sglang:", _SGLANG_HIST
    elif any(n.startswith("kvscope_") for n in names):
        from analyzers.importers.kvscope_text import load_kvscope

        return load_kvscope(path, samples, text)
    else:
        raise InputError(f"{path}: Prometheus text without vllm:, sglang: or kvscope_ "
                         "metrics")

    run = ImportedRun.empty(source, path)
    dist_rows, hist_names = _histograms(samples, prefix, table, text, path, run)
    scalars = {n: v for n, v in _scalars(samples, hist_names).items()}
    run.summary = {"gauges_and_counters": scalars, "series": len(samples)}
    if source == "sglang-prometheus":
        run.summary["sglang_semantics"] = sglang_semantics(names)
    run.ratios = _ratios(samples, source, run)
    _aggregate_other(dist_rows, run)
    _notes(run, dist_rows)
    import pandas as pd

    run.distributions = pd.DataFrame(dist_rows, columns=[
        "metric", "labels", "stage", "unit", "count", "sum", "sum_s", "mean",
        "p50", "p90", "p99", "buckets", "complete", "note"])
    return run


def _parse(text: str, path: Path) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample; the parser's refusal names the line."""
    from prometheus_client.parser import text_string_to_metric_families

    def parse(t: str) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, dict(s.labels), float(s.value))
                for fam in text_string_to_metric_families(t) for s in fam.samples]

    try:
        return parse(text)
    except ValueError as exc:
        first = _exc_text(exc)
    # The parser does not say where: find the first line whose prefix it refuses (bisect).
    lines = text.split("\n")
    lo, hi = 0, len(lines)  # lines[:hi] fails; find the smallest such hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            parse("\n".join(lines[:mid]) + "\n")
            lo = mid
        except ValueError:
            hi = mid
    shown_line = lines[hi - 1].strip()[:60] if hi else ""
    raise InputError(f"{path}: line {hi}: not valid Prometheus text ({first}): "
                     f"{shown_line!r}") from None


def _exc_text(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return (msg[:80] + "...") if len(msg) > 80 else (msg or type(exc).__name__)


def _line_of(text: str, name: str, labels: dict[str, str]) -> int | None:
    """The line number of sample `name{labels}` (for error messages only)."""
    fallback = None
    for n, line in enumerate(text.split("\n"), 1):
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " ", "\t"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return n
        fallback = fallback or n
    return fallback


def _where(text: str, name: str, labels: dict[str, str]) -> str:
    n = _line_of(text, name, labels)
    lk = _label_key(labels, keep_le=True)
    return f"line {n} ({name}{{{lk}}})" if n else f"{name}{{{lk}}}"


def sglang_semantics(names: set[str]) -> dict[str, Any]:
    """Which SGLang releases a scrape comes from, judged by the metric names in it, and so what
    its `cache_hit_rate` means (see SGLANG_NEWER).

    Args:
        names: the scrape's sample names.
    Returns:
        ``{"cache_hit_rate": "last_prefill_batch" | "cumulative" | "unknown", "versions",
        "evidence": [metric names], "ttft"}``.
    """
    bases = {_base(n) for n in names}
    newer = sorted(n for n in SGLANG_NEWER if n in bases)
    if newer:
        kind, versions = "last_prefill_batch", ">= 0.4.4"
        evidence = [f"{n} ({SGLANG_NEWER[n]})" for n in newer]
    elif SGLANG_OLDER in bases:
        kind, versions = "cumulative", SGLANG_CUMULATIVE
        evidence = [f"{SGLANG_OLDER} (<= 0.4.4) and no metric added in 0.4.4 or later"]
    else:
        kind, versions, evidence = "unknown", "unknown", []
    return {"cache_hit_rate": kind, "versions": versions, "evidence": evidence,
            "ttft": SGLANG_TTFT}


def _base(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _label_key(labels: dict[str, str], keep_le: bool = False) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if keep_le or k != "le")


def _unit_of(short: str) -> str:
    """A histogram's unit from its name, for those no table lists."""
    if short.endswith("_seconds"):
        return "seconds"
    if short.endswith("_s"):
        return "seconds"
    if "tokens" in short:
        return "tokens"
    if short.endswith("_bytes"):
        return "bytes"
    return ""


def _histograms(samples: list[tuple[str, dict[str, str], float]], prefix: str,
                table: dict[str, tuple[str | None, str]], text: str, path: Path,
                run: ImportedRun, stage_label: dict[str, str] | None = None
                ) -> tuple[list[dict[str, Any]], set[str]]:
    """One distribution row per histogram series (metric × labels other than `le`).

    `stage_label` maps a histogram (name without `prefix`) to the label that names its stage
    (kvscope's ``request_stage_seconds{stage=...}``)."""
    buckets: dict[tuple[str, str], dict[float, float]] = defaultdict(dict)
    sums: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], float] = {}
    labels_of: dict[tuple[str, str], dict[str, str]] = {}
    for name, labels, value in samples:
        if name.endswith("_bucket") and "le" in labels:
            key = (name[: -len("_bucket")], _label_key(labels))
            try:
                le = float(labels["le"])
            except ValueError:
                raise field_error(path, _where(text, name, labels), "le",
                                  f"{labels['le']!r} is not a number") from None
            if math.isnan(le):
                raise field_error(path, _where(text, name, labels), "le", "NaN is no bound")
            if le in buckets[key]:
                raise field_error(path, _where(text, name, labels), "le",
                                  f"duplicate bucket le={labels['le']!r}")
            _check_count(value, text, name, labels, path)
            buckets[key][le] = value
            labels_of[key] = {k: v for k, v in labels.items() if k != "le"}
    bases = {b for b, _ in buckets}
    for name, labels, value in samples:
        for suffix, store in (("_sum", sums), ("_count", counts)):
            if name.endswith(suffix) and name[: -len(suffix)] in bases:
                key = (name[: -len(suffix)], _label_key(labels))
                if key in store:
                    raise field_error(path, _where(text, name, labels), "value",
                                      "duplicate series")
                if suffix == "_count":
                    _check_count(value, text, name, labels, path)
                elif not math.isfinite(value):
                    raise field_error(path, _where(text, name, labels), "value",
                                      f"a histogram sum must be finite, got {value}")
                store[key] = value
    rows = []
    for key in sorted(buckets):
        base, lkey = key
        short = base[len(prefix):] if base.startswith(prefix) else base
        stage, unit = table.get(short, (None, _unit_of(short)))
        if short == "per_stage_req_latency_seconds":
            stage = _SGLANG_STAGE.get(labels_of[key].get("stage", ""))
        if stage_label and short in stage_label:
            stage = labels_of[key].get(stage_label[short]) or None
        bk = sorted(buckets[key].items())
        fixed = _monotonic(bk)
        if fixed:
            run.derived.append(f"{base}{{{lkey}}}: bucket counts decrease at le={fixed:g}; "
                               "made cumulative (running maximum, as PromQL does)")
        rows.append(_row(base, lkey, stage, unit, bk, sums.get(key), counts.get(key)))
    hist_series = {f"{b}{s}" for b in bases for s in ("_bucket", "_sum", "_count", "_created")}
    return rows, hist_series


def _check_count(value: float, text: str, name: str, labels: dict[str, str],
                 path: Path) -> None:
    if not math.isfinite(value) or value < 0:
        raise field_error(path, _where(text, name, labels), "value",
                          f"a histogram count must be a finite number >= 0, got {value:g}")


def _monotonic(bk: list[tuple[float, float]]) -> float | None:
    """Make cumulative counts non-decreasing in place; the first bound that decreased."""
    first = None
    top = -math.inf
    for i, (le, c) in enumerate(bk):
        if c < top:
            first = le if first is None else first
            bk[i] = (le, top)
        else:
            top = c
    return first


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
           note: str = "", zero: str = "") -> dict[str, Any]:
    value = (num / den) if (num is not None and den) else None
    out = {"name": name, "numerator": num, "denominator": den, "denominator_unit": unit,
           "source_metric": metric, "value": value, "note": note}
    if den == 0:
        out["undefined"] = zero or f"no {unit}"
    return out


def _ratios(samples: list[tuple[str, dict[str, str], float]], source: str,
            run: ImportedRun) -> list[dict[str, Any]]:
    out = []
    if source.startswith("vllm"):
        hits = _total(samples, "vllm:prefix_cache_hits_total")
        queries = _total(samples, "vllm:prefix_cache_queries_total")
        if queries is not None:
            out.append(_ratio(
                "prefix_cache_hit", hits, queries, "queried prompt tokens (blocks in older vLLM)",
                "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total",
                "hits are block-aligned, capped at num_tokens - 1; preempted requests apart",
                zero="no lookups yet"))
        ext_h = _total(samples, "vllm:external_prefix_cache_hits_total")
        ext_q = _total(samples, "vllm:external_prefix_cache_queries_total")
        if ext_q is not None:
            out.append(_ratio(
                "external_prefix_cache_hit", ext_h, ext_q,
                "prompt tokens left after the local hit",
                "vllm:external_prefix_cache_hits_total / vllm:external_prefix_cache_queries_total",
                "a connector hit counts even if the load later fails",
                zero="no external lookups yet"))
        by_src = {lab.get("source"): v for n, lab, v in samples
                  if n == "vllm:prompt_tokens_by_source_total"}
        den = sum(by_src.values())
        for src, v in sorted((k, v) for k, v in by_src.items() if k):
            out.append(_ratio(f"prompt_tokens_{src}", v, den, "prompt tokens (all sources)",
                              "vllm:prompt_tokens_by_source_total", zero="no prompt tokens yet"))
        for tier in ("gpu", "cpu"):
            g = _total(samples, f"vllm:{tier}_prefix_cache_hit_rate")
            if g is not None:
                note = ("precomputed gauge: denominator unknown (v0 counts blocks since start)"
                        + ("; -1 means prefix caching off or no queries yet" if g < 0 else ""))
                out.append({"name": f"{tier}_prefix_cache_hit_rate", "numerator": None,
                            "denominator": None, "denominator_unit": "unknown",
                            "source_metric": f"vllm:{tier}_prefix_cache_hit_rate",
                            "value": g if 0 <= g <= 1 else None, "note": note})
                if not (g < 0 or 0 <= g <= 1):
                    run.cannot.append(f"{tier}_prefix_cache_hit_rate: the gauge reads {g:g}, "
                                      "not a fraction in [0, 1]; not read")
    else:
        g = _total(samples, "sglang:cache_hit_rate")
        if g is not None:
            out.append(_sglang_hit_rate(g, run))
        prompt = _total(samples, "sglang:prompt_tokens_total")
        cached = defaultdict(float)
        for n, lab, v in samples:
            if n == "sglang:cached_tokens_total":
                cached[lab.get("cache_source", "")] += v
        for src, v in sorted(cached.items()):
            out.append(_ratio(f"cached_tokens_{src or 'all'}", v, prompt, "prompt tokens",
                              "sglang:cached_tokens_total / sglang:prompt_tokens_total",
                              zero="no prompt tokens yet"))
    return out


def _sglang_hit_rate(g: float, run: ImportedRun) -> dict[str, Any]:
    """`sglang:cache_hit_rate`, read with the semantics of the releases the scrape is from."""
    sem = run.summary["sglang_semantics"]
    kind = sem["cache_hit_rate"]
    if kind == "last_prefill_batch":
        unit = "tokens of the most recent prefill batch only"
        note = ("a gauge over the last prefill batch (sglang >= 0.4.4), set to 0 by each "
                "decode-batch log; not the run")
    elif kind == "cumulative":
        unit = "prompt tokens looked up in the radix cache since server start"
        note = (f"cumulative since server start (sglang {SGLANG_CUMULATIVE}: hit / total of "
                "the scheduler's tree_cache_metrics); a fraction, not a percentage")
    else:
        unit = "unknown"
        note = (f"cumulative since start (sglang {SGLANG_CUMULATIVE}) or the last prefill "
                "batch (>= 0.4.4): this scrape has none of the metrics that tell them apart")
    how = (f"sglang:cache_hit_rate read as {kind.replace('_', ' ')} (sglang {sem['versions']}"
           + (f"; evidence: {'; '.join(sem['evidence'])}" if sem["evidence"] else "") + ")")
    run.derived.append(how if kind != "unknown" else
                       "sglang:cache_hit_rate: which releases wrote this scrape is unknown "
                       "(none of the metrics that tell them apart)")
    if kind == "unknown":
        run.cannot.append("what sglang:cache_hit_rate covers (the run since start, or the last "
                          "prefill batch): the scrape does not say which release wrote it")
    ok = math.isfinite(g) and 0 <= g <= 1
    if not ok:
        run.cannot.append(f"sglang:cache_hit_rate: the gauge reads {g:g}, not a fraction in "
                          "[0, 1]; not read")
    return {"name": "cache_hit_rate", "numerator": None, "denominator": None,
            "denominator_unit": unit, "source_metric": "sglang:cache_hit_rate",
            "value": g if ok else None, "note": note, "semantics": kind,
            "versions": sem["versions"]}


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
    if n == 0:
        run.cannot.append("aggregate `other`: no request observed yet (TTFT histogram count "
                          "0): nothing derived")
        return
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
        f"aggregate other = TTFT sum - {' - '.join(parts)} sums = {fmt_ns(other * 1e9)} over "
        f"{n:,.0f} requests (the part of TTFT no engine histogram explains)"
        + (f"; {SGLANG_TTFT}" if run.source == "sglang-prometheus" else ""))


def _notes(run: ImportedRun, rows: list[dict[str, Any]]) -> None:
    observed = [r for r in rows if r["count"] == r["count"] and r["count"] > 0]
    staged = sorted({r["stage"] for r in observed if r["stage"]})
    idle = sorted({r["stage"] for r in rows if r["stage"] and r["count"] == 0} - set(staged))
    if any(r["p50"] == r["p50"] for r in observed):  # a quantile was estimated
        run.derived.append(INTERPOLATION)
    if staged:
        run.can.append("stage distributions (count, sum, p50/p90/p99): " + ", ".join(staged))
    if idle:
        run.cannot.append(f"stage distributions of {', '.join(idle)}: their histograms hold "
                          "0 observations")
    if not observed:
        zero = sum(1 for r in rows if r["count"] == 0)
        unknown = sum(1 for r in rows if r["count"] != r["count"])
        why = [f"{zero} histogram series hold 0 observations (an idle server?)"] if zero else []
        why += [f"{unknown} series have no known total (cut short)"] if unknown else []
        run.cannot.append("distributions: no quantile or mean could be estimated: "
                          + ("; ".join(why) if why else "the scrape has no histograms"))
    known = [r["name"] for r in run.ratios if r["value"] is not None]
    if known:
        run.can.append("hit ratios with the engine's own denominators: " + ", ".join(known))
    for r in run.ratios:
        if r.get("undefined"):
            run.cannot.append(f"{r['name']}: {r['numerator'] or 0:,.0f} / 0 "
                              f"{r['denominator_unit']} ({r['undefined']})")
    for r in rows:
        if not r["complete"]:
            run.cannot.append(f"{r['metric']}{{{r['labels']}}}: {r['note']}")
    run.cannot.append("per-request TTFT partition: a scrape holds aggregates, no requests")
    if run.source == "vllm-prometheus-v0":
        run.cannot.append("queue/prefill split: vLLM v0 names have no queue or prefill histogram")
    if run.source == "sglang-prometheus" and not any(r["stage"] == "queue" for r in rows):
        run.cannot.append("queue time: no sglang:queue_time_seconds in this scrape (SGLang "
                          "has no queue histogram before 0.5.3; 0.5.2 declares "
                          "sglang:queue_time_s but never observes it)")
    run.cannot.append("token sources (device hit / host / remote / recomputed) per request")
