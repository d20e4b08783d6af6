"""KV cache: hits, loads and recompute with their denominators, by tier and by layer; block-pool
states over time; evictions."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import data, figures
from dashboard.views import common

_HEADLINE = ("token_hit_share", "device_hit_share", "host_loaded_share", "remote_loaded_share",
             "prompt_recomputed")


def _thousands(df: pd.DataFrame, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """Column configs printing every numeric column with thousands separators (1,234,567)."""
    return {c: st.column_config.NumberColumn(format="localized") for c in df.columns
            if c not in exclude and pd.api.types.is_numeric_dtype(df[c])}


def _counters(sel: common.Selected) -> None:
    """The tier counters recorded as pool samples (bytes, operations, evictions): their
    end-of-run totals with their units, not on the blocks axis."""
    c = data.pool_counters(sel.path, sel.version)
    if not len(c):
        return
    st.markdown("**Tier counters at the end of the run** (cumulative; recorded as `pool` "
                "samples, not block states)")
    shown = pd.DataFrame({
        "tier": c["entity"], "counter": c["counter"],
        "value": [_fmt_counter(v, u) for v, u in zip(c["value"], c["unit"], strict=True)],
        "unit": c["unit"],
    })
    st.dataframe(shown, hide_index=True, key="pool_counters",
                 column_config={"value": st.column_config.TextColumn(width="medium")})


def _fmt_counter(v: float, unit: str) -> str:
    if pd.isna(v):
        return "-"
    n = f"{v:,.0f}" if float(v).is_integer() else f"{v:,.3f}"
    if unit == "bytes" and abs(v) >= 1024:
        for div, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if abs(v) >= div:
                return f"{n} ({v / div:,.1f} {name})"
    return n


def _ratios(sel: common.Selected) -> None:
    acct = data.accounting(sel.path, sel.version)
    st.subheader("Where prompt tokens' KV came from")
    cols = st.columns(len(_HEADLINE))
    for col, key in zip(cols, _HEADLINE, strict=True):
        r = acct.ratio(key)
        col.metric(r.label, "n/a" if r.value is None else f"{100 * r.value:.1f} %")
        col.caption(str(r))
    if acct.without_first_token:
        st.caption(f"{acct.without_first_token:,} request(s) without a first token are outside "
                   "the accounting.")
    st.dataframe(pd.DataFrame({
        "measure": [r.label for r in acct.ratios],
        "tier": [r.tier or "" for r in acct.ratios],
        "value": [str(r) for r in acct.ratios],
    }), hide_index=True, key="ratios_table")
    st.plotly_chart(figures.tier_bars(acct.tiers), key="tier_bars")
    st.dataframe(acct.tiers, hide_index=True, key="tiers_table",
                 column_config=_thousands(acct.tiers, exclude=("tier",)))
    failed = acct.failures.loc[acct.failures["tokens"] > 0]
    if len(failed):
        st.markdown("**Failed loads** (promised, then recomputed)")
        st.dataframe(failed, hide_index=True, key="failures_table",
                     column_config=_thousands(failed, exclude=("reason",)))
    if len(acct.identity_violations):
        st.error(f"{len(acct.identity_violations):,} accounting identity violation(s).")
        st.dataframe(acct.identity_violations.head(100), hide_index=True)


def main() -> None:
    st.title("KV cache")
    sel = common.selected_run()
    if sel is None:
        return
    run = sel.run
    common.show_notes(run)
    if run.accounting_known:
        _ratios(sel)
    else:
        common.missing("token accounting", run)
    st.subheader("By layer")
    table = data.layer_table(sel.path, sel.version)
    if table is None:
        common.missing("per-layer rows", run)
    else:
        st.plotly_chart(figures.layer_heatmap(table), key="layer_heatmap")
        if int(table["identity_violations"].sum()):
            st.caption("Some request × layer rows do not sum to the prompt (e.g. a sliding-"
                       "window layer group keeps fewer tokens): see identity_violations.")
    st.subheader("Block pool")
    pool = data.pool_states(sel.path, sel.version)
    if len(pool):
        st.plotly_chart(figures.pool_states(pool, origin_ns=data.origin_ns(sel.path,
                                                                           sel.version)),
                        key="pool_states")
    else:
        common.missing("block-pool samples", run)
    _counters(sel)
    st.subheader("Evictions")
    ev = data.events_named(sel.path, sel.version, "eviction")
    if len(ev):
        st.plotly_chart(figures.event_counts(ev, title=f"{len(ev):,} eviction event(s)",
                                             origin_ns=data.origin_ns(sel.path, sel.version)),
                        key="evictions")
        shown = data.events_table(sel.path, sel.version, "eviction")
        if len(ev) > len(shown):
            st.caption(f"The first {len(shown):,} of {len(ev):,} eviction events.")
        st.dataframe(shown, hide_index=True, key="evictions_table", column_config={
            "t (s since start)": st.column_config.NumberColumn(format="%.3f s"),
            **_thousands(shown, exclude=("t (s since start)",))})
    else:
        common.missing("eviction events", run)

main()
