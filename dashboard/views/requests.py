"""Requests: pick one, see the waterfall of its stages and transfers and its token accounting."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from agent.schema import TOKEN_SOURCES, TTFT_STAGES
from analyzers.units import fmt_ns
from dashboard import data, echarts, figures
from dashboard.views import common


def _pick(sel: common.Selected) -> str | None:
    slowest = data.slowest_requests(sel.path, sel.version)
    left, right = st.columns([2, 1])
    typed = right.text_input("…or type a request id", key="request_typed").strip()
    picked = left.selectbox(f"Request (the {len(slowest):,} slowest by TTFT)", slowest,
                            key="request_pick")
    return typed or picked


def _accounting(sel: common.Selected, request_id: str) -> None:
    st.subheader("Token accounting")
    if not sel.run.accounting_known:
        common.missing("token accounting", sel.run)
        return
    acct = data.request_accounting(sel.path, sel.version, request_id)
    counts = {s: acct.totals[f"{s}_tokens"] for s in TOKEN_SOURCES}
    common.echart(echarts.token_sources(counts, title="Where the prompt's KV came from",
                                        height=300), key="request_sources")
    keys = ("token_hit_share", "device_hit_share", "host_loaded_share", "remote_loaded_share",
            "host_load_yield", "remote_load_yield", "load_failed_share",
            *(f"prompt_{s}" for s in TOKEN_SOURCES))
    st.dataframe(pd.DataFrame({"measure": [acct.ratio(k).label for k in keys],
                               "value": [str(acct.ratio(k)) for k in keys]}),
                 hide_index=True, key="request_ratios")
    if acct.requests == 0:
        st.caption("This request produced no first token: its counts are outside the "
                   "accounting identity.")
    bad = acct.identity_violations
    if len(bad):
        st.error("Accounting identity broken: " + "; ".join(
            f"{c}: expected {e:,}, got {a:,}" for c, e, a in
            zip(bad["check"], bad["expected"], bad["actual"], strict=True)))


def main() -> None:
    st.title("Requests")
    sel = common.selected_run()
    if sel is None:
        return
    common.show_notes(sel.run)
    if not len(sel.run.requests):
        st.warning("This run has no requests.")
        return
    request_id = _pick(sel)
    detail = data.request_detail(sel.path, sel.version, request_id) if request_id else None
    if detail is None:
        st.error(f"No request {request_id!r} in this run.")
        return
    req, part, spans = detail
    r, p = req.iloc[0], part.iloc[0]
    cols = st.columns(4)
    cols[0].metric("TTFT", fmt_ns(None if pd.isna(p["ttft_ns"]) else int(p["ttft_ns"])))
    cols[1].metric("Status", str(r["status"]))
    cols[2].metric("Prompt tokens", f"{int(r['prompt_tokens']):,}"
                   if pd.notna(r.get("prompt_tokens")) else "-")
    cols[3].metric("Tenant", str(r["tenant"]) if pd.notna(r.get("tenant")) else "-")
    if pd.notna(p["violation"]):
        st.warning(f"Its spans broke the partition rules ({p['violation']}); the stages below "
                   "were resolved by the sweep line.")
    if bool(p["derived"]):
        st.info("Stages derived from overlapping activity spans (no recorded state spans).")
    first = None if pd.isna(r.get("first_token_ns")) else int(r["first_token_ns"])
    st.plotly_chart(figures.request_waterfall(spans, int(r["arrival_ns"]),
                                              title=f"{request_id}: stages and transfers",
                                              first_token_ns=first),
                    key="request_waterfall")
    if pd.notna(p["ttft_ns"]):
        st.dataframe(pd.DataFrame({
            "stage": [*TTFT_STAGES, "ttft", "hidden_load"],
            "time": [fmt_ns(int(p[f"{s}_ns"])) for s in (*TTFT_STAGES, "ttft", "hidden_load")],
        }), hide_index=True, key="request_stages")
    transfers = spans.loc[spans["kind"] == "activity"]
    if len(transfers):
        with st.expander(f"Activity spans ({len(transfers)})"):
            arrival = int(r["arrival_ns"])
            shown = pd.DataFrame({
                "name": transfers["name"], "tier": transfers["tier"],
                "start (ms since arrival)": (transfers["start_ns"] - arrival) / 1e6,
                "duration (ms)": (transfers["end_ns"] - transfers["start_ns"]) / 1e6,
                "tokens": transfers["tokens"], "bytes": transfers["bytes"],
                "transfer_id": transfers["transfer_id"], "request_id": transfers["request_id"],
            })
            ms = st.column_config.NumberColumn(format="%.3f")
            st.dataframe(shown, hide_index=True, column_config={
                "start (ms since arrival)": ms, "duration (ms)": ms,
                "tokens": st.column_config.NumberColumn(format="localized"),
                "bytes": st.column_config.NumberColumn(format="localized")})
    _accounting(sel, request_id)


main()
