"""The `kvscope analyze` report: built from a run store by the analyzers, rendered as text,
markdown or JSON. Rendering is kept apart from the analysis (which lives in `ttft`,
`accounting`); nothing here computes a figure of its own.

The report leads with the TTFT breakdown, then the token accounting with its denominators, the
prefill rate and time saved, the per-layer table and the checks; the diagnoses
(`analyzers.diagnose`) follow: findings with their evidence and next step, and the rules the run
lacked the data for. JSON carries them under ``findings`` and ``diagnoses``.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from agent.runstore.reader import block_size_of
from agent.schema import TTFT_STAGES
from analyzers import frames as F
from analyzers.accounting import (
    SecondsSaved,
    TokenAccounting,
    group_limits,
    layer_groups_of,
    layer_table,
    prefill_seconds_saved,
    token_accounting,
)
from analyzers.checks import accounting_problem, ledger_problem, partition_problem
from analyzers.consistency import Consistency, check_consistency, kv_bytes_per_block_of
from analyzers.costmodel import StepCost, fit_step_cost
from analyzers.diagnose import DiagnoseReport, diagnose_report, render_markdown, render_text
from analyzers.diagnose.model import share
from analyzers.render import Table, md_table, text_table
from analyzers.report_read import (  # noqa: F401  (re-exported: what kvscope analyze reads)
    REPORT_SPAN_COLUMNS,
    STEP_SPAN_COLUMNS,
    STEP_SPANS_APART,
    StepSamples,
    read_report_store,
)
from analyzers.timebase import run_origin_ns
from analyzers.ttft import PARTITION_SPAN_COLUMNS, partition, summarize, violations
from analyzers.ttft_summary import TTFTSummary, records
from analyzers.units import fmt_ns, fmt_pct, fmt_s
from analyzers.vllm_side import render_lines as vllm_side_lines
from analyzers.vllm_side import vllm_side_of

#: Version of the JSON report layout; bumped on an incompatible change.
#: 2: "prefill" carries the fitted step cost model ("cost") instead of a measured rate
#: ("rate"); "consistency" added; windows count from the run's start.
REPORT_VERSION = 2
#: The rows `kvscope analyze` reads into its spans frame: every kind but the steps, which only
#: the step cost model reads (`STEP_SPAN_COLUMNS` of them, read apart: `STEP_SPANS_APART`).
REPORT_SPAN_FILTER = pc.field("kind") != "step"
#: Version of the JSON comparison layout (`kvscope compare --format json`).
COMPARE_VERSION = 1
FORMATS = ("text", "markdown", "json")
#: The events a circuit breaker of the remote tier records (instrumented_engine.tiers.remote).
BREAKER_EVENTS = ("circuit_open", "circuit_close")
#: How many slowest-request ids, and breaker events, the text report names.
LISTED_IDS = 5
LISTED_EVENTS = 8


@dataclass(slots=True)
class Report:
    """Everything `kvscope analyze` prints, as analyzer outputs."""

    run: dict[str, Any]
    ttft: TTFTSummary
    violations: pd.DataFrame
    accounting: TokenAccounting
    layers: pd.DataFrame
    cost: StepCost
    saved: SecondsSaved
    consistency: Consistency
    diagnoses: DiagnoseReport | None = None
    #: False when the source carries no token accounting (an imported trace): the accounting
    #: sections then say so instead of printing zeros.
    accounting_known: bool = True
    #: Ids of the requests at or above the p99 TTFT, slowest first (whole run; not by group).
    slowest_ids: list[str] = field(default_factory=list)
    #: Faults run.json says were injected (``--fault`` specs, e.g. ``remote-error-rate=0.5``).
    faults: list[str] = field(default_factory=list)
    #: Circuit-breaker changes from the events table: ``{name, op, ts_ns, t_s}`` (t_s: seconds
    #: since the run's start), in time order.
    breaker_events: list[dict[str, Any]] = field(default_factory=list)
    #: Injected-fault events (``fault`` events of the remote tier) by kind.
    fault_events: dict[str, int] = field(default_factory=dict)
    #: The run's KV-cache layer groups (run.json; [] for a model with one kind of layer).
    layer_groups: list[dict[str, Any]] = field(default_factory=list)
    #: Device hits a layer group shortened (`analyzers.accounting.group_limits`).
    group_limits: list[dict[str, Any]] = field(default_factory=list)
    #: A vLLM observer's run: kvscope's partition beside vLLM's queued/prefill
    #: (`analyzers.vllm_side`); None for other runs.
    vllm_side: Any = None


def build_report(store: Any, *, diagnose: bool = True, by: str | None = None,
                 window_ns: int | None = None, steps: pa.Table | StepSamples | None = None
                 ) -> Report:
    """Run the analyzers (and, unless `diagnose` is False, the diagnoses) over a run.

    Args:
        store: an `agent.runstore.RunStore`, or anything with the same `requests`, `spans`,
            `layers`, `samples`, `events` frames and `meta`, `gaps`, `path`.
        diagnose: run `analyzers.diagnose` and append its findings.
        by: optional grouping of the TTFT table (tenant, workload_class, hit_class).
        window_ns: window length for percentiles over time.
        steps: the run's step spans as an Arrow table (`STEP_SPAN_COLUMNS`, string columns
            plain or dictionary-encoded; e.g. ``store.apart["spans"]`` of
            `read_report_store`, as `kvscope analyze` reads a run, or from
            ``agent.runstore.reader.read_table``), or their `StepSamples`
            (``read_report_store(path, samples=True).apart["spans"]``), when `store` was read
            without them (``filters={"spans": REPORT_SPAN_FILTER}``).

    Returns:
        a `Report`.
    """
    meta = store.meta
    # The step cost model's bootstrap is numpy work that needs nothing else: it runs in a
    # second thread beside the analyzers that do not need it (same result, same seed). With
    # the step spans given apart (Arrow), it starts before any DataFrame is built. The
    # consistency check, which nothing else reads, runs in a third beside the partition,
    # the summaries and the diagnoses; its error, should it raise, is the one raised when
    # the analyzers after it raise too (the order they ran in one after the other).
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvscope-report") as pool:
        estimated: Future[StepCost] = Future()
        spare_core = threading.Event()  # set once only the bootstrap is left running
        fitting = None if steps is None else pool.submit(_fit, steps, estimated, spare_core)
        req = store.requests
        spans, step_source, spans_end = _spans_and_steps(store, steps)
        if fitting is None:
            fitting = pool.submit(_fit, step_source, estimated, spare_core)
        # The check starts as soon as the spans frame is made, beside the partition: on two
        # cores it was the last thing running. An error of the partition (or of what comes
        # before it) is raised as it was when the check ran after it.
        checking = pool.submit(check_consistency, req, spans, block_size=block_size_of(meta),
                               kv_bytes_per_block=kv_bytes_per_block_of(meta))
        origin = run_origin_ns(meta, store)
        groups = layer_groups_of(meta)
        part = partition(req, _partition_spans(store, req, spans))
        try:
            ttft = summarize(part, by=by, window_ns=window_ns, origin_ns=origin)
            accounting = token_accounting(req)
            layers = layer_table(store.layers, groups)
            limits = group_limits(spans, req, groups)
            estimated.result()  # (a fit that fails before its estimates raises here)
            diag = None
            if diagnose:
                # The rules read the model's estimates, known before its bootstrap
                # intervals: they run while the resamples are drawn (`_PendingCost`).
                diag = diagnose_report(req, spans, layers=store.layers, samples=store.samples,
                                       events=store.events, run_config=meta.get("config"),
                                       part=part, cost=_PendingCost(estimated, fitting),
                                       origin_ns=origin, run_path=str(store.path),
                                       spans_end_ns=spans_end)
            # This thread and the consistency check done, the bootstrap (when still
            # drawing) shares its remaining fits with a second thread: a core is free.
            checking.add_done_callback(lambda _: spare_core.set())
            cost = fitting.result()
        except BaseException:
            if checking.exception() is not None:
                raise checking.exception() from None
            raise
        consistency = checking.result()
    writer = getattr(store, "writer", None)
    run = {
        "path": str(store.path),
        "run_id": meta.get("run_id"),
        "status": meta.get("status") if writer is None else writer.status,
        "state": meta.get("status") if writer is None else writer.describe(),
        "missing_requests": None if writer is None else writer.missing,
        "schema_version": meta.get("schema_version"),
        "model": _model_name(meta.get("config") or {}),
        "requests": len(req),
        "gaps": list(store.gaps),
        "origin_ns": origin,
    }
    return Report(
        run=run,
        ttft=ttft,
        violations=violations(part),
        accounting=accounting,
        layers=layers,
        cost=cost,
        saved=prefill_seconds_saved(req, cost, part),
        consistency=consistency,
        diagnoses=diag,
        accounting_known=_accounting_known(req),
        slowest_ids=_slowest_ids(part),
        faults=_injected_faults(meta.get("config")),
        breaker_events=_breaker_events(getattr(store, "events", None), origin),
        fault_events=_fault_events(getattr(store, "events", None)),
        layer_groups=groups,
        group_limits=limits,
        vllm_side=vllm_side_of(store),
    )


def _fit(steps: pd.DataFrame | pa.Table | StepSamples, estimated: Future[StepCost],
         spare_core: threading.Event | None = None) -> StepCost:
    """`fit_step_cost` of `steps`, its estimates set into `estimated` as soon as they are
    known (the whole model when the fit stops before them; its error when it raises
    first); `spare_core` as `fit_step_cost` reads it."""
    try:
        cost = fit_step_cost(steps, estimates=estimated.set_result, spare_core=spare_core)
    except BaseException as exc:
        if not estimated.done():
            estimated.set_exception(exc)
        raise
    if not estimated.done():
        estimated.set_result(cost)
    return cost


#: The `StepCost` attributes that its estimates alone give (the same with or without the
#: bootstrap: `fit_step_cost` draws the estimates before the resamples).
_ESTIMATED = frozenset(("fixed_ns", "per_token_ns", "steps", "token_range", "confidence",
                        "method", "reason", "fitted", "tokens_per_s", "recompute_ns"))


class _PendingCost:
    """The step cost model while its bootstrap runs: the estimates (`_ESTIMATED`) read from
    the estimates-only model as soon as it is known, anything else (the intervals,
    ``describe``, ``to_dict``) from the whole model, waited for. What the diagnoses read
    is what the whole model says."""

    __slots__ = ("_estimated", "_fitted")

    def __init__(self, estimated: Future[StepCost], fitted: Future[StepCost]) -> None:
        self._estimated = estimated
        self._fitted = fitted

    def __getattr__(self, name: str) -> Any:
        source = self._estimated if name in _ESTIMATED else self._fitted
        return getattr(source.result(), name)


def _spans_and_steps(store: Any, steps: pa.Table | StepSamples | None
                     ) -> tuple[pd.DataFrame, pd.DataFrame | pa.Table | StepSamples, int | None]:
    """The spans the report reads as a frame, what the step cost model reads, and the run's
    latest span end (None: the diagnoses take it from the frame).

    From a run store's Arrow table the step spans (most of a run's rows) are never made a
    DataFrame: the cost model reads them from Arrow, every other analyzer ignores them, and
    only their latest end is kept (the run's end for the diagnoses). `steps` given: the
    store was read without its step spans, and these are they. Other sources (imports) give
    their spans frame whole."""
    if steps is not None:
        spans = store.spans
        step_end = (steps.end_ns if isinstance(steps, StepSamples)
                    else pc.max(steps["end_ns"]).as_py() if steps.num_rows else None)
        ends = [int(x) for x in (step_end,
                                 F.ints(spans["end_ns"], -1).max() if len(spans) else None)
                if x is not None]
        return spans, steps, max(ends) if ends else None
    tables = getattr(store, "tables", None)
    tbl = tables.get("spans") if isinstance(tables, dict) else None
    if not isinstance(tbl, pa.Table) or not hasattr(store, "frame_without") or \
            "kind" not in tbl.column_names:
        return store.spans, store.spans, None
    end = pc.max(tbl["end_ns"]).as_py() if "end_ns" in tbl.column_names else None
    return store.frame_without("spans", "kind", "step"), tbl, end


def _partition_spans(store: Any, req: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """The spans for `partition`: from a run store (which writes a span's request_num with its
    request_id, `analyzers.ttft.PARTITION_SPAN_COLUMNS`), the columns that match spans to
    requests by the int64 request_num rather than by hashing every string id; the frame as
    it is when the numbers are missing anywhere the ids are not."""
    cols = list(PARTITION_SPAN_COLUMNS)
    if not hasattr(store, "frame_without") or not set(cols) <= set(spans.columns) or \
            not F.nums_name_ids(spans, req):
        return spans
    return spans[cols]


def _slowest_ids(part: pd.DataFrame) -> list[str]:
    """The requests at or above the p99 TTFT (the same threshold `summarize` uses), slowest
    first."""
    if not len(part) or "ttft_ns" not in part:
        return []
    served = part.loc[part["ttft_ns"].notna(), ["request_id", "ttft_ns"]]
    if not len(served):
        return []
    ttft = served["ttft_ns"].astype("float64").to_numpy()
    slow = served.loc[ttft >= np.quantile(ttft, 0.99)]
    slow = slow.assign(_t=slow["ttft_ns"].astype("float64")).sort_values(
        ["_t", "request_id"], ascending=[False, True], kind="stable")
    return [str(x) for x in slow["request_id"].tolist()]


def _injected_faults(config: Any) -> list[str]:
    """The ``--fault`` specs run.json records (config.options.faults and
    config.tiers.remote.faults), each once, in order."""
    def sub(d: Any, key: str) -> Any:
        return d.get(key) if isinstance(d, dict) else None

    found: list[str] = []
    for src in (sub(sub(config, "options"), "faults"),
                sub(sub(sub(config, "tiers"), "remote"), "faults")):
        if isinstance(src, str):
            src = [src]
        for x in src if isinstance(src, list | tuple) else ():
            if str(x) not in found:
                found.append(str(x))
    return found


def _events_named(events: Any, names: tuple[str, ...]) -> pd.DataFrame | None:
    if not isinstance(events, pd.DataFrame) or not len(events) or not {
            "name", "ts_ns"} <= set(events.columns):
        return None
    ev = events.loc[events["name"].isin(names) & events["ts_ns"].notna()]
    return ev.sort_values("ts_ns", kind="stable") if len(ev) else None


def _detail(d: Any) -> dict[str, Any]:
    if isinstance(d, dict):
        return d
    if isinstance(d, str):
        try:
            v = json.loads(d)
        except ValueError:
            return {}
        return v if isinstance(v, dict) else {}
    return {}


def _breaker_events(events: Any, origin_ns: int) -> list[dict[str, Any]]:
    """The remote tier's circuit_open / circuit_close events, in time order."""
    ev = _events_named(events, BREAKER_EVENTS)
    if ev is None:
        return []
    details = ev["detail"].tolist() if "detail" in ev else [None] * len(ev)
    return [{"name": str(name), "op": str(_detail(d).get("op", "read")), "ts_ns": int(t),
             "t_s": (int(t) - origin_ns) / 1e9}
            for name, t, d in zip(ev["name"].tolist(), ev["ts_ns"].tolist(), details,
                                  strict=True)]


def _fault_events(events: Any) -> dict[str, int]:
    """Injected-fault events (``fault`` from the remote tier's fault injector) by kind."""
    ev = _events_named(events, ("fault",))
    if ev is not None and "source" in ev:
        ev = ev.loc[ev["source"] == "remote"]
    if ev is None or not len(ev):
        return {}
    kinds = [str(_detail(d).get("kind", "unknown kind")) for d in (
        ev["detail"].tolist() if "detail" in ev else [None] * len(ev))]
    return {str(k): int(v) for k, v in pd.Series(kinds).value_counts().sort_index().items()}


def _ids_text(ids: list[str]) -> str:
    """``: r1, r2 and 3 more`` (the first `LISTED_IDS` ids), or nothing."""
    if not ids:
        return ""
    more = f" and {len(ids) - LISTED_IDS:,} more" if len(ids) > LISTED_IDS else ""
    return ": " + ", ".join(ids[:LISTED_IDS]) + more


def _fault_lines(report: Report) -> list[str]:
    """What was injected into the run and what the breakers did, for the report's top."""
    lines = []
    if report.faults:
        lines.append(f"injected faults: {', '.join(report.faults)}")
    if report.fault_events:
        total = sum(report.fault_events.values())
        kinds = ", ".join(f"{k} {v:,}" for k, v in report.fault_events.items())
        lines.append(f"injected fault events: {total:,} ({kinds})")
    ev = report.breaker_events
    if ev:
        opens = sum(1 for e in ev if e["name"] == "circuit_open")
        shown = "; ".join(f"{e['op']} {e['name']} at {fmt_s(e['t_s'])}"
                          for e in ev[:LISTED_EVENTS])
        more = (f"; and {len(ev) - LISTED_EVENTS:,} more (all in --format json)"
                if len(ev) > LISTED_EVENTS else "")
        last = {e["op"]: e["name"] for e in ev}
        still = [op for op, name in last.items() if name == "circuit_open"]
        lines.append(f"breaker events: {len(ev):,} ({opens:,} circuit_open, "
                     f"{len(ev) - opens:,} circuit_close; seconds since the run's start): "
                     f"{shown}{more}"
                     + (f"; still open at the end: {', '.join(still)}" if still else ""))
    elif report.faults:
        lines.append("breaker events: none recorded (no remote circuit breaker opened)")
    return lines


def _accounting_known(req: pd.DataFrame) -> bool:
    cols = ["device_hit_tokens", "recomputed_tokens"]
    return not len(req) or not all(c in req and bool(req[c].isna().all()) for c in cols)


def _model_name(config: dict[str, Any]) -> str | None:
    """The model a run served, wherever its producer put it in run.json's config."""
    engine_model = (config.get("engine") or {}).get("model")
    for v in (config.get("model"), engine_model, (config.get("options") or {}).get("model")):
        if isinstance(v, dict):
            v = v.get("model_id") or v.get("name")
        if isinstance(v, str) and v:
            return v
    return None


def render(report: Report, fmt: str) -> str:
    """`report` in `fmt` (text, markdown or json)."""
    if fmt == "json":
        return render_json(report)
    return render_doc(report, markdown=fmt == "markdown")


def render_json(report: Report) -> str:
    """The report as JSON. Layout (stable; `REPORT_VERSION` changes on a break):

    ``{"kvscope_report": 2, "run": {path, run_id, status, schema_version, model, requests,
    gaps, origin_ns}, "ttft": TTFTSummary.to_dict(), "partition_violations": [{request_id,
    violation, ttft_ns, derived}], "accounting": TokenAccounting.to_dict(), "consistency":
    Consistency.to_dict(), "layers": [row], "prefill": {"cost": StepCost.to_dict(), "saved":
    SecondsSaved.to_dict()},
    "findings": [Finding.to_dict()] | null, "diagnoses": DiagnoseReport.to_dict() | null,
    "slowest_request_ids": [id], "injected_faults": [spec], "fault_events": {kind: count},
    "breaker_events": [{name, op, ts_ns, t_s}], "layer_groups": [{name, kind, layers, window,
    num_blocks, kv_bytes_per_block}], "group_limits": [{group, layers, requests, tokens, served,
    hit_tokens}]}``
    (``diagnoses`` adds the rules not evaluated, with why, and the rules that passed), plus
    ``"vllm_side": VllmSide.to_dict()`` for a vLLM observer's run only. Times are
    integer or float ns; NaN is null.
    """
    doc = {
        "kvscope_report": REPORT_VERSION,
        "run": report.run,
        "ttft": report.ttft.to_dict(),
        "partition_violations": records(report.violations),
        "accounting": report.accounting.to_dict(),
        "consistency": report.consistency.to_dict(),
        "layers": records(report.layers),
        "prefill": {"cost": report.cost.to_dict(), "saved": report.saved.to_dict()},
        "findings": None if report.diagnoses is None else [f.to_dict() for f in
                                                           report.diagnoses.findings],
        "diagnoses": None if report.diagnoses is None else report.diagnoses.to_dict(),
        "slowest_request_ids": list(report.slowest_ids),
        "injected_faults": list(report.faults),
        "fault_events": dict(report.fault_events),
        "breaker_events": list(report.breaker_events),
        "layer_groups": list(report.layer_groups),
        "group_limits": list(report.group_limits),
    }
    if report.vllm_side is not None:  # a vLLM observer's run only (`analyzers.vllm_side`)
        doc["vllm_side"] = report.vllm_side.to_dict()
    return json.dumps(_clean(doc), indent=2, allow_nan=False) + "\n"


def _clean(v: Any) -> Any:
    if isinstance(v, float) and v != v:  # NaN
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


def render_doc(report: Report, *, markdown: bool = False) -> str:
    """The report as plain text (aligned columns) or markdown (headings and tables)."""
    out: list[str] = []

    def head(title: str) -> None:
        out.extend(["", f"## {title}", ""] if markdown else ["", title, "-" * len(title)])

    def table(t: Table) -> None:
        out.extend(md_table(t) if markdown else text_table(t, indent=2))

    r, s, a = report.run, report.ttft, report.accounting
    title = f"kvscope analyze: {r['path']}"
    out.append(f"# {title}" if markdown else title)
    out.append(f"run {r['run_id']} ({r['state']}), model {r['model'] or '-'}; "
               f"{r['requests']:,} requests: {s.requests:,} with a first token, "
               f"{s.without_first_token:,} without (left out of TTFT), {s.derived:,} derived "
               f"from activity spans")
    if r["gaps"]:
        out.append(f"gaps in the store: {'; '.join(r['gaps'])}")
    out.extend(_fault_lines(report))

    head(f"TTFT breakdown ({s.requests:,} requests)")
    table(_stage_rows(s))
    out.append("share: mean over requests of the stage's part of that request's TTFT; "
               "of total: the stage's part of all TTFT time. hidden load: KV loading that "
               "overlapped queue time (inside queue, not added to TTFT).")
    slow = s.slowest
    if len(slow) and not s.by:
        top = slow.sort_values("share", ascending=False)
        top = top[top["share"] > 0]
        spent = ", ".join(f"{row.stage} {fmt_pct(row.share)}" for row in top.itertuples())
        n_slow = int(slow["requests"].iloc[0])
        out.append("")
        out.append(f"Slowest requests (TTFT >= p99 {fmt_ns(slow['threshold_ns'].iloc[0])}, "
                   f"{n_slow:,} request{'s' if n_slow != 1 else ''}"
                   f"{_ids_text(report.slowest_ids)}) spent their time on: {spent}")
    if len(s.windows) > 1:
        head(f"TTFT over time ({fmt_ns(s.window_ns)} windows by arrival)")
        table(_window_rows(s))

    if not report.accounting_known:
        head("Token accounting")
        out.append("not in this source: it does not say where prompt tokens' KV came from "
                   "(device hit, host or remote load, recompute)")
    else:
        _accounting_section(report, out, head, table, markdown)

    if report.vllm_side is not None:
        head("kvscope's partition beside vLLM's queued_time / prefill_time")
        out.extend(vllm_side_lines(report.vllm_side))

    head("Checks")
    v = report.violations
    out.append(partition_problem(v) or
               f"partition: stages sum exactly to TTFT for all {s.requests:,} requests")
    iv = a.identity_violations
    if not report.accounting_known:
        out.append("accounting: not checked (no accounting in this source)")
    else:
        out.append(accounting_problem(iv) or
                   "accounting: prompt = device_hit + host_loaded + remote_loaded + "
                   f"recomputed holds for all {a.requests:,} requests")
    out.append(_consistency_line(report.consistency))

    if report.diagnoses is not None:
        if markdown:
            out.extend(["", render_markdown(report.diagnoses).rstrip("\n")])
        else:  # same section style as the rest; render_text's first line is its own title
            head("Diagnoses")
            out.extend(render_text(report.diagnoses).splitlines()[1:])
    return "\n".join(out) + "\n"


def _accounting_section(report: Report, out: list[str], head: Any, table: Any,
                        markdown: bool) -> None:
    """Token accounting, prefill rate and time saved, and the per-layer table."""
    a = report.accounting
    head(f"Token accounting ({a.requests:,} requests with a first token)")
    for level, title in (("token", "tokens"), ("request", "requests"), ("byte", "bytes")):
        rows = [x for x in a.ratios if x.level == level]
        out.append(f"{'**' if markdown else ''}{title}{'**' if markdown else ''}")
        table(Table(["ratio", "numerator / denominator"],
                    [[x.label, str(x)] for x in rows], align="ll"))
    out.append("")
    table(Table(["tier", "promised tokens", "found tokens", "loaded tokens", "shortfall tokens",
                 "read bytes", "written bytes"],
                [[t.tier, f"{t.promised_tokens:,}", f"{t.found_tokens:,}",
                  f"{t.loaded_tokens:,}", f"{t.shortfall_tokens:,}", f"{t.read_bytes:,}",
                  f"{t.written_bytes:,}"] for t in a.tiers.itertuples()]))
    out.append("promised: planned at admission (host) or arrival (remote) beyond the device "
               "hits; found: loaded where no lookup promised the tier; shortfall = promised - "
               "(loaded - found).")
    short = int(a.tiers["shortfall_tokens"].sum())
    failed = a.totals.get("load_failed_tokens", 0)
    if short:
        out.append(f"shortfall {short:,} tokens = {failed:,} failed loads"
                   + (f" + {short - failed:,} promised tokens served by another tier"
                      if short != failed else ""))

    head("Step cost and time saved by reuse")
    c, sv = report.cost, report.saved
    out.append(f"step cost model: {c.describe()}")
    if c.fitted:
        note = (f"(per-token cost known to +/- {100 * c.per_token_half_width:.0f} %"
                + (f"; poorly determined: {c.steps:,} prefill steps of "
                   f"{c.token_range[0]:,} to {c.token_range[1]:,} tokens"
                   if c.per_token_half_width > 0.2 else "") + ")")
        out.append(note)
        lo, hi = sv.gross_ci_seconds
        line = (f"reuse of {sv.reused_tokens:,} tokens saved about "
                f"{fmt_ns(sv.gross_seconds * 1e9)} of prefill ({fmt_ns(lo * 1e9)} .. "
                f"{fmt_ns(hi * 1e9)})")
        per_req = sv.reused_tokens / max(1, a.requests)
        if per_req > c.token_range[1]:
            line += (f" — extrapolated: requests reused {per_req:,.0f} tokens on average, the "
                     f"run's prefill steps scheduled at most {c.token_range[1]:,}")
        if sv.load_seconds is not None:
            line += (f"; loading them cost {fmt_ns(sv.load_seconds * 1e9)} of TTFT "
                     f"(remote_read + h2d + sync): net "
                     f"{fmt_ns(sv.net_seconds * 1e9, signed=True)}")
        out.append(line)

    if len(report.layers):
        head("Per layer (denominator: prompt tokens)")
        lt = report.layers
        grouped = bool(report.layer_groups) or bool((lt["skipped_tokens"] > 0).any())
        if not grouped:
            table(Table(["layer", "requests", "hit", "loaded", "recomputed", "load", "wait"],
                        [[str(x.layer), f"{x.requests:,}", fmt_pct(x.hit_share),
                          fmt_pct(x.loaded_share), fmt_pct(x.recomputed_share),
                          fmt_ns(x.load_ns), fmt_ns(x.wait_ns)] for x in lt.itertuples()]))
        else:
            table(Table(["layer", "group", "requests", "hit", "loaded", "recomputed", "skipped",
                         "load", "wait"],
                        [[str(x.layer), x.group or "", f"{x.requests:,}", fmt_pct(x.hit_share),
                          fmt_pct(x.loaded_share), fmt_pct(x.recomputed_share),
                          fmt_pct(x.skipped_share), fmt_ns(x.load_ns), fmt_ns(x.wait_ns)]
                         for x in lt.itertuples()]))
            out.append("skipped: prompt tokens outside a sliding-window layer's window, "
                       "neither read nor recomputed by it (hit + loaded + recomputed + "
                       "skipped = prompt, per layer)")
        for g in report.group_limits:
            out.append(
                f"Group limit: {share(g['requests'], g['served'], 'requests')} had their "
                f"device hit cut by the {g['group']} layers {g['layers']}: {g['tokens']:,} "
                "tokens the full-attention layers held were recomputed, because that group no "
                "longer held the blocks just before the hit's end (a hit is usable only up to "
                f"the shortest safe boundary of every group; the run's device hits used "
                f"{g['hit_tokens']:,} tokens)")


def _stage_rows(s: TTFTSummary) -> Table:
    st = s.stages
    group_cols = list(s.by)
    # --by: each group's size (its requests with a first token, from its TTFT row).
    sizes: dict[tuple[str, ...], int] = {}
    if group_cols and "requests" in st:
        for x in st.loc[st["stage"] == "ttft"].itertuples(index=False):
            d = x._asdict()
            sizes[tuple(str(d[c]) for c in group_cols)] = int(d["requests"])
    size_col = ["requests"] if sizes else []
    rows = []
    for x in st.itertuples(index=False):
        d = x._asdict()
        label = {"ttft": "TTFT", "hidden_load": "(hidden load)"}.get(d["stage"], d["stage"])
        share = "" if d["stage"] == "ttft" else fmt_pct(d["share_mean"])
        key = tuple(str(d[c]) for c in group_cols)
        n = [f"{sizes[key]:,}" if key in sizes else ""] if size_col else []
        rows.append([*key, *n, label,
                     fmt_ns(d["p50_ns"]), fmt_ns(d["p90_ns"]), fmt_ns(d["p99_ns"]),
                     fmt_ns(d["mean_ns"]), share,
                     "" if d["stage"] == "ttft" else fmt_pct(d["share_of_total"])])
    return Table([*group_cols, *size_col, "stage", "p50", "p90", "p99", "mean", "share",
                  "of total"], rows,
                 align="l" * len(group_cols) + "r" * len(size_col) + "l" + "r" * 6,
                 keys=len(group_cols) + len(size_col) + 1)


def _consistency_line(c: Consistency) -> str:
    if not c.available:
        return f"ledger: not checked ({c.reason})"
    problem = ledger_problem(c)
    if problem is not None:
        return problem
    extra = f"; {c.reason}" if c.reason else ""
    return (f"ledger: all {len(c.columns)} accounting columns of all {c.requests:,} requests "
            f"agree exactly with the recorded lookups, loads, reads and copies{extra}")


def _window_rows(s: TTFTSummary) -> Table:
    w = s.windows
    rows = []
    for x in w.itertuples(index=False):
        d = x._asdict()
        top = max(TTFT_STAGES, key=lambda st: d[f"{st}_p50_ns"])
        rows.append([fmt_s(d["window_start_s"]), f"{d['requests']:,}", fmt_ns(d["ttft_p50_ns"]),
                     fmt_ns(d["ttft_p90_ns"]), fmt_ns(d["ttft_p99_ns"]), top])
    return Table(["window start (since run start)", "requests", "TTFT p50", "p90", "p99",
                  "largest stage at p50"],
                 rows, align="rrrrrl")


def render_comparison(comp: Any, fmt: str) -> str:
    """A `analyzers.compare.Comparison` as text, markdown or JSON.

    JSON layout (stable): ``{"kvscope_compare": 1, **Comparison.to_dict()}`` (its own
    version, `COMPARE_VERSION`).
    """
    if fmt == "json":
        return json.dumps(_clean({"kvscope_compare": COMPARE_VERSION, **comp.to_dict()}),
                          indent=2, allow_nan=False) + "\n"
    markdown = fmt == "markdown"
    out: list[str] = []

    def head(title: str) -> None:
        out.extend(["", f"## {title}", ""] if markdown else ["", title, "-" * len(title)])

    def table(t: Table) -> None:
        out.extend(md_table(t) if markdown else text_table(t, indent=2))

    title = "kvscope compare"
    out.append(f"# {title}" if markdown else title)
    out.append(f"A (baseline): {comp.a_label} ({comp.requests_a:,} requests with a first token)")
    out.append(f"B: {comp.b_label} ({comp.requests_b:,} requests with a first token)")
    out.append("")
    out.append(f"{'**verdict**' if markdown else 'verdict'}: {comp.verdict}")
    out.extend(_factor_lines(comp))

    def ci(row: Any, tag: str) -> str:
        return (f"{fmt_ns(getattr(row, f'delta_{tag}_ns'), signed=True)} "
                f"[{fmt_ns(getattr(row, f'delta_{tag}_low_ns'), signed=True)}, "
                f"{fmt_ns(getattr(row, f'delta_{tag}_high_ns'), signed=True)}]")

    level = f"{100 * comp.level:.0f} %"
    head(f"TTFT percentiles by stage: B - A with {level} bootstrap intervals")
    rows = []
    for x in comp.stages.itertuples(index=False):
        label = "TTFT" if x.stage == "ttft" else x.stage
        rows.append([label, fmt_ns(x.a_p50_ns), fmt_ns(x.b_p50_ns), ci(x, "p50"),
                     fmt_ns(x.a_p99_ns), fmt_ns(x.b_p99_ns), ci(x, "p99")])
    table(Table(["stage", "A p50", "B p50", "change p50 [CI]", "A p99", "B p99",
                 "change p99 [CI]"], rows))
    out.append("Stage percentiles do not add up to the TTFT percentile; the means below do.")
    tail_pct = f"{100 * (1 - comp.tail):.0f} %"
    head(f"TTFT means by stage (they add up to the TTFT change), {level} intervals")
    rows = []
    for x in comp.stages.itertuples(index=False):
        label = "TTFT" if x.stage == "ttft" else x.stage
        rows.append([label, fmt_ns(x.a_mean_ns), fmt_ns(x.b_mean_ns), ci(x, "mean"),
                     ci(x, "tail_mean")])
    table(Table(["stage", "A mean", "B mean", "change of mean [CI]",
                 f"change of mean, slowest {tail_pct} [CI]"], rows))

    if comp.sources is not None:
        head("Token sources: where the change came from")
        out.extend(_source_lines(comp.sources))
    if comp.movers is not None and len(comp.movers):
        head("Requests that moved most (in both runs, by id)")
        table(Table(["request", "A TTFT", "B TTFT", "change", "stage that moved most"],
                    [[str(x.request_id), fmt_ns(x.a_ttft_ns), fmt_ns(x.b_ttft_ns),
                      fmt_ns(x.delta_ns, signed=True),
                      f"{x.stage} {fmt_ns(x.stage_delta_ns, signed=True)}"]
                     for x in comp.movers.itertuples(index=False)], align="lrrrl"))

    head("Accounting: B vs A")
    acct = comp.accounting
    moved = acct[(acct["key"] == "token_hit_share") | (acct["delta"].fillna(0) != 0)]
    rows = []
    for x in moved.itertuples(index=False):
        if x.delta is None or x.delta != x.delta:
            change = "-"
        elif x.delta_unit == "pts":
            change = f"{x.delta:+.1f} pts"
        else:
            change = f"{x.delta:+,.1f} {x.delta_unit}"
        rows.append([f"{x.label} ({x.unit})", _ratio_text(x, "a"), _ratio_text(x, "b"), change])
    table(Table(["ratio (denominator)", "A", "B", "change"], rows, align="lrrr"))
    if len(acct) > len(moved):
        out.append(f"{len(acct) - len(moved)} other ratios unchanged (all in --format json)")
    if comp.outputs is not None:
        head("Outputs: B vs A")
        out.extend(_outputs_lines(comp.outputs))
    return "\n".join(out) + "\n"


def _factor_lines(comp: Any) -> list[str]:
    """What differs between A and B besides the change: their flags and starting state."""
    lines: list[str] = []
    factors = comp.factors or []
    start = comp.start_state or {}
    sa, sb = start.get("a") or {}, start.get("b") or {}
    diffs = [f"{f['flag']} {f['a'] or '(not set)'} -> {f['b'] or '(not set)'}"
             for f in factors]
    for key, what in (("remote_objects", "remote objects at start"),
                      ("host_blocks", "host blocks at start")):
        if sa.get(key) is not None and sb.get(key) is not None and sa[key] != sb[key]:
            diffs.append(f"{what} {sa[key]:,} -> {sb[key]:,}")
    if comp.factors is None:
        return lines
    if not diffs:
        lines.append("A and B ran the same command from the same starting state: one factor "
                     "cannot explain the change; it is the runs' own variation")
    elif len(diffs) == 1:
        lines.append(f"A and B differ in one factor: {diffs[0]}")
    else:
        lines.append(f"A and B differ in {len(diffs)} factors ({'; '.join(diffs)}): the "
                     "change cannot be pinned on one of them; rerun changing one at a time")
    return lines


def _source_lines(src: dict[str, Any]) -> list[str]:
    tok = src["tokens_per_request"]
    parts = ", ".join(f"{k.replace('_', ' ')} {v['a']:,.0f} -> {v['b']:,.0f}"
                      for k, v in tok.items())
    lines = [f"prompt tokens per request by KV source (A -> B): {parts}"]
    st = src["stage_mean_ns"]
    exp = src.get("expected_prefill_delta_ns")
    d_rec = tok["recomputed"]["delta"]
    load = src["load_delta_ns"]
    if exp is not None:
        lines.append(f"{d_rec:+,.0f} recomputed tokens per request should move prefill by "
                     f"{fmt_ns(exp, signed=True)} per request (at the fitted "
                     f"{fmt_ns(src['per_token_ns'])} per token); prefill moved "
                     f"{fmt_ns(st['prefill']['delta_ns'], signed=True)}, the loads (remote_read "
                     f"+ h2d + sync) {fmt_ns(load, signed=True)}, queue "
                     f"{fmt_ns(st['queue']['delta_ns'], signed=True)}")
    else:
        lines.append(f"{d_rec:+,.0f} recomputed tokens per request; prefill moved "
                     f"{fmt_ns(st['prefill']['delta_ns'], signed=True)}, the loads "
                     f"{fmt_ns(load, signed=True)} (no step cost model to price the tokens)")
    if src.get("ate"):
        ate = src["ate"]
        d_ttft = st["ttft"]["delta_ns"]
        lead = (f"hits went up ({src['reused_delta_tokens']:+,.0f} reused tokens per "
                "request) but " if src["reused_delta_tokens"] > 0 else "")
        ate_ns = load if ate == "loads" else st[ate]["delta_ns"]
        what = "the loads (remote_read + h2d + sync)" if ate == "loads" else ate
        lines.append(f"{lead}TTFT moved {fmt_ns(d_ttft, signed=True)} per request, not the "
                     f"{fmt_ns(exp, signed=True)} the recompute change should give; of the "
                     f"{fmt_ns(d_ttft - exp)} not kept, {what} took "
                     f"{fmt_ns(ate_ns, signed=True)}, the largest rise")
    return lines


def _outputs_lines(o: dict[str, Any]) -> list[str]:
    """Whether the runs' output tokens agree, request by request (by digest)."""
    lines = []
    if o["compared"]:
        verb = "identical" if o["differ"] == 0 else "compared"
        lines.append(f"{o['identical']:,} / {o['compared']:,} requests in both runs "
                     f"({verb}) produced the same output tokens (by digest)")
    if o["differ"]:
        more = f" and {o['differ'] - len(o['differ_ids'])} more" if o["differ"] > len(
            o["differ_ids"]) else ""
        lines.append(f"{o['differ']:,} differ: {', '.join(o['differ_ids'])}{more}")
    if o["without_digest"]:
        lines.append(f"{o['without_digest']:,} requests in both runs have no output digest in "
                     "one of them (a schema-1 store, or no output token)")
    if o["only_a"] or o["only_b"]:
        lines.append(f"{o['only_a']:,} requests only in A, {o['only_b']:,} only in B")
    return lines or ["no request is in both runs"]


def _ratio_text(row: Any, side: str) -> str:
    num, den, val = (getattr(row, f"{side}_{k}") for k in ("numerator", "denominator", "value"))
    if row.delta_unit == "pts":
        return f"{num:,} / {den:,} ({fmt_pct(val)})"
    return f"{num:,} / {den:,} ({'-' if val is None else f'{val:,.1f}'} {row.delta_unit})"


def render_import(imp: Any, report: Report | None, fmt: str) -> str:
    """`kvscope analyze FILE`: what an importer could and could not derive, the source's own
    ratios (with *their* denominators), its distributions and totals, then — when the source
    has per-request rows — the usual report over them.

    Args:
        imp: an `analyzers.importers.ImportedRun`.
        report: `build_report(imp.as_store())`, or None for aggregate-only sources.
        fmt: text, markdown or json (JSON: the report's layout plus an ``import`` key).
    """
    if fmt == "json":
        doc = json.loads(render_json(report)) if report is not None else {
            "kvscope_report": REPORT_VERSION}
        doc["import"] = _clean_import(imp.to_dict())
        return json.dumps(doc, indent=2, allow_nan=False, default=str) + "\n"
    markdown = fmt == "markdown"
    out: list[str] = []

    def head(title: str) -> None:
        out.extend(["", f"## {title}", ""] if markdown else ["", title, "-" * len(title)])

    def table(t: Table) -> None:
        out.extend(md_table(t) if markdown else text_table(t, indent=2))

    title = f"kvscope analyze: {imp.path} (imported: {imp.source})"
    out.append(f"# {title}" if markdown else title)
    n_req, n_spans = len(imp.requests), len(imp.spans)
    line = f"{n_req:,} requests, {n_spans:,} spans"
    if n_req:
        line += f"; partition {'derived' if imp.partition_derived else 'as recorded'}"
    out.append(line)
    if not imp.can:
        out.append("nothing was derived from this file: what it lacks is listed under "
                   "cannot below")
    for label, notes in (("derived", imp.derived), ("can", imp.can),
                         ("cannot", imp.cannot)):
        for n in notes:
            out.append(f"- {label}: {n}")
    if imp.ratios:
        head("Ratios as the source defines them")
        rows = [[str(r.get("name")), _import_ratio(r), str(r.get("note") or "")]
                for r in imp.ratios]
        table(Table(["ratio", "value", "note"], rows, align="lll"))
    dist = imp.distributions
    if dist is not None and len(dist):
        head("Latency distributions (from histogram buckets; token histograms in tokens)")
        rows = []
        for d in dist.itertuples():
            unit = "" if _missing(d.unit) else str(d.unit)
            labels = getattr(d, "labels", None)
            rows.append([str(d.metric), "" if _missing(labels) else str(labels),
                         "-" if _missing(d.stage) else str(d.stage),
                         _num(d.count), *(_in_unit(v, unit) for v in (d.mean, d.p50, d.p90,
                                                                        d.p99)),
                         str(d.note or "")])
        # Labels tell apart the rows of one metric (a transfer kind, a step phase).
        table(Table(["metric", "labels", "stage", "count", "mean", "p50", "p90", "p99", "note"],
                    rows, align="lllrrrrrl"))
    _import_summary(imp, out, head, table)
    text = "\n".join(out) + "\n"
    if report is not None:
        # An import has no run id: name the file instead of printing "run None".
        shown = replace(report, run={**report.run, "run_id": report.run.get("run_id")
                                     or imp.path.name})
        text += "\n" + render(shown, fmt)
    # A name from the file may hold a lone surrogate (the standard library's JSON parser
    # accepts "\udc80"): escape it rather than fail writing the report.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _clean_import(v: Any) -> Any:
    """An import's dict for JSON: NaN → null; ±inf (a gauge may read +Inf) → "+Inf"/"-Inf",
    the exposition format's spelling, since JSON has no infinity."""
    if isinstance(v, float):
        if v != v:
            return None
        if v in (float("inf"), float("-inf")):
            return "+Inf" if v > 0 else "-Inf"
        return v
    if isinstance(v, dict):
        return {k: _clean_import(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean_import(x) for x in v]
    return v


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v) or v is pd.NA


def _num(v: Any) -> str:
    return "-" if _missing(v) or pd.isna(v) else f"{v:,.0f}"


def _sec(v: Any) -> str:
    return "-" if _missing(v) or pd.isna(v) else fmt_ns(float(v) * 1e9)


def _in_unit(v: Any, unit: str) -> str:
    """A histogram value in its metric's unit: seconds as durations, tokens as tokens."""
    if _missing(v) or pd.isna(v):
        return "-"
    v = float(v)
    if unit == "seconds":
        return fmt_ns(v * 1e9)
    digits = f"{v:,.0f}" if abs(v) >= 100 or v == int(v) else f"{v:,.3g}"
    if unit == "tokens":
        return f"{digits} tokens"
    if unit == "bytes":
        return f"{digits} B"
    return digits


def _import_ratio(r: dict[str, Any]) -> str:
    """A source's ratio: numerator / denominator (unit) and the share, or why there is none."""
    num, den, val = r.get("numerator"), r.get("denominator"), r.get("value")
    unit = r.get("denominator_unit") or ""
    if num is not None and den:
        return f"{num:,.0f} / {den:,.0f} {unit} ({fmt_pct(num / den)})"
    if den == 0:
        why = r.get("undefined") or "the denominator is 0"
        return f"{num or 0:,.0f} / 0 {unit} (n/a: {why})"
    if num is not None:
        return f"{num:,.0f} / ? (n/a: no denominator in the source)"
    if val is None:
        return "n/a (see note)"
    return f"{fmt_pct(val, digits=2)} (denominator unknown)"


def _import_summary(imp: Any, out: list[str], head: Any, table: Any) -> None:
    """The import's totals in text (copies by direction, GPU activity, NVTX ranges, ...);
    JSON has them under ``import.summary``."""
    s = imp.summary or {}
    lines: list[str] = []

    def activity(label: str, v: Any) -> None:
        if isinstance(v, dict) and v.get("count"):
            lines.append(f"{label}: {v['count']:,}, {fmt_ns(v.get('total_ns'))} in total")

    if "events" in s:
        lines.append(f"trace events: {s['events']:,}")
    if s.get("categories"):
        lines.append("events by category: " + ", ".join(
            f"{k} {v:,}" for k, v in sorted(s["categories"].items(), key=lambda kv: -kv[1])))
    for key, label in (("kernels", "kernels"), ("cuda_runtime", "CUDA runtime calls"),
                       ("runtime", "CUDA runtime calls"), ("cuda_sync", "CUDA syncs"),
                       ("gpu_memset", "memsets")):
        activity(label, s.get(key))
    if isinstance(s.get("sync"), dict):
        for kind, v in sorted(s["sync"].items()):
            activity(f"syncs ({kind})", v)
    fl = s.get("flows")
    if isinstance(fl, dict) and (fl.get("starts") or fl.get("finishes")):
        lines.append(f"flows: {fl['starts']:,} starts, {fl['finishes']:,} finishes, "
                     f"{fl['finishes_without_start']:,} finishes without a start")
    if "session_start_epoch_ns" in s:
        ep = s["session_start_epoch_ns"]
        lines.append("session start: " + ("unknown (times are ns since session start)"
                                          if ep is None else _epoch(ep)))
    if s.get("base_time_ns") is not None:
        lines.append(f"trace base time: {_epoch(s['base_time_ns'])}")
    for key, label in (("other_ns_total", "other"), ("queue_ns_total", "queue"),
                       ("prefill_ns_total", "prefill")):
        if key in s:
            lines.append(f"{label}, all requests: {fmt_ns(s[key])}")
    if "series" in s:
        lines.append(f"series in the scrape: {s['series']:,}, "
                     f"{len(s.get('gauges_and_counters') or {}):,} gauges and counters "
                     "(in --format json)")
    sem = s.get("sglang_semantics")
    if isinstance(sem, dict):
        lines.append(f"sglang release: {sem.get('versions')} (cache_hit_rate read as "
                     f"{str(sem.get('cache_hit_rate')).replace('_', ' ')}); {sem.get('ttft')}")
    if lines:
        head("Summary")
        out.extend(lines)
    mc = s.get("memcpy")
    if isinstance(mc, dict) and mc:
        head("Copies by direction")
        table(Table(["direction", "copies", "with bytes", "without bytes", "bytes", "time"],
                    [[str(k), f"{v.get('count', 0):,}", _num(v.get("with_bytes")),
                      _num(v.get("without_bytes")), f"{v.get('bytes', 0):,}",
                      fmt_ns(v.get("total_ns"))] for k, v in sorted(mc.items())],
                    align="lrrrrr"))
        if any(v.get("without_bytes") for v in mc.values()):
            out.append("bytes: the sum over the copies with bytes; the others' size is unknown")
    nv = s.get("nvtx_ranges")
    if isinstance(nv, dict) and nv:
        top = sorted(nv.items(), key=lambda kv: -kv[1].get("total_ns", 0))
        head(f"NVTX ranges ({len(nv):,} names)")
        table(Table(["range", "count", "total time"],
                    [[k or "(unnamed)", f"{v['count']:,}", fmt_ns(v["total_ns"])]
                     for k, v in top[:_NVTX_LISTED]], align="lrr"))
        if len(top) > _NVTX_LISTED:
            out.append(f"and {len(top) - _NVTX_LISTED:,} more (all in --format json)")


_NVTX_LISTED = 20


def _epoch(ns: int) -> str:
    """An epoch-ns instant as UTC date and time (and the ns, for matching other tools)."""
    from datetime import UTC, datetime

    try:
        when = datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    except (OverflowError, OSError, ValueError):
        when = "out of the calendar's range"
    return f"{when} ({ns:,} epoch ns)"
