"""Overview, the page an on-call engineer keeps open: the headline numbers, where TTFT went
(stages) beside where the KV came from (token sources), TTFT with failures, breaker-open periods
and evictions on one time axis, and the top findings with their evidence."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from agent.schema import TOKEN_SOURCES, TTFT_STAGES
from analyzers.units import fmt_ns
from dashboard import data, echarts
from dashboard.views import common

_GROUPINGS = {"hit class": "hit_class", "tenant": "tenant", "workload class": "workload_class"}
_SEVERITY_BOX = {"critical": st.error, "warning": st.warning, "info": st.info}


def _means(stages: pd.DataFrame) -> dict[str, float]:
    return dict(zip(stages["stage"], stages["mean_ns"], strict=True))


def _time_share(num_ns: int, den_ns: int | None) -> str:
    """``12.3 s / 45.6 s TTFT (27.0 %)``: shares print their numerator and denominator."""
    if not den_ns:
        return f"{fmt_ns(num_ns)} / - TTFT"
    return f"{fmt_ns(num_ns)} / {fmt_ns(den_ns)} TTFT ({100 * num_ns / den_ns:.1f} %)"


def _findings(sel: common.Selected) -> None:
    st.subheader("Top findings")
    report, why = data.diagnoses(sel.path, sel.version)
    if report is None:
        st.info(why)
        return
    if not report.findings:
        st.success(f"No findings ({len(report.passed)} rules evaluated clean).")
    for f in report.findings[:5]:
        body = "\n".join(f"- {e}" for e in f.evidence)
        _SEVERITY_BOX[f.severity](f"**{f.severity.upper()}: {f.title}** (`{f.rule}`)\n\n{body}"
                                  f"\n\n**Next step:** {f.next_step}")
    if len(report.findings) > 5:
        st.caption(f"{len(report.findings) - 5} more finding(s): `kvscope analyze`")
    if report.not_evaluated:
        with st.expander(f"Rules not evaluated ({len(report.not_evaluated)})"):
            for n in report.not_evaluated:
                st.markdown(f"- `{n.rule}`: {n.reason}")


def _ratio_metric(col: Any, acct: Any, key: str, label: str) -> None:
    r = acct.ratio(key)
    col.metric(label, "n/a" if r.value is None else f"{100 * r.value:.1f} %")
    col.caption(f"{r.numerator:,} / {r.denominator:,} {r.unit}")


def _headline(sel: common.Selected, summary: Any) -> None:
    run = sel.run
    ttft = summary.stage("ttft")
    cols = st.columns(6)
    cols[0].metric("Requests with a first token", f"{summary.requests:,}")
    cols[0].caption(f"of {len(run.requests):,} requests")
    cols[1].metric("Without a first token", f"{summary.without_first_token:,}")
    cols[2].metric("TTFT p50", fmt_ns(ttft.get("p50_ns")))
    cols[3].metric("TTFT p99", fmt_ns(ttft.get("p99_ns")))
    if run.accounting_known:
        acct = data.accounting(sel.path, sel.version)
        _ratio_metric(cols[4], acct, "token_hit_share", "Token hit share")
        failed = int(acct.totals.get("load_failed_tokens", 0))
        cols[5].metric("Failed-load tokens", f"{failed:,}")
        r = acct.ratio("requests_load_failed")
        cols[5].caption(f"{r.numerator:,} / {r.denominator:,} requests met a failed load")
    else:
        cols[4].metric("Token hit share", "n/a")
        cols[4].caption("no token accounting in this run")
        cols[5].metric("Stage violations", f"{summary.violations:,}")


def _sources(sel: common.Selected, where: Any) -> None:
    with where:
        if not sel.run.accounting_known:
            common.missing("token accounting", sel.run)
            return
        acct = data.accounting(sel.path, sel.version)
        counts = {s: int(acct.totals.get(f"{s}_tokens", 0)) for s in TOKEN_SOURCES}
        common.echart(echarts.token_sources(
            counts, title="Where the prompt tokens' KV came from",
            of="of requests with a first token"), key="token_sources")


def _incidents(sel: common.Selected, summary: Any) -> None:
    inc = data.incidents(sel.path, sel.version)
    common.echart(echarts.incidents(summary.windows, inc.windows, inc.breaker,
                                    origin_ns=data.origin_ns(sel.path, sel.version)),
                  key="incidents")
    bits = []
    if len(inc.breaker):
        bits.append("breaker open " + ", ".join(
            f"{b.op or 'remote'} {b.start_s:,.2f} s → "
            + (f"{b.end_s:,.2f} s" if b.closed else "end of run (never closed)")
            for b in inc.breaker.itertuples(index=False)))
    if inc.remote_errors_from:
        bits.append(f"remote errors from {inc.remote_errors_from}")
    bits.append(f"windows of {summary.window_ns / 1e9:g} s by arrival; evictions by event time")
    st.caption("; ".join(bits) + ".")


def main() -> None:
    st.title("Overview")
    sel = common.selected_run()
    if sel is None:
        return
    run = sel.run
    common.show_notes(run)
    if not len(run.requests):
        st.warning("This run has no requests: there is no TTFT to break down.")
        if run.distributions is not None and len(run.distributions):
            st.subheader("Distributions in the imported metrics")
            st.dataframe(run.distributions, hide_index=True)
        return
    summary = data.ttft_summary(sel.path, sel.version)
    ttft = summary.stage("ttft")
    _headline(sel, summary)
    if summary.derived:
        st.info(f"{summary.derived:,} / {summary.requests:,} requests have stages derived from "
                "overlapping activity spans (sweep line), not recorded state spans.")
    if not summary.requests:
        st.warning("No request produced a first token: no TTFT to show.")
        _findings(sel)
        return
    left, right = st.columns(2)
    with left:
        group = st.radio("Break the stages down by", list(_GROUPINGS), horizontal=True,
                         key="overview_group")
        grouped = data.ttft_summary(sel.path, sel.version, by=_GROUPINGS[group])
        by_col = _GROUPINGS[group]
        bars = {"all": _means(summary.stages)}
        slow = summary.slowest
        bars["slowest 1 % (≥ p99)"] = dict(zip(slow["stage"], slow["mean_ns"], strict=True))
        for key, rows in grouped.stages.groupby(by_col, sort=True):
            bars[f"{group}: {key}"] = _means(rows)
        common.echart(echarts.stage_breakdown(bars, title="Where TTFT went: mean by stage"),
                      key="stage_breakdown")
    _sources(sel, right)
    _incidents(sel, summary)
    _findings(sel)
    table = summary.stages.loc[summary.stages["stage"].isin([*TTFT_STAGES, "ttft",
                                                             "hidden_load"])]
    st.subheader("TTFT by stage")
    st.markdown(common.markdown_table(pd.DataFrame({
        "stage": table["stage"],
        "p50": table["p50_ns"].map(fmt_ns), "p90": table["p90_ns"].map(fmt_ns),
        "p99": table["p99_ns"].map(fmt_ns), "mean": table["mean_ns"].map(fmt_ns),
        "time / all requests' TTFT": [_time_share(t, ttft.get("total_ns"))
                                       for t in table["total_ns"]],
    })))


main()
